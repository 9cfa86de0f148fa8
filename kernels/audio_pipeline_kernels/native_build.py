"""What the native CPU kernels share: building on first use (LazyKernel, the build flags and
fingerprint) and the C++ they all include (THREADS_SOURCE, VECTOR_SOURCE, EXP_SOURCE).

Each kernel (paged attention, the sampler, the decode step's products and layers) is compiled with
torch's C++ extension builder the first time it is used, for this CPU, and cached in torch's
extension folder under a fingerprint of its source, flags and CPU; where it cannot be built (no
compiler, no ninja), its LazyKernel answers None and a torch form serves.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import threading

logger = logging.getLogger(__name__)

#: What every kernel's C++ includes, in place of torch/extension.h (torch's whole C++ API: about 50 s
#: of parsing per build on a 2-core machine, against about 20 s for these): tensors, the operators
#: the kernels call, the thread setting, and pybind11 with torch's tensor conversions.
PRELUDE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
"""

#: C++ the native kernels include: run a loop's parts on plain threads. torch's extension builder
#: compiles without OpenMP, so at::parallel_for (whose OpenMP form is a pragma in ATen's header)
#: runs serially in an extension; a prompt step's large loops (on model.prefill_threads) start
#: plain threads instead, a few microseconds each against milliseconds of work.
THREADS_SOURCE = r"""
#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

// fn(begin, end) over [0, count) in `threads` contiguous parts, the first on the calling thread.
template <typename F>
void in_threads(int64_t count, int64_t threads, const F& fn) {
  threads = std::max<int64_t>(1, std::min(threads, count));
  if (threads == 1) {
    fn(int64_t(0), count);
    return;
  }
  const int64_t part = (count + threads - 1) / threads;
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = t * part, end = std::min(count, begin + part);
    if (begin >= end) continue;
    try {
      helpers.emplace_back([&fn, begin, end] { fn(begin, end); });
    } catch (const std::system_error&) {  // no thread to be had (a process limit): this part here
      fn(begin, end);
    }
  }
  fn(int64_t(0), std::min(count, part));
  for (auto& helper : helpers) helper.join();
}

// Threads for `work` multiply-adds (or like operations): torch's intra-op setting, at most one a
// ~4M of work.
inline int64_t threads_for(int64_t work) {
  return std::min<int64_t>(int64_t(at::get_num_threads()), std::max<int64_t>(1, work >> 22));
}
"""

#: C++ of the kernels' vectors, written once: ``vec`` holds W float32 lanes (AVX-512: 16, AVX2 with
#: FMA: 8, elsewhere a plain array of 4 the compiler vectorizes for its target) with the same
#: operations on each, where std::fma rounds once as the FMA instructions do, so the bits are the
#: same on every instruction set. Where 16-bit loads widen in registers (AVX-512, or AVX2 with F16C:
#: VECTOR_LOADS), ``vload`` also takes float16 and bfloat16 (the attention's 16-bit cache).
VECTOR_SOURCE = r"""
#include <cmath>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VECTOR_LOADS 1
using vec = __m512;
constexpr int W = 16;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vload(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline vec vload(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int W = 8;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float vsum(vec v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#if defined(__F16C__)
#define VECTOR_LOADS 1
static inline vec vload(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vec vload(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif
#else
constexpr int W = 4;
struct vec { float v[W]; };
static inline vec vzero() { vec r; for (int i = 0; i < W; ++i) r.v[i] = 0.0f; return r; }
static inline vec vset1(float x) { vec r; for (int i = 0; i < W; ++i) r.v[i] = x; return r; }
static inline vec vload(const float* p) { vec r; std::memcpy(r.v, p, sizeof r.v); return r; }
static inline void vstore(float* p, vec v) { std::memcpy(p, v.v, sizeof v.v); }
static inline vec vfma(vec a, vec b, vec c) {
  vec r;
  for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
static inline vec vadd(vec a, vec b) { vec r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
static inline float vsum(vec v) { float s = 0.0f; for (int i = 0; i < W; ++i) s += v.v[i]; return s; }
#endif
"""

#: C++ the sampler and the decode layers include: exp by range reduction and a polynomial, in plain
#: arithmetic the compiler vectorizes (a libm call per element does not).
EXP_SOURCE = r"""
#include <cstdint>
#include <cstring>

// exp(x) for x in [-87, 88] (callers clamp, and say what lies outside): 2^k times a degree-6
// polynomial of the remainder x - k ln 2 (ln 2 in two parts), relative error about 2e-7, a
// float's rounding; no call, no branch.
inline float exp_in_range(float x) {
  const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
}
"""


def _put_ninja_on_path() -> None:
    """torch's builder runs the ``ninja`` command; the ``ninja`` package installs it beside this
    interpreter (a virtual environment's bin/, not on PATH unless activated)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _target_flags() -> list[str]:
    """On x86-64, this CPU's instruction set (AVX-512, or AVX2 with FMA and F16C, where present: the
    kernel's vector loads); elsewhere (ARM) the compiler's default target, whose baseline has the
    vectors and half-precision conversions the portable loops compile to (and not every ARM compiler
    takes -march=native)."""
    import platform

    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else []


def _build_tag(cflags: list[str], source: str) -> str:
    """A short fingerprint of a kernel's ``source``, its flags and this CPU's model and instruction-set
    flags: a changed kernel gets a build of its own, and a cache folder shared with another kind of
    CPU never serves a build made for this one."""
    import hashlib
    import platform

    identity = source + " ".join(cflags) + platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        identity += "".join(sorted(set(lines)))
    except OSError:  # not Linux: the processor string is what there is
        identity += platform.processor()
    return hashlib.sha1(identity.encode()).hexdigest()[:10]


def _bindings(functions: list[str]) -> str:
    """The module's pybind11 definitions. A failed check (c10::Error) reaches Python as a
    RuntimeError with its message and without the C++ backtrace, as torch's own bindings give."""
    defs = "\n".join(f'  m.def("{name}", &{name});' for name in functions)
    return r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::register_local_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const c10::Error& error) {
      PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
    }
  });
""" + defs + "\n}\n"


def build_extension(kind: str, source: str, functions: list[str], cflags: list[str]):
    """Compiles ``source`` (after PRELUDE) with ``cflags`` into a module exposing ``functions``, or
    finds it built in torch's extension folder (under ``audio_pipeline_<kind>_<fingerprint>``);
    raises where it cannot be built."""
    from torch.utils.cpp_extension import load_inline

    _put_ninja_on_path()
    full = PRELUDE + source + _bindings(functions)
    # torch's builder puts torch/extension.h first unless told not to (torch 2.5 and later).
    lean = {"no_implicit_headers": True} if "no_implicit_headers" in inspect.signature(load_inline).parameters else {}
    return load_inline(f"audio_pipeline_{kind}_{_build_tag(cflags, full)}", cpp_sources=full, extra_cflags=cflags,
                       verbose=False, **lean)


class LazyKernel:
    """A kernel built on its first call (under a lock, once): ``build()``'s result, or None where it
    cannot be built (no compiler, no ninja, ...), after a warning naming ``what`` and ``fallback``."""

    def __init__(self, build, what: str, fallback: str):
        self.build, self.what, self.fallback = build, what, fallback
        self.kernel = None
        self.tried = False
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if not self.tried:
                self.tried = True
                try:
                    self.kernel = self.build()
                except Exception as exc:  # noqa: BLE001 - the torch form serves instead
                    logger.warning("%s could not be built (%s); %s", self.what,
                                   str(exc).splitlines()[0] if str(exc) else type(exc).__name__, self.fallback)
                    self.kernel = None
            return self.kernel

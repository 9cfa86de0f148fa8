"""Paged attention on CPU as a small C++ kernel, built on first use; reads keys and values in place.

The torch form (``ragged_paged_attention``) gathers every sequence's keys and values into a padded
batch each layer before one ``scaled_dot_product_attention``; on CPU that gather and the padding are
most of a decode step's attention time. This kernel walks each sequence's page list (the step
metadata of ``paged_layout``, the same one FlashInfer reads) and reads the cache rows where they
are, with a softmax per (sequence, head), so nothing is copied and short sequences do not pay for
long ones. Queries and outputs are float32; the cache is float32, float16 or bfloat16, a 16-bit one
widened to float32 as it is loaded (a decode step's attention is bound by the bytes it reads, and
16 bits halve them).

It is compiled with torch's C++ extension builder (needs a C++ compiler and the ``ninja`` package)
the first time it is used and cached in torch's extension folder; where that fails,
``native_attention()`` returns None and callers use the torch form.
"""

from __future__ import annotations

from audio_pipeline_kernels.native_build import (THREADS_SOURCE, VECTOR_SOURCE, LazyKernel, _target_flags,
                                                  build_extension)

_SOURCE = THREADS_SOURCE + VECTOR_SOURCE + r"""
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

// A 16-bit cache is widened to float32 in registers as it is loaded (F16C's conversion for float16,
// a 16-bit shift for bfloat16), so the arithmetic is the float32 kernel's and only half the bytes
// cross the memory bus, the bound of a decode step on CPU. The vector forms below are compiled
// where the build machine has the instructions (-march=native): AVX-512, else AVX2 with FMA and
// F16C; elsewhere (ARM, older x86) the portable loops widen a row into a small float32 buffer first.
// (VECTOR_SOURCE: the vectors, and VECTOR_LOADS where they widen 16-bit loads.)

// The portable widening: `n` stored elements at `src` as float32 (in `buf` unless already float32).
static inline const float* as_float(const float* src, float*, int64_t) { return src; }

static inline const float* as_float(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);  // c10's conversion: native on ARM
  return buf;
}

static inline const float* as_float(const c10::BFloat16* src, float* buf, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {  // float32's upper half: a shift, which compilers vectorize
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(buf + i, &wide, sizeof(float));
  }
  return buf;
}

// q . k over a head of DIM (a compile-time head size, a multiple of the vector width).
template <int DIM, typename T>
static inline float dot(const float* q, const T* k, float* buf) {
#ifdef VECTOR_LOADS
  static_assert(DIM % W == 0, "head sizes dispatched on are multiples of the vector width");
  vec s0 = vzero(), s1 = vzero();  // two chains: consecutive multiply-adds do not wait on each other
  int d = 0;
  for (; d + 2 * W <= DIM; d += 2 * W) {
    s0 = vfma(vload(q + d), vload(k + d), s0);
    s1 = vfma(vload(q + d + W), vload(k + d + W), s1);
  }
  if (d < DIM) s0 = vfma(vload(q + d), vload(k + d), s0);
  return vsum(vadd(s0, s1));
#else
  const float* x = as_float(k, buf, DIM);
  float s = 0.f;
  for (int64_t d = 0; d < DIM; ++d) s += q[d] * x[d];
  return s;
#endif
}

// a[0:DIM] += sum over t < n of p[t] * v[t * row : t * row + DIM], in registers (two rows at a time
// into two sets of sums, so consecutive multiply-adds do not wait on each other).
template <int DIM, typename T>
static inline void weighted_sum(const float* p, const T* v, int64_t row, int64_t n, float* a, float* buf) {
#ifdef VECTOR_LOADS
  constexpr int V = DIM / W;
  vec a0[V], a1[V];
  for (int j = 0; j < V; ++j) a0[j] = a1[j] = vzero();
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    const vec p0 = vset1(p[t]), p1 = vset1(p[t + 1]);
    const T* x0 = v + t * row;
    const T* x1 = x0 + row;
    for (int j = 0; j < V; ++j) {
      a0[j] = vfma(p0, vload(x0 + W * j), a0[j]);
      a1[j] = vfma(p1, vload(x1 + W * j), a1[j]);
    }
  }
  if (t < n) {
    const vec p0 = vset1(p[t]);
    for (int j = 0; j < V; ++j) a0[j] = vfma(p0, vload(v + t * row + W * j), a0[j]);
  }
  for (int j = 0; j < V; ++j) vstore(a + W * j, vadd(vload(a + W * j), vadd(a0[j], a1[j])));
#else
  float a0[DIM] = {}, a1[DIM] = {};
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    const float* x0 = as_float(v + t * row, buf, DIM);
    const float* x1 = as_float(v + (t + 1) * row, buf + DIM, DIM);
    for (int64_t d = 0; d < DIM; ++d) { a0[d] += p[t] * x0[d]; a1[d] += p[t + 1] * x1[d]; }
  }
  if (t < n) {
    const float* x0 = as_float(v + t * row, buf, DIM);
    for (int64_t d = 0; d < DIM; ++d) a0[d] += p[t] * x0[d];
  }
  for (int64_t d = 0; d < DIM; ++d) a[d] += a0[d] + a1[d];
#endif
}

// Asks for the 64-byte cache lines of `bytes` at `p` ahead of their use, into L2 (they are read a
// page or a pass later). Measured on a batch-32 float16 step (4 layers, 400 positions): a row at a
// time beat a whole page at once and every other line, and asking for the values in pass 1 as well
// as the next keys took it from 1.6 to 1.1 ms.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

// One sequence, every head: scores, softmax and the weighted value sums. The cache is
// [pages, page_size, kv_heads, dim]; a token's row holds all its kv heads side by side, so pass 1
// walks each page's rows once, in order, for all heads. Pages are scattered, so the hardware's
// prefetcher loses the stream at every page: while pass 1 reads a key page it asks for the next key
// page and for this page's values (which pass 3 then finds in cache), a row at a time. DIM is the
// head size when it is one of the common ones (known at compile time, the dot products and row
// updates unroll into a few vector operations); 0 for any other size. T is the cache's element type
// (float, c10::Half, c10::BFloat16); queries, scores and sums are float32. Scores are
// [query][head][position], accumulators [query][head][dim]; `wide` holds rows widened by the
// portable loops.
template <typename T, int DIM>
static void attend_sequence(const float* q, const T* kc, const T* vc, const int32_t* pages,
                            int64_t page_size, int64_t heads, int64_t group, int64_t kv_heads, int64_t len,
                            int64_t nq, int64_t dim_rt, float scale, int64_t window, float* out,
                            std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& wide) {
  const int64_t dim = DIM ? DIM : dim_rt;
  const int64_t row = kv_heads * dim, page_stride = page_size * row, first = len - nq;
  // A sliding window: query i (at position first + i) sees positions lo(i) .. first + i; the pages
  // wholly before the first query's window are not read at all.
  auto lo = [&](int64_t i) -> int64_t { return window > 0 ? std::max<int64_t>(0, first + i + 1 - window) : 0; };
  const int64_t begin = (lo(0) / page_size) * page_size;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  scores.resize(nq * heads * len);
  acc.assign(nq * heads * dim, 0.f);
  wide.resize(std::max<int64_t>(row, 2 * dim));
  float* const buf = wide.data();
  // Pass 1: scores.
  for (int64_t start = begin; start < len; start += page_size) {
    const int64_t n = std::min(page_size, len - start), next = start + page_size;
    const int64_t page = static_cast<int64_t>(pages[start / page_size]) * page_stride;
    const T* kb = kc + page;
    const T* next_kb = next < len ? kc + static_cast<int64_t>(pages[next / page_size]) * page_stride : nullptr;
    const int64_t next_n = next < len ? std::min(page_size, len - next) : 0;
    for (int64_t t = 0; t < n; ++t) {
      if (t < next_n) prefetch(next_kb + t * row, row_bytes);
      prefetch(vc + page + t * row, row_bytes);
      const int64_t pos = start + t;
      if constexpr (DIM != 0) {
        const T* krow = kb + t * row;
        for (int64_t i = std::max<int64_t>(0, pos - first); i < nq; ++i) {
          const float* qi = q + i * heads * dim;
          float* si = scores.data() + i * heads * len + pos;
          for (int64_t h = 0; h < heads; ++h)
            si[h * len] = dot<DIM>(qi + h * dim, krow + (h / group) * dim, buf) * scale;
        }
      } else {
        const float* krow = as_float(kb + t * row, buf, row);
        for (int64_t i = std::max<int64_t>(0, pos - first); i < nq; ++i) {
          const float* qi = q + i * heads * dim;
          float* si = scores.data() + i * heads * len + pos;
          for (int64_t h = 0; h < heads; ++h) {
            const float* k = krow + (h / group) * dim;
            const float* qh = qi + h * dim;
            float s = 0.f;
            for (int64_t d = 0; d < dim; ++d) s += qh[d] * k[d];
            si[h * len] = s * scale;
          }
        }
      }
    }
  }
  // Pass 2: softmax per (query, head) over the positions it sees.
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t visible = first + i + 1, low = lo(i);
    for (int64_t h = 0; h < heads; ++h) {
      float* si = scores.data() + (i * heads + h) * len;
      float m = si[low];
      for (int64_t j = low + 1; j < visible; ++j) m = si[j] > m ? si[j] : m;
      float sum = 0.f;
      for (int64_t j = low; j < visible; ++j) { si[j] = std::exp(si[j] - m); sum += si[j]; }
      const float inv = 1.f / sum;
      for (int64_t j = low; j < visible; ++j) si[j] *= inv;
    }
  }
  // Pass 3: weighted sums of the value rows, a page at a time (it stays in cache across the heads
  // that read it).
  for (int64_t start = begin; start < len; start += page_size) {
    const int64_t n = std::min(page_size, len - start);
    const T* vb = vc + static_cast<int64_t>(pages[start / page_size]) * page_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t visible = std::min(n, first + i + 1 - start);
      const int64_t skip = std::max<int64_t>(0, lo(i) - start);  // this page's rows before the window
      if (visible <= skip) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float* si = scores.data() + (i * heads + h) * len + start + skip;
        const T* v0 = vb + skip * row + (h / group) * dim;
        float* a = acc.data() + (i * heads + h) * dim;
        if constexpr (DIM != 0) {
          weighted_sum<DIM>(si, v0, row, visible - skip, a, buf);
        } else {
          for (int64_t t = 0; t < visible - skip; ++t) {
            const float* x = as_float(v0 + t * row, buf, dim);
            for (int64_t d = 0; d < dim; ++d) a[d] += si[t] * x[d];
          }
        }
      }
    }
  }
  std::copy(acc.begin(), acc.end(), out);
}

// One step over caches of element type T; the arguments are paged_attention's.
template <typename T>
static void attend_step(const float* q, const T* kc, const T* vc, const int32_t* qo, const int32_t* kvp,
                        const int32_t* idx, const int32_t* lens, int64_t batch, int64_t heads, int64_t dim,
                        int64_t page_size, int64_t kv_heads, float scale, int64_t window, float* o) {
  const int64_t group = heads / kv_heads;
  // More threads for a prompt step (its queries times its keys, roughly), split by sequence.
  if (batch == 0) return;
  const int64_t work = static_cast<int64_t>(qo[batch]) * heads * dim * 2 * std::max<int32_t>(1, lens[batch - 1]);
  in_threads(batch, threads_for(work), [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, wide;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t nq = qo[b + 1] - qo[b];
      const float* qb = q + static_cast<int64_t>(qo[b]) * heads * dim;
      float* ob = o + static_cast<int64_t>(qo[b]) * heads * dim;
      const int32_t* pages = idx + kvp[b];
      switch (dim) {
#define CASE(D) case D: attend_sequence<T, D>(qb, kc, vc, pages, page_size, heads, group, kv_heads, lens[b], nq, dim, scale, window, ob, scores, acc, wide); break;
        CASE(32) CASE(48) CASE(64) CASE(80) CASE(96) CASE(128)
#undef CASE
        default: attend_sequence<T, 0>(qb, kc, vc, pages, page_size, heads, group, kv_heads, lens[b], nq, dim, scale, window, ob, scores, acc, wide);
      }
    }
  });
}

// query [T, H, D] float32; caches [pages, page_size, Hkv, D], float32, float16 or bfloat16 (both
// alike); qo_indptr, kv_indptr [B + 1], kv_indices, seq_lens [B] (int32: the step metadata's page
// lists, see paged_layout.py); window: a sliding window (each query sees the window positions ending
// at its own), 0 for none. The output is float32.
at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor qo_indptr, at::Tensor kv_indptr, at::Tensor kv_indices,
                           at::Tensor seq_lens, double scale, int64_t window) {
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(query.scalar_type() == at::kFloat, "float32 queries only");
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16,
              "float32, float16 or bfloat16 caches only");
  TORCH_CHECK(value_cache.scalar_type() == cache_type, "keys and values in one dtype");
  TORCH_CHECK(kv_indices.scalar_type() == at::kInt && kv_indptr.scalar_type() == at::kInt &&
              qo_indptr.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 metadata");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  query = query.contiguous();
  auto out = at::empty_like(query);
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t page_size = key_cache.size(1), kv_heads = key_cache.size(2), batch = seq_lens.size(0);
  const float* q = query.data_ptr<float>();
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Plain memory from here on: other Python threads (gRPC, the decoder) run meanwhile.
  pybind11::gil_scoped_release no_gil;
  switch (cache_type) {
#define STEP(T) attend_step<T>(q, key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), qo, kvp, idx, lens, batch, \
                              heads, dim, page_size, kv_heads, fscale, window, o); break;
    case at::kHalf: STEP(c10::Half)
    case at::kBFloat16: STEP(c10::BFloat16)
    default: STEP(float)
#undef STEP
  }
  return out;
}
"""


def build_native_attention(target_flags: list[str] | None = None):
    """Compiles the kernel (or finds it built, in torch's extension folder) and returns its
    ``paged_attention``; raises where it cannot be built. ``target_flags`` choose the instruction
    set, this machine's by default; the tests build the portable loops with a baseline x86-64."""
    cflags = ["-O3", "-ffast-math", *(_target_flags() if target_flags is None else target_flags)]
    return build_extension("paged_attention", _SOURCE, ["paged_attention"], cflags).paged_attention


#: The compiled kernel's ``paged_attention`` function, or None where it cannot be built.
native_attention = LazyKernel(build_native_attention, "the native CPU paged-attention kernel", "using the torch form")

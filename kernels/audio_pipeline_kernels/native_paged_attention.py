"""Paged attention on CPU as a small C++ kernel, built on first use; reads keys and values in place.

The torch form (``ragged_paged_attention``) gathers every sequence's keys and values into a padded
batch each layer before one ``scaled_dot_product_attention``; on CPU that gather and the padding are
most of a decode step's attention time. This kernel walks each sequence's page list (the step
metadata of ``paged_layout``, the same one FlashInfer reads) and reads the cache rows where they are, with an online softmax per (sequence, head), so nothing is copied and
short sequences do not pay for long ones.

It is compiled with torch's C++ extension builder (needs a C++ compiler and the ``ninja`` package)
the first time it is used and cached in torch's extension folder; where that fails,
``native_attention()`` returns None and callers use the torch form.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// One sequence, every head: scores, softmax and the weighted value sums. The cache is
// [pages, page_size, kv_heads, dim]; a token's row holds all its kv heads side by side, so the
// passes walk each page's rows once, in order, for all heads (one sweep of contiguous memory,
// which the prefetcher follows). DIM is the head size when it is one of the common ones (known at
// compile time, the dot products and row updates unroll into a few vector operations); 0 for any
// other size. Scores are [query][head][position], accumulators [query][head][dim].
template <int DIM>
static void attend_sequence(const float* q, const float* kc, const float* vc, const int32_t* pages,
                            int64_t page_size, int64_t heads, int64_t group, int64_t kv_heads, int64_t len,
                            int64_t nq, int64_t dim_rt, float scale, float* out, std::vector<float>& scores,
                            std::vector<float>& acc) {
  const int64_t dim = DIM ? DIM : dim_rt;
  const int64_t row = kv_heads * dim, page_stride = page_size * row, first = len - nq;
  scores.resize(nq * heads * len);
  acc.assign(nq * heads * dim, 0.f);
  // Pass 1: scores.
  for (int64_t start = 0; start < len; start += page_size) {
    const int64_t n = std::min(page_size, len - start);
    const float* kb = kc + static_cast<int64_t>(pages[start / page_size]) * page_stride;
    for (int64_t t = 0; t < n; ++t) {
      const float* krow = kb + t * row;
      const int64_t pos = start + t;
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
  // Pass 2: softmax per (query, head) over the positions it sees.
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t visible = first + i + 1;
    for (int64_t h = 0; h < heads; ++h) {
      float* si = scores.data() + (i * heads + h) * len;
      float m = si[0];
      for (int64_t j = 1; j < visible; ++j) m = si[j] > m ? si[j] : m;
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) { si[j] = std::exp(si[j] - m); sum += si[j]; }
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < visible; ++j) si[j] *= inv;
    }
  }
  // Pass 3: weighted sums of the value rows, a page at a time (it stays in cache across the heads
  // that read it); each (query, head) sums in registers (two chains, so consecutive multiply-adds
  // do not wait on each other) when DIM is known.
  for (int64_t start = 0; start < len; start += page_size) {
    const int64_t n = std::min(page_size, len - start);
    const float* vb = vc + static_cast<int64_t>(pages[start / page_size]) * page_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t visible = std::min(n, first + i + 1 - start);
      if (visible <= 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float* si = scores.data() + (i * heads + h) * len + start;
        const float* v0 = vb + (h / group) * dim;
        float* a = acc.data() + (i * heads + h) * dim;
        if (DIM) {
          float a0[DIM ? DIM : 1] = {}, a1[DIM ? DIM : 1] = {};
          int64_t t = 0;
          for (; t + 1 < visible; t += 2) {
            const float p0 = si[t], p1 = si[t + 1];
            const float* x0 = v0 + t * row; const float* x1 = x0 + row;
            for (int64_t d = 0; d < DIM; ++d) { a0[d] += p0 * x0[d]; a1[d] += p1 * x1[d]; }
          }
          if (t < visible) {
            const float p0 = si[t];
            const float* x0 = v0 + t * row;
            for (int64_t d = 0; d < DIM; ++d) a0[d] += p0 * x0[d];
          }
          for (int64_t d = 0; d < DIM; ++d) a[d] += a0[d] + a1[d];
        } else {
          for (int64_t t = 0; t < visible; ++t)
            for (int64_t d = 0; d < dim; ++d) a[d] += si[t] * v0[t * row + d];
        }
      }
    }
  }
  std::copy(acc.begin(), acc.end(), out);
}

// query [T, H, D]; caches [pages, page_size, Hkv, D]; qo_indptr, kv_indptr [B + 1], kv_indices, seq_lens
// [B] (int32: the step metadata's page lists, see paged_layout.py).
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor qo_indptr, torch::Tensor kv_indptr, torch::Tensor kv_indices,
                              torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && key_cache.scalar_type() == torch::kFloat,
              "float32 only");
  TORCH_CHECK(kv_indices.scalar_type() == torch::kInt && kv_indptr.scalar_type() == torch::kInt &&
              qo_indptr.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt, "int32 metadata");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  query = query.contiguous();
  auto out = torch::empty_like(query);
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t page_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, batch = seq_lens.size(0);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t nq = qo[b + 1] - qo[b];
      const float* qb = q + static_cast<int64_t>(qo[b]) * heads * dim;
      float* ob = o + static_cast<int64_t>(qo[b]) * heads * dim;
      const int32_t* pages = idx + kvp[b];
      switch (dim) {
#define CASE(D) case D: attend_sequence<D>(qb, kc, vc, pages, page_size, heads, group, kv_heads, lens[b], nq, dim, fscale, ob, scores, acc); break;
        CASE(32) CASE(48) CASE(64) CASE(80) CASE(96) CASE(128)
#undef CASE
        default: attend_sequence<0>(qb, kc, vc, pages, page_size, heads, group, kv_heads, lens[b], nq, dim, fscale, ob, scores, acc);
      }
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_tried = False


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


def _cpu_tag() -> str:
    """A short fingerprint of this CPU's model and instruction-set flags."""
    import hashlib
    import platform

    identity = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        identity += "".join(sorted(set(lines)))
    except OSError:  # not Linux: the processor string is what there is
        identity += platform.processor()
    return hashlib.sha1(identity.encode()).hexdigest()[:10]


def native_attention():
    """The compiled kernel's ``paged_attention`` function, or None where it cannot be built."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                from torch.utils.cpp_extension import load_inline

                _put_ninja_on_path()
                # Built for this CPU's instruction set (AVX2 / AVX-512 where present); the name carries
                # the CPU's identity, so a cache folder shared with another kind of CPU never serves it.
                _module = load_inline(f"audio_pipeline_paged_attention_nhd_{_cpu_tag()}", cpp_sources=_SOURCE,
                                      functions=["paged_attention"],
                                      extra_cflags=["-O3", "-ffast-math", "-march=native"], verbose=False)
            except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, ...: the torch form serves
                logger.warning("the native CPU paged-attention kernel could not be built (%s); using the torch "
                               "form", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                _module = None
        return None if _module is None else _module.paged_attention

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

// One (sequence, query head): scores, softmax and the weighted value sum. The cache is
// [pages, page_size, kv_heads, dim]: ``kbase``/``vbase`` point at this kv head's first row, and
// consecutive tokens of a page are ``row`` floats apart. DIM is the head size when it is one of the
// common ones (known at compile time, the dot products and row updates unroll into a few vector
// operations and the value accumulators stay in registers); 0 for any other size.
template <int DIM>
static void attend_one(const float* q, const float* kbase, const float* vbase, const int32_t* pages,
                       int64_t page_size, int64_t row, int64_t len, int64_t nq, int64_t q_stride, int64_t dim_rt,
                       float scale, float* out, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t dim = DIM ? DIM : dim_rt;
  const int64_t first = len - nq;
  const int64_t page_stride = page_size * row;
  scores.resize(nq * len);
  acc.assign(nq * dim, 0.f);
  // Pass 1: scores, one page of keys at a time (it stays in cache across the queries that see it).
  for (int64_t start = 0; start < len; start += page_size) {
    const int64_t n = std::min(page_size, len - start);
    const float* kb = kbase + static_cast<int64_t>(pages[start / page_size]) * page_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t visible = std::min(n, first + i + 1 - start);
      float qi[DIM ? DIM : 1];
      const float* qsrc = q + i * q_stride;
      if (DIM) for (int64_t d = 0; d < DIM; ++d) qi[d] = qsrc[d];
      float* si = scores.data() + i * len + start;
      for (int64_t t = 0; t < visible; ++t) {
        const float* k = kb + t * row;
        float s = 0.f;
        if (DIM) { for (int64_t d = 0; d < DIM; ++d) s += qi[d] * k[d]; }
        else { for (int64_t d = 0; d < dim; ++d) s += qsrc[d] * k[d]; }
        si[t] = s * scale;
      }
    }
  }
  // Pass 2: softmax per query over the keys it sees.
  for (int64_t i = 0; i < nq; ++i) {
    float* si = scores.data() + i * len;
    const int64_t visible = first + i + 1;
    float m = si[0];
    for (int64_t j = 1; j < visible; ++j) m = si[j] > m ? si[j] : m;
    float sum = 0.f;
    for (int64_t j = 0; j < visible; ++j) { si[j] = std::exp(si[j] - m); sum += si[j]; }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < visible; ++j) si[j] *= inv;
  }
  // Pass 3: weighted sum of the values into accumulators that live in registers (two, so
  // consecutive multiply-adds do not wait on each other).
  for (int64_t i = 0; i < nq; ++i) {
    const float* si = scores.data() + i * len;
    const int64_t visible_all = first + i + 1;
    if (DIM) {
      float a0[DIM ? DIM : 1] = {}, a1[DIM ? DIM : 1] = {};
      for (int64_t start = 0; start < visible_all; start += page_size) {
        const int64_t n = std::min(page_size, visible_all - start);
        const float* vb = vbase + static_cast<int64_t>(pages[start / page_size]) * page_stride;
        int64_t t = 0;
        for (; t + 1 < n; t += 2) {
          const float p0 = si[start + t], p1 = si[start + t + 1];
          const float* v0 = vb + t * row; const float* v1 = v0 + row;
          for (int64_t d = 0; d < DIM; ++d) { a0[d] += p0 * v0[d]; a1[d] += p1 * v1[d]; }
        }
        if (t < n) {
          const float p0 = si[start + t];
          const float* v0 = vb + t * row;
          for (int64_t d = 0; d < DIM; ++d) a0[d] += p0 * v0[d];
        }
      }
      for (int64_t d = 0; d < DIM; ++d) out[i * q_stride + d] = a0[d] + a1[d];
    } else {
      float* a = acc.data() + i * dim;
      for (int64_t start = 0; start < visible_all; start += page_size) {
        const int64_t n = std::min(page_size, visible_all - start);
        const float* vb = vbase + static_cast<int64_t>(pages[start / page_size]) * page_stride;
        for (int64_t t = 0; t < n; ++t)
          for (int64_t d = 0; d < dim; ++d) a[d] += si[start + t] * vb[t * row + d];
      }
      for (int64_t d = 0; d < dim; ++d) out[i * q_stride + d] = a[d];
    }
  }
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
  const int64_t group = heads / kv_heads, batch = seq_lens.size(0), row = kv_heads * dim;
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / heads, h = work % heads, kvh = h / group;
      const int64_t nq = qo[b + 1] - qo[b];
      const float* qb = q + (static_cast<int64_t>(qo[b]) * heads + h) * dim;
      float* ob = o + (static_cast<int64_t>(qo[b]) * heads + h) * dim;
      const float* kb = kc + kvh * dim;
      const float* vb = vc + kvh * dim;
      const int32_t* pages = idx + kvp[b];
      switch (dim) {
#define CASE(D) case D: attend_one<D>(qb, kb, vb, pages, page_size, row, lens[b], nq, heads * dim, dim, fscale, ob, scores, acc); break;
        CASE(32) CASE(48) CASE(64) CASE(80) CASE(96) CASE(128)
#undef CASE
        default: attend_one<0>(qb, kb, vb, pages, page_size, row, lens[b], nq, heads * dim, dim, fscale, ob, scores, acc);
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

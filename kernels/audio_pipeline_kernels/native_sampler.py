"""The sampling rule on CPU as one small C++ call per step, built on first use.

``audio_pipeline.core.sampler.sample_rows`` spells the rule (repetition penalties, the layout's
blocked candidates, temperature, top-k, min-p, top-p, one draw per row) as some eighty torch
operations; on a CPU each costs a few microseconds whatever its size, so for the handful of rows
of a CPU step the rule cost more than the model's matrix products (the built-in voice samples
twice a pass: the frame's first code and the depth head's). This kernel runs the same rule row by
row, in the same float32 arithmetic and order where the torch form fixes one (cumulative sums
accumulate in double, as torch's CPU cumsum does), so it picks what the torch form picks except
where a draw lands within float rounding of a boundary between two candidates (the sum over a
whole row and ``exp`` may differ from torch's vectorized ones in the last bit). Ties rank by
column, lower first. Each row's result depends on its own inputs only.

Built with torch's C++ extension builder like the paged-attention kernel (native_paged_attention.py),
without fast-math (the rule relies on infinities) and without contracting multiply-adds (the torch
form rounds each product). Where it cannot be built, ``native_sampler()`` returns None and the
torch form serves.
"""

from __future__ import annotations

from audio_pipeline_kernels.native_build import EXP_SOURCE, LazyKernel, _target_flags, build_extension

_SOURCE = EXP_SOURCE + r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();

// NaN -> -inf (never chosen), +inf -> the largest float (the torch form's _finite_or_excluded).
inline float finite_or_excluded(float x) {
  if (std::isnan(x)) return -kInf;
  if (x == kInf) return kMax;
  return x;
}

// exp(x) for x <= 0 (EXP_SOURCE's exp_in_range); 0 below -87, where a whole row's sum (at least 1:
// its best term) cannot notice the term.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  return x < -87.0f ? 0.0f : exp_in_range(clamped);
}

// The sum over a whole row of exp(x - best) (the whole-row rule's denominator): the terms into
// `scratch` in one vectorized loop, then summed in sixteen lanes.
inline float exp_sum(const float* x, int64_t width, float best, float* scratch) {
  for (int64_t j = 0; j < width; ++j) scratch[j] = exp_nonpositive(x[j] - best);
  float lanes[16] = {0.0f};
  int64_t j = 0;
  for (; j + 16 <= width; j += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += scratch[j + l];
  }
  float total = 0.0f;
  for (; j < width; ++j) total += scratch[j];
  for (int l = 0; l < 16; ++l) total += lanes[l];
  return total;
}

// The rule's nucleus over the n best of `scaled` (ranked into `order`): the pick's column, or -1
// when `check` finds the kept mass may reach past those n (the caller ranks the whole row).
int64_t nucleus(const std::vector<float>& scaled, std::vector<float>& values, std::vector<int64_t>& columns,
                std::vector<int64_t>& order, int64_t n,
                int64_t width,
                int64_t top_k, float min_p, float top_p, float uniform, bool check,
                std::vector<float>& probs, std::vector<float>& cumulative, float* row_sum) {
  auto better = [&](int64_t a, int64_t b) {
    return scaled[a] > scaled[b] || (scaled[a] == scaled[b] && a < b);
  };
  if (n < width) {
    // The n best: first the columns within a margin of the best (widened until they number at
    // least n; a count is one vectorized pass, so starting narrow and doubling costs less than
    // selecting among hundreds), then the n-th best value among those, then the columns above it
    // and, in column order, those equal to it: what a full ranking puts first.
    float top = scaled[0];
    for (int64_t j = 1; j < width; ++j) top = std::max(top, scaled[j]);
    const float* x = scaled.data();
    float margin = 1.0f, low = -kInf;
    for (;; margin *= 2.0f) {
      low = margin > 1e30f ? -kInf : top - margin;
      int32_t count = 0;
      for (int64_t j = 0; j < width; ++j) count += x[j] >= low ? 1 : 0;
      if (count >= n) break;
    }
    int64_t candidates = 0;
    for (int64_t j = 0; j < width; ++j) {
      if (scaled[j] >= low) {
        values[candidates] = scaled[j];
        columns[candidates++] = j;
      }
    }
    std::nth_element(values.begin(), values.begin() + (n - 1), values.begin() + candidates, std::greater<float>());
    const float threshold = values[n - 1];
    int64_t above = 0;
    for (int64_t i = 0; i < candidates; ++i) above += values[i] > threshold;
    int64_t taken = 0, ties = n - above;
    for (int64_t i = 0; i < candidates && taken < n; ++i) {
      const int64_t j = columns[i];
      if (scaled[j] > threshold || (scaled[j] == threshold && ties-- > 0)) order[taken++] = j;
    }
    std::sort(order.begin(), order.begin() + n, better);
  } else {
    for (int64_t j = 0; j < width; ++j) order[j] = j;
    std::sort(order.begin(), order.begin() + width, better);
  }
  const float best = scaled[order[0]];
  if (best == -kInf) return order[0];  // every candidate blocked: nothing to draw from
  const bool whole_row = top_k == width;
  float kept = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    probs[i] = i < top_k ? std::exp(scaled[order[i]] - best) : 0.0f;
    kept += probs[i];
  }
  float denominator = kept;
  if (whole_row) {  // the same for every prefix tried: summed once a row
    if (!(*row_sum >= 0.0f)) *row_sum = exp_sum(scaled.data(), width, best, values.data());
    denominator = *row_sum;
  }
  for (int64_t i = 0; i < n; ++i) probs[i] = probs[i] / denominator;
  const float floor = min_p * probs[0];
  for (int64_t i = 0; i < n; ++i) {
    if (probs[i] < floor) probs[i] = 0.0f;
  }
  // before[i] = cumsum[i] - probs[i], the cumulative sum accumulated in double as torch's CPU cumsum.
  double running = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    running += probs[i];
    cumulative[i] = static_cast<float>(running);
  }
  if (check && n < width) {
    const float last_before = cumulative[n - 1] - probs[n - 1];
    if (!(last_before + probs[n - 1] > top_p) && whole_row) return -1;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (cumulative[i] - probs[i] > top_p) probs[i] = 0.0f;
  }
  if (!(probs[0] > 0.0f)) probs[0] = 1.0f;
  running = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    running += probs[i];
    cumulative[i] = static_cast<float>(running);
  }
  const float target = uniform * cumulative[n - 1];
  int64_t pick = std::lower_bound(cumulative.begin(), cumulative.begin() + n, target) - cumulative.begin();
  if (pick > n - 1) pick = n - 1;
  return order[pick];
}

}  // namespace

// One id per row from candidate scores [B, W] (float32; codebook columns, then E stop ids), each
// row with its settings: blocked [B, W] bool, counts [B, codebook] float32 (read when penalized),
// floats [7, B] float32 (temperature, top_p, min_p, repetition, frequency and presence penalties,
// the uniform draw), top_k [B] int64 (W where unlimited), starts [B] and extra_ids [B, E] int64.
at::Tensor sample_rows(at::Tensor scores, at::Tensor blocked, at::Tensor counts, at::Tensor floats,
                       at::Tensor top_k, at::Tensor starts, at::Tensor extra_ids, int64_t codebook,
                       bool penalized, bool any_sampling, int64_t prefix) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(), "scores");
  const int64_t rows = scores.size(0), width = scores.size(1), extra = width - codebook;
  TORCH_CHECK(blocked.scalar_type() == at::kBool && blocked.is_contiguous() && blocked.size(0) == rows &&
              blocked.size(1) == width, "blocked");
  TORCH_CHECK(floats.scalar_type() == at::kFloat && floats.is_contiguous() && floats.size(0) == 7 &&
              floats.size(1) == rows, "floats");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows, "top_k");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.numel() == rows, "starts");
  TORCH_CHECK(extra_ids.scalar_type() == at::kLong && extra_ids.is_contiguous() && extra_ids.size(0) == rows &&
              extra_ids.size(1) == extra && extra >= 0, "extra_ids");
  TORCH_CHECK(!penalized || (counts.scalar_type() == at::kFloat && counts.is_contiguous() &&
                             counts.size(0) == rows && counts.size(1) == codebook), "counts");
  auto out = at::empty({rows}, at::kLong);
  const float* score = scores.data_ptr<float>();
  const bool* block = blocked.data_ptr<bool>();
  const float* setting = floats.data_ptr<float>();
  const int64_t* k_of = top_k.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* extras = extra_ids.data_ptr<int64_t>();
  const float* count = penalized ? counts.data_ptr<float>() : nullptr;
  int64_t* ids = out.data_ptr<int64_t>();
  // Plain memory from here on: other Python threads (gRPC, the decoder) run meanwhile.
  pybind11::gil_scoped_release no_gil;
  std::vector<float> s(width), scaled(width), values(width), probs(width), cumulative(width);
  std::vector<int64_t> order(width), columns(width);
  for (int64_t b = 0; b < rows; ++b) {
    const float temperature = setting[0 * rows + b], top_p = setting[1 * rows + b], min_p = setting[2 * rows + b];
    const float repetition = setting[3 * rows + b], frequency = setting[4 * rows + b];
    const float presence = setting[5 * rows + b], uniform = setting[6 * rows + b];
    const float* row = score + b * width;
    const bool* row_blocked = block + b * width;
    for (int64_t j = 0; j < width; ++j) s[j] = row[j];
    if (penalized) {  // on the codebook's columns; stop ids are never counted
      const float* c = count + b * codebook;
      for (int64_t j = 0; j < codebook; ++j) {
        const bool seen = c[j] > 0.0f;
        float x = s[j];
        if (seen) x = x > 0.0f ? x / repetition : x * repetition;
        const float by_frequency = frequency * c[j];
        x = x - by_frequency;
        const float by_presence = presence * (seen ? 1.0f : 0.0f);
        s[j] = x - by_presence;
      }
    }
    bool any_finite = false;
    for (int64_t j = 0; j < width; ++j) {
      float x = row_blocked[j] ? -kInf : finite_or_excluded(s[j]);
      s[j] = x;
      any_finite = any_finite || x != -kInf;
    }
    if (!any_finite) {  // overflowed or NaN everywhere: its allowed candidates, uniformly
      for (int64_t j = 0; j < width; ++j) {
        if (!row_blocked[j]) s[j] = 0.0f;
      }
    }
    int64_t chosen = 0;
    for (int64_t j = 1; j < width; ++j) {
      if (s[j] > s[chosen]) chosen = j;
    }
    if (any_sampling && temperature != 0.0f) {
      const float t = std::max(temperature, 1e-6f);
      for (int64_t j = 0; j < width; ++j) scaled[j] = finite_or_excluded(s[j] / t);
      const int64_t k = k_of[b];
      int64_t picked = -1;
      float row_sum = -1.0f;  // the whole row's exp sum, once needed
      // The best `prefix` candidates, then four times as many, where the kept mass may reach past
      // them (an unlimited top_k): each tried prefix that holds it picks what the whole row would.
      for (int64_t n = prefix; picked < 0 && n < width && (k <= n || k == width); n *= 4) {
        picked = nucleus(scaled, values, columns, order, n, width, k, min_p, top_p, uniform, k > n, probs, cumulative, &row_sum);
      }
      if (picked < 0) {
        picked = nucleus(scaled, values, columns, order, width, width, k, min_p, top_p, uniform, false, probs, cumulative,
                         &row_sum);
      }
      chosen = picked;
    }
    ids[b] = chosen < codebook ? start[b] + chosen : extras[b * extra + (chosen - codebook)];
  }
  return out;
}
"""

def build_native_sampler():
    """Compiles the kernel (or finds it built, in torch's extension folder) and returns its
    ``sample_rows``; raises where it cannot be built."""
    cflags = ["-O3", "-ffp-contract=off", *_target_flags()]
    return build_extension("sampler", _SOURCE, ["sample_rows"], cflags).sample_rows


#: The best candidates a row's nucleus is first tried over (then four times as many, while its kept
#: mass may reach past them): the built-in voice's rows keep 95 % of their mass within 7 (frame
#: codes) and 33 (depth codes) candidates at its default temperature, so 16 mostly suffice and a
#: draw ranks few (one draw of 1,025 candidates 3.7 us against 8.9 with 64).
PREFIX = 16

#: The compiled kernel's ``sample_rows``, or None where it cannot be built (then the torch form serves).
native_sampler = LazyKernel(build_native_sampler, "the native CPU sampler", "sampling runs as torch operations")

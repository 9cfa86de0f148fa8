"""Row-stable matrix products on CPU: the C++ part of the native decode kernels (native_decode.py
builds them into one extension) and the weights packed for them.

A decode step on a CPU multiplies a few rows (one per stream) by small weights: the built-in voice's
are [192, 576]-sized. torch's BLAS rounds a row differently when it comes alone, in twos or threes,
and in fours or more, so a seeded stream's speech would depend on its batch; oneDNN's packed
products are row-stable but cost ~10 us a call whatever their size (a lone row's [1, 192] x
[192, 576] took 16 us against 3 us here). This kernel computes every output element as one chain
of fused multiply-adds over the inputs in order (bias added after), whatever the number of rows,
how they are grouped into the register tiles, or how many threads share the work: a row's result
is the same bits at any batch by construction, with no padding or probing.

Weights are packed once into column panels ([panels, in, P], P = 4 vector widths: 64 columns with
AVX-512, 32 with AVX2, 16 in the portable loops): a tile of up to 6 rows by one panel keeps 24
accumulators in registers and reads each weight once per 6 rows; a lone row takes two panels at
once so its chains overlap. On 2 Zen 4 cores (one thread) against oneDNN's packed product:
[1, 192] x [192, 1152] 6.4 against 22.2 us, [32, 192] x [192, 1152] 67 against 81 us, [64, ...]
136 against 144, [512, ...] 1,068 against 1,036. The chains are spelled with explicit FMA
instructions (std::fma in the portable loops), so every instruction set gives the same bits.
"""

from __future__ import annotations

import torch

#: The products' C++: packing, the tiled kernel, ``linear``; and the helpers the layer operations
#: use (``Weight``, ``product``). Needs THREADS_SOURCE and VECTOR_SOURCE before it.
PRODUCTS_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace {

// vec, W and the vector operations: VECTOR_SOURCE (native_build.py).

constexpr int V = 4;      // vectors per panel row
constexpr int P = V * W;  // columns per panel

// R rows times S panels: acc = fma(x[r, k], w[k, c], acc) for k = 0 .. K-1, then + bias. Each
// element's chain is the same whatever R and S are, which is what makes rows independent.
template <int R, int S>
inline void tile(const float* x, int64_t ldx, const float* const* panels, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t cols) {
  vec acc[R][S * V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < S * V; ++j) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    vec w[S * V];
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < V; ++j) w[s * V + j] = vload(panels[s] + k * P + j * W);
    for (int r = 0; r < R; ++r) {
      const vec a = vset1(x[r * ldx + k]);
      for (int j = 0; j < S * V; ++j) acc[r][j] = vfma(a, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[S * P];
    for (int j = 0; j < S * V; ++j) vstore(row + j * W, bias != nullptr ? vadd(acc[r][j], vload(bias + j * W)) : acc[r][j]);
    std::memcpy(y + r * ldy, row, sizeof(float) * cols);  // the last panel's padding columns stay behind
  }
}

// R rows across panels [p0, p1).
template <int R>
inline void rows_by_panels(const float* x, int64_t ldx, const float* packed, int64_t K, const float* bias, float* y,
                           int64_t n, int64_t p0, int64_t p1) {
  int64_t p = p0;
  if (R == 1) {  // a lone row: two panels at once, eight independent chains to hide the FMA latency
    for (; p + 1 < p1; p += 2) {
      const float* panels[2] = {packed + p * K * P, packed + (p + 1) * K * P};
      tile<1, 2>(x, ldx, panels, K, bias ? bias + p * P : nullptr, y + p * P, n, std::min<int64_t>(2 * P, n - p * P));
    }
  }
  for (; p < p1; ++p) {
    const float* panels[1] = {packed + p * K * P};
    tile<R, 1>(x, ldx, panels, K, bias ? bias + p * P : nullptr, y + p * P, n, std::min<int64_t>(P, n - p * P));
  }
}

// Panels [p0, p1) of every row, in groups of panels that fit the core's L2 beside the rows.
void compute(const float* x, int64_t ldx, int64_t M, int64_t K, const float* packed, int64_t n, const float* bias,
             float* y, int64_t p0, int64_t p1) {
  const int64_t group = std::max<int64_t>(1, (256 << 10) / (K * P * int64_t(sizeof(float))));
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    int64_t r = 0;
    for (; r + 6 <= M; r += 6) rows_by_panels<6>(x + r * ldx, ldx, packed, K, bias, y + r * n, n, g0, g1);
    const float* xr = x + r * ldx;
    float* yr = y + r * n;
    switch (M - r) {
      case 5: rows_by_panels<5>(xr, ldx, packed, K, bias, yr, n, g0, g1); break;
      case 4: rows_by_panels<4>(xr, ldx, packed, K, bias, yr, n, g0, g1); break;
      case 3: rows_by_panels<3>(xr, ldx, packed, K, bias, yr, n, g0, g1); break;
      case 2: rows_by_panels<2>(xr, ldx, packed, K, bias, yr, n, g0, g1); break;
      case 1: rows_by_panels<1>(xr, ldx, packed, K, bias, yr, n, g0, g1); break;
      default: break;
    }
  }
}

// y = x @ W.T (+ bias), on more threads where the product is large enough (threads_for): a
// prompt step's rows split in blocks of six (the tile's height), a few rows' columns by panels.
void product(const float* x, int64_t ldx, int64_t M, int64_t K, const float* packed, int64_t panels, int64_t n,
             const float* bias, float* y) {
  if (M == 0) return;
  const int64_t threads = threads_for(M * K * panels * P);
  if (threads > 1 && M >= 12 * threads) {
    in_threads((M + 5) / 6, threads, [&](int64_t b0, int64_t b1) {
      const int64_t r0 = b0 * 6, r1 = std::min(M, b1 * 6);
      compute(x + r0 * ldx, ldx, r1 - r0, K, packed, n, bias, y + r0 * n, 0, panels);
    });
  } else {
    in_threads(panels, threads, [&](int64_t p0, int64_t p1) { compute(x, ldx, M, K, packed, n, bias, y, p0, p1); });
  }
}

// A packed weight as the Python side holds it (NativeWeight): panels, columns, padded bias or none.
struct Weight {
  const float* panels;
  int64_t K, count, n;
  const float* bias;
};

Weight weight_of(const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == P && panels.is_contiguous() &&
              panels.scalar_type() == at::kFloat, "a weight packed by pack()");
  TORCH_CHECK(n > 0 && n <= panels.size(0) * P, "columns out of the packed weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == panels.size(0) * P && bias->scalar_type() == at::kFloat,
                "a float32 bias padded to the panels");
    b = bias->data_ptr<float>();
  }
  return {panels.data_ptr<float>(), panels.size(1), panels.size(0), n, b};
}

void product(const float* x, int64_t M, const Weight& w, float* y) {
  product(x, w.K, M, w.K, w.panels, w.count, w.n, w.bias, y);
}

}  // namespace

int64_t panel_width() { return P; }

// [n, K] -> [panels, K, P], the last panel's missing columns zero.
at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "a 2-D float32 weight");
  const int64_t n = weight.size(0), K = weight.size(1), panels = (n + P - 1) / P;
  auto padded = at::zeros({panels * P, K}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, P, K}).transpose(1, 2).contiguous();
}

// x [M, K] (rows may be strided) times the packed weight's n columns (+ its bias).
at::Tensor linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "2-D float32 inputs");
  const Weight w = weight_of(panels, n, bias);
  TORCH_CHECK(x.size(1) == w.K, "inputs of ", w.K, " features, got ", x.size(1));
  if (x.stride(1) != 1 || x.stride(0) < x.size(1)) x = x.contiguous();
  auto y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t M = x.size(0), ldx = x.stride(0);
  pybind11::gil_scoped_release no_gil;  // plain memory from here on: other Python threads run meanwhile
  product(xp, ldx, M, w.K, w.panels, w.count, w.n, w.bias, yp);
  return y;
}

"""


class NativeWeight:
    """A float32 weight ([out, in]) and bias packed for the kernel ``module`` (``native_decode()``):
    ``self(x)`` is ``x @ weight.T + bias``, each row's bits the same at any number of rows."""

    __slots__ = ("module", "panels", "bias", "out_features")

    #: Every row count takes the same chains, a lone row included (models/cpu_linear.py asks).
    lone_exact = True

    def __init__(self, module, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.module = module
        self.out_features = weight.shape[0]
        self.panels = module.pack(weight)
        self.bias = None
        if bias is not None:
            width = self.panels.shape[0] * self.panels.shape[2]
            self.bias = torch.zeros(width, dtype=torch.float32)
            self.bias[:self.out_features] = bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.linear(x, self.panels, self.out_features, self.bias)

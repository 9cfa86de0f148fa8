"""A CPU decode step's dense work as one small C++ extension, built on first use: row-stable matrix
products over packed weights (native_products.py) and the decoder layer's per-row operations
(model.packed_linears).

A small model's decode step is otherwise dozens of torch operations a layer at a few microseconds
each. Beside the products, the layer's per-row operations (RMSNorm, RoPE, SiLU times the up
projection, the residual sums) run here, alone and fused into two calls a decoder layer
(``layer_pre``: norm, q/k/v, rotation and the cache writes; ``layer_post``: output projection,
residual, norm, MLP, residual), one a SwiGLU block (``mlp_block``), one a frame model's
embeddings (``frame_embed``) and one its depth head (``depth_head``): models/native_layers.py.
Each row's arithmetic depends on that row alone and runs in one fixed order, so the fused calls
and the piecewise ones give a row the same bits.

Built with torch's C++ extension builder like the attention kernel (native_paged_attention.py),
for this CPU (-march=native), without contracting or reassociating (-ffp-contract=off, no
fast-math). Where it cannot be built, ``native_decode()`` is None, oneDNN's packed products serve
(models/cpu_linear.py) and the layers run as torch operations.
"""

from __future__ import annotations

from audio_pipeline_kernels.native_build import (EXP_SOURCE, THREADS_SOURCE, VECTOR_SOURCE, LazyKernel, _target_flags,
                                                  build_extension)
from audio_pipeline_kernels.native_products import PRODUCTS_SOURCE, NativeWeight

#: The layers' C++ (after the products', whose helpers it uses).
LAYERS_SOURCE = r"""
namespace {

// The layers' per-row operations. Each row's arithmetic depends on that row alone and runs in one
// fixed order (no contraction, no reassociation: -ffp-contract=off, no fast-math), so the fused
// layer below and the piecewise calls of a step with prompt positions give a row the same bits.

// Rows [begin, end) of a per-row operation fn(begin, end), on more threads where there are enough
// rows (a prompt step's thousands; rows are independent, so the split changes no bit).
template <typename F>
void over_rows(int64_t M, int64_t row_cost, const F& fn) {
  in_threads(M, threads_for(M * row_cost), fn);
}

// y = weight * (x * (1 / sqrt(mean(x^2) + eps))); the squares summed in 16 lanes (one vector
// register's worth, so the loop vectorizes), the lanes then in order: the same order for every row.
void norm_rows(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* y) {
  over_rows(M, 4 * H, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * H;
      float lanes[16] = {0.0f};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16) {
        for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + xr[i + l] * xr[i + l];
      }
      for (; i < H; ++i) lanes[i % 16] = lanes[i % 16] + xr[i] * xr[i];
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum = sum + lanes[l];
      const float inv = 1.0f / std::sqrt(sum / float(H) + eps);
      float* yr = y + r * H;
      for (int64_t j = 0; j < H; ++j) yr[j] = weight[j] * (xr[j] * inv);
    }
  });
}

// RoPE in place on the first `rotated` heads of each row (the queries', then the keys'), in the
// torch form's order: x * cos + rotate_half(x) * sin, each product and the sum rounded.
void rotate_rows(float* qkv, int64_t M, int64_t row, int64_t rotated, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  over_rows(M, 3 * rotated * D, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * D;
      const float* s = sin + r * D;
      for (int64_t h = 0; h < rotated; ++h) {
        float* v = qkv + r * row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          const float first = a * c[i], first_turn = -b * s[i];
          const float second = b * c[i + half], second_turn = a * s[i + half];
          v[i] = first + first_turn;
          v[i + half] = second + second_turn;
        }
      }
    }
  });
}

// exp(x) (EXP_SOURCE's exp_in_range): 0 below -87.3 and infinity above 88.7, as expf, and exp(88)
// between 88 and 88.7 (for SiLU, where exp(-g) only needs to be huge there, that changes nothing:
// g / (1 + exp(-g)) is -0 either way).
inline float exp_any(float x) {
  const float value = exp_in_range(std::min(std::max(x, -87.0f), 88.0f));
  return x < -87.3f ? 0.0f : (x > 88.7f ? std::numeric_limits<float>::infinity() : value);
}

// act = silu(gate) * up, gate and up side by side in each row of gu ([M, 2I]).
void silu_mul_rows(const float* gu, int64_t M, int64_t I, float* act) {
  over_rows(M, 8 * I, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * 2 * I;
      const float* u = g + I;
      float* a = act + r * I;
      for (int64_t i = 0; i < I; ++i) a[i] = (g[i] / (1.0f + exp_any(-g[i]))) * u[i];
    }
  });
}

void add_rows(float* x, const float* d, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = x[i] + d[i];
}

// x += down(silu_mul(gate_up(norm(x)))) in place, x [M, H].
void residual_mlp(float* x, int64_t M, int64_t H, const float* norm_weight, float eps, const Weight& gate_up,
                  const Weight& down) {
  const int64_t I = gate_up.n / 2;
  std::vector<float> h(M * H), gu(M * gate_up.n), act(M * I), d(M * H);
  norm_rows(x, M, H, norm_weight, eps, h.data());
  product(h.data(), M, gate_up, gu.data());
  silu_mul_rows(gu.data(), M, I, act.data());
  product(act.data(), M, down, d.data());
  add_rows(x, d.data(), M * H);
}

// Rows [M] of keys and values (at columns k0 and v0 of each `row`-wide qkv row) stored at the cache
// slots (a cache seen as [slots, kv_heads * D]), converted as torch's .to() converts (round to
// nearest even), so the cache holds what write_paged_kv would have put there.
template <typename T>
void store_rows(const float* qkv, int64_t M, int64_t row, int64_t k0, int64_t v0, int64_t width, const int64_t* slots,
                T* keys, T* values) {
  for (int64_t r = 0; r < M; ++r) {
    const float* k = qkv + r * row + k0;
    const float* v = qkv + r * row + v0;
    T* kd = keys + slots[r] * width;
    T* vd = values + slots[r] * width;
    for (int64_t i = 0; i < width; ++i) {
      kd[i] = static_cast<T>(k[i]);
      vd[i] = static_cast<T>(v[i]);
    }
  }
}

at::Tensor contiguous_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": float32 only");
  return t.contiguous();
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  x = contiguous_float(x, "rms_norm");
  weight = contiguous_float(weight, "rms_norm weight");
  const int64_t H = x.size(-1), M = x.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(weight.numel() == H, "rms_norm: a weight of ", H);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;  // a prompt step's rows take milliseconds: other threads run
  norm_rows(xp, M, H, wp, float(eps), yp);
  return y;
}

// RoPE in place on qkv's first `rotated` heads of `head_dim` (qkv [M, row], contiguous; cos, sin [M, head_dim]).
void rotate_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t rotated, int64_t head_dim) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && qkv.dim() == 2, "rotate_: contiguous 2-D float32");
  cos = contiguous_float(cos, "rotate_ cos");
  sin = contiguous_float(sin, "rotate_ sin");
  TORCH_CHECK(rotated * head_dim <= qkv.size(1) && cos.numel() == qkv.size(0) * head_dim && sin.numel() == cos.numel(),
              "rotate_: shapes");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t M = qkv.size(0), row = qkv.size(1);
  pybind11::gil_scoped_release no_gil;
  rotate_rows(qp, M, row, rotated, head_dim, cp, sp);
}

at::Tensor silu_mul(at::Tensor gate_up) {
  gate_up = contiguous_float(gate_up, "silu_mul");
  const int64_t I = gate_up.size(-1) / 2, M = gate_up.numel() / std::max<int64_t>(2 * I, 1);
  auto act = at::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  silu_mul_rows(gp, M, I, ap);
  return act;
}

// (x + d, rms_norm(x + d)): the residual sum and the next block's input.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor d, at::Tensor weight, double eps) {
  auto sum = at::add(contiguous_float(x, "add_rms_norm"), contiguous_float(d, "add_rms_norm"));
  return {sum, rms_norm(sum, weight, eps)};
}

// A decoder layer up to the attention: rotate(qkv(norm(x))) -> [M, q + k + v columns], the queries
// and keys rotated (the attention's heads and the keys' heads, `rotated` of them). With caches and
// slots, the step's keys and values (the `kv_width` columns after the queries', then the next) are
// also stored in the caches ([blocks, page, kv_heads, D]: float32, float16 or bfloat16) at their slots.
at::Tensor layer_pre(at::Tensor x, at::Tensor norm_weight, double eps, at::Tensor qkv_panels, int64_t qkv_n,
                     c10::optional<at::Tensor> qkv_bias, at::Tensor cos, at::Tensor sin, int64_t rotated,
                     int64_t head_dim, c10::optional<at::Tensor> key_cache,
                     c10::optional<at::Tensor> value_cache, c10::optional<at::Tensor> slots,
                     int64_t kv_width) {
  x = contiguous_float(x, "layer_pre");
  norm_weight = contiguous_float(norm_weight, "layer_pre norm");
  cos = contiguous_float(cos, "layer_pre cos");
  sin = contiguous_float(sin, "layer_pre sin");
  const Weight qkv = weight_of(qkv_panels, qkv_n, qkv_bias);
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(qkv.K == H && norm_weight.numel() == H && rotated * head_dim <= qkv_n && cos.numel() == M * head_dim &&
              sin.numel() == cos.numel(), "layer_pre: shapes");
  const bool store = key_cache.has_value();
  at::Tensor slot_rows;
  if (store) {
    TORCH_CHECK(value_cache.has_value() && slots.has_value(), "layer_pre: both caches and the slots");
    TORCH_CHECK(key_cache->is_contiguous() && value_cache->is_contiguous() &&
                key_cache->scalar_type() == value_cache->scalar_type() && key_cache->sizes() == value_cache->sizes() &&
                key_cache->dim() == 4 && key_cache->size(2) * key_cache->size(3) == kv_width, "layer_pre: caches");
    TORCH_CHECK(qkv_n >= 2 * kv_width, "layer_pre: key/value columns");
    slot_rows = slots->to(at::kLong).contiguous();
    TORCH_CHECK(slot_rows.numel() == M, "layer_pre: a slot per row");
    const int64_t limit = key_cache->size(0) * key_cache->size(1);
    const int64_t* sp = slot_rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < limit, "layer_pre: slot out of the cache");
  }
  auto out = at::empty({M, qkv_n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = norm_weight.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  {
    pybind11::gil_scoped_release no_gil;
    std::vector<float> h(M * H);
    norm_rows(xp, M, H, wp, float(eps), h.data());
    product(h.data(), M, qkv, op);
    rotate_rows(op, M, qkv_n, rotated, head_dim, cp, snp);
  }
  if (store) {
    const int64_t k0 = qkv_n - 2 * kv_width, v0 = qkv_n - kv_width;
    const int64_t* sp = slot_rows.data_ptr<int64_t>();
    switch (key_cache->scalar_type()) {
      case at::kFloat:
        store_rows(op, M, qkv_n, k0, v0, kv_width, sp, key_cache->data_ptr<float>(), value_cache->data_ptr<float>());
        break;
      case at::kHalf:
        store_rows(op, M, qkv_n, k0, v0, kv_width, sp, key_cache->data_ptr<c10::Half>(),
                   value_cache->data_ptr<c10::Half>());
        break;
      case at::kBFloat16:
        store_rows(op, M, qkv_n, k0, v0, kv_width, sp, key_cache->data_ptr<c10::BFloat16>(),
                   value_cache->data_ptr<c10::BFloat16>());
        break;
      default:
        TORCH_CHECK(false, "layer_pre: float32, float16 or bfloat16 caches only");
    }
  }
  return out;
}

// A frame model's depth head (models/frame_head.py) in one call: x = hidden + weight[token_offset +
// code] (a code may be negative: a stop id below the codebook); through each SwiGLU block (norm, gate/up, SiLU, down, residual); norm; readout ->
// [M, readout_n] logits.
at::Tensor depth_head(at::Tensor hidden, at::Tensor codes, at::Tensor weight, int64_t token_offset,
                      std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> gate_ups,
                      int64_t gate_up_n, std::vector<at::Tensor> downs, int64_t down_n, at::Tensor final_norm,
                      at::Tensor readout_panels, int64_t readout_n) {
  hidden = contiguous_float(hidden, "depth_head");
  weight = contiguous_float(weight, "depth_head embedding");
  final_norm = contiguous_float(final_norm, "depth_head norm");
  codes = codes.to(at::kLong).contiguous();
  const int64_t M = hidden.size(0), H = hidden.size(1), V = weight.size(0), blocks = int64_t(norms.size());
  TORCH_CHECK(weight.size(1) == H && codes.numel() == M && final_norm.numel() == H && int64_t(gate_ups.size()) == blocks &&
              int64_t(downs.size()) == blocks, "depth_head: shapes");
  std::vector<Weight> gu, dn;
  for (int64_t b = 0; b < blocks; ++b) {
    norms[b] = contiguous_float(norms[b], "depth_head block norm");
    TORCH_CHECK(norms[b].numel() == H, "depth_head: block norms of ", H);
    gu.push_back(weight_of(gate_ups[b], gate_up_n, c10::nullopt));
    dn.push_back(weight_of(downs[b], down_n, c10::nullopt));
    TORCH_CHECK(gu.back().K == H && dn.back().K * 2 == gate_up_n && down_n == H, "depth_head: block shapes");
  }
  const Weight readout = weight_of(readout_panels, readout_n, c10::nullopt);
  TORCH_CHECK(readout.K == H, "depth_head: readout of ", H, " inputs");
  const int64_t* cp = codes.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(token_offset + cp[r] >= 0 && token_offset + cp[r] < V, "depth_head: id ", token_offset + cp[r],
                " out of the vocabulary");
  auto out = at::empty({M, readout_n}, hidden.options());
  const float* hp = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* fn = final_norm.data_ptr<float>();
  std::vector<const float*> np;
  for (auto& t : norms) np.push_back(t.data_ptr<float>());
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  std::vector<float> x(M * H), h(M * H);
  for (int64_t r = 0; r < M; ++r) {
    const float* e = w + (token_offset + cp[r]) * H;
    for (int64_t i = 0; i < H; ++i) x[r * H + i] = hp[r * H + i] + e[i];
  }
  for (int64_t b = 0; b < blocks; ++b) residual_mlp(x.data(), M, H, np[b], float(eps), gu[b], dn[b]);
  norm_rows(x.data(), M, H, fn, float(eps), h.data());
  product(h.data(), M, readout, op);
  return out;
}

// Input embeddings of a frame model's positions (models/frame_head.py): each id's row of `weight`
// ([V, H]; an id at or past fold_base, when that is >= 0, the sum of the rows fold_first + i and
// fold_second + j of its pair i, j = divmod(id - fold_base, fold_size)), plus, with frames ([M, C]),
// the rows of every column's code but the token column's (-1: none), added in column order.
at::Tensor frame_embed(at::Tensor ids, c10::optional<at::Tensor> frames, at::Tensor weight,
                       int64_t fold_base, int64_t fold_first, int64_t fold_second, int64_t fold_size,
                       std::vector<int64_t> offsets, int64_t token_column) {
  ids = ids.to(at::kLong).contiguous();
  weight = contiguous_float(weight, "frame_embed weight");
  const int64_t M = ids.numel(), V = weight.size(0), H = weight.size(1), C = int64_t(offsets.size());
  at::Tensor codes;
  if (frames.has_value()) {
    codes = frames->to(at::kLong).contiguous();
    TORCH_CHECK(codes.dim() == 2 && codes.size(0) == M && codes.size(1) == C, "frame_embed: frames of ", C, " columns");
  }
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* cp = frames.has_value() ? codes.data_ptr<int64_t>() : nullptr;
  const float* w = weight.data_ptr<float>();
  auto out = at::empty({M, H}, weight.options());
  float* op = out.data_ptr<float>();
  std::vector<float> sum(H);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t id = ip[r];
    float* o = op + r * H;
    if (fold_base >= 0 && id >= fold_base) {
      const int64_t pair = id - fold_base, a = fold_first + pair / fold_size, b = fold_second + pair % fold_size;
      TORCH_CHECK(a < V && b < V, "frame_embed: folded id ", id, " out of the vocabulary");
      for (int64_t i = 0; i < H; ++i) o[i] = w[a * H + i] + w[b * H + i];
    } else {
      TORCH_CHECK(id >= 0 && id < V, "frame_embed: id ", id, " out of the vocabulary (", V, ")");
      std::memcpy(o, w + id * H, sizeof(float) * H);
    }
    if (cp == nullptr) continue;
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t code = cp[r * C + c];
      if (c == token_column || code < 0) continue;
      const int64_t row = offsets[c] + code;
      TORCH_CHECK(row < V, "frame_embed: code ", code, " of column ", c, " out of the vocabulary");
      for (int64_t i = 0; i < H; ++i) sum[i] = sum[i] + w[row * H + i];
    }
    for (int64_t i = 0; i < H; ++i) o[i] = o[i] + sum[i];
  }
  return out;
}

// A decoder layer after the attention: x + o(attn), then + down(silu_mul(gate_up(norm(...)))).
at::Tensor layer_post(at::Tensor x, at::Tensor attn, at::Tensor o_panels, int64_t o_n,
                      c10::optional<at::Tensor> o_bias, at::Tensor norm_weight, double eps,
                      at::Tensor gate_up_panels, int64_t gate_up_n, c10::optional<at::Tensor> gate_up_bias,
                      at::Tensor down_panels, int64_t down_n, c10::optional<at::Tensor> down_bias) {
  x = contiguous_float(x, "layer_post");
  attn = contiguous_float(attn, "layer_post attention");
  norm_weight = contiguous_float(norm_weight, "layer_post norm");
  const Weight o = weight_of(o_panels, o_n, o_bias), gate_up = weight_of(gate_up_panels, gate_up_n, gate_up_bias),
               down = weight_of(down_panels, down_n, down_bias);
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(attn.size(0) == M && attn.size(1) == o.K && o_n == H && gate_up.K == H && down.K * 2 == gate_up_n &&
              down_n == H && norm_weight.numel() == H, "layer_post: shapes");
  auto out = at::empty({M, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* ap = attn.data_ptr<float>();
  const float* wp = norm_weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  product(ap, M, o, op);
  add_rows(op, xp, M * H);
  residual_mlp(op, M, H, wp, float(eps), gate_up, down);
  return out;
}

// x + down(silu_mul(gate_up(norm(x)))): a SwiGLU block with its residual (the depth head's).
at::Tensor mlp_block(at::Tensor x, at::Tensor norm_weight, double eps, at::Tensor gate_up_panels,
                     int64_t gate_up_n, c10::optional<at::Tensor> gate_up_bias, at::Tensor down_panels,
                     int64_t down_n, c10::optional<at::Tensor> down_bias) {
  norm_weight = contiguous_float(norm_weight, "mlp_block norm");
  const Weight gate_up = weight_of(gate_up_panels, gate_up_n, gate_up_bias), down = weight_of(down_panels, down_n, down_bias);
  auto out = contiguous_float(x, "mlp_block").clone();
  const int64_t H = out.size(-1), M = out.numel() / std::max<int64_t>(H, 1);
  TORCH_CHECK(gate_up.K == H && down.K * 2 == gate_up_n && down_n == H && norm_weight.numel() == H, "mlp_block: shapes");
  float* op = out.data_ptr<float>();
  const float* wp = norm_weight.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  residual_mlp(op, M, H, wp, float(eps), gate_up, down);
  return out;
}
"""

_SOURCE = THREADS_SOURCE + VECTOR_SOURCE + EXP_SOURCE + PRODUCTS_SOURCE + LAYERS_SOURCE


def build_native_decode(target_flags: list[str] | None = None):
    """Compiles the extension (or finds it built, in torch's extension folder) and returns its
    module (the products' ``pack``, ``linear``, ``panel_width``; the layers' calls); raises where
    it cannot be built. ``target_flags`` choose the instruction set, this machine's by default (the
    tests build the portable loops)."""
    cflags = ["-O3", "-ffp-contract=off", *(_target_flags() if target_flags is None else target_flags)]
    functions = ["pack", "linear", "panel_width", "rms_norm", "rotate_", "silu_mul", "add_rms_norm", "layer_pre",
                 "layer_post", "mlp_block", "frame_embed", "depth_head"]
    return build_extension("decode", _SOURCE, functions, cflags)


#: The compiled kernel's module, or None where it cannot be built (then oneDNN's packed products serve).
native_decode = LazyKernel(build_native_decode, "the native CPU decode kernels",
                           "the decode steps run as torch operations on oneDNN's packed products")


__all__ = ["NativeWeight", "build_native_decode", "native_decode"]

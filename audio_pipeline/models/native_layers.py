"""Decoder layers and depth-head blocks on the native decode kernels (CPU, float32, model.packed_linears).

A small model's decode step on a CPU is bound by the number of torch operations, not their size:
the built-in voice's layer is about 35 of them (norms, the rotation's slices and concatenations,
SiLU, residual sums) at a few microseconds each, around four products of a few microseconds. Here
a layer is two native calls around the attention (``layer_pre``, ``layer_post``:
audio_pipeline_kernels/native_decode.py) and a depth-head block one (``mlp_block``).

A step with prompt positions runs the same per-row operations one by one, so its products can
still split by position (model.prompt_dtype's bfloat16 rows: models/prompt_precision.py); its
other rows get the very bits the fused calls give them, so a request's speech does not depend on
whether another request's prompt shared its step.
"""

from __future__ import annotations

import torch

from audio_pipeline.models.prompt_precision import project
from audio_pipeline_kernels.native_decode import NativeWeight


def _native_weight(module) -> NativeWeight | None:
    packed = getattr(module, "packed_weight", None)
    return packed if isinstance(packed, NativeWeight) else None


class NativeDecoderLayer:
    """``DecoderLayer.forward`` on the native kernels: ``self(x, cos, sin, batch)``."""

    def __init__(self, layer, kernel):
        attn, mlp = layer.self_attn, layer.mlp
        self.kernel, self.attn, self.mlp = kernel, attn, mlp
        self.index = attn.layer
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        qkv, o = _native_weight(attn.qkv_proj), _native_weight(attn.o_proj)
        gate_up, down = _native_weight(mlp.gate_up_proj), _native_weight(mlp.down_proj)
        self.qkv = (qkv.panels, qkv.out_features, qkv.bias)
        self.post = (o.panels, o.out_features, o.bias, self.post_norm.weight, self.post_norm.eps,
                     gate_up.panels, gate_up.out_features, gate_up.bias, down.panels, down.out_features, down.bias)

    @staticmethod
    def applies(layer) -> bool:
        """Whether ``layer`` (a DecoderLayer) runs here: fused q/k/v and gate/up on the native
        kernel's packed weights, float32, without per-head query/key norms (Qwen3's)."""
        attn, mlp = layer.self_attn, layer.mlp
        return (attn.q_norm is None and attn.qkv_proj is not None and mlp.gate_up_proj is not None
                and layer.input_layernorm.weight.dtype == torch.float32
                and all(_native_weight(m) is not None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                 mlp.down_proj)))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch) -> torch.Tensor:
        kernel, tokens = self.kernel, x.shape[0]
        rows = getattr(batch, "prompt_rows", ())
        rotated = self.heads + self.kv_heads
        norm = self.input_norm
        if rows:  # the same per-row operations one by one: the products split by position
            qkv = project(self.attn.qkv_proj, kernel.rms_norm(x, norm.weight, norm.eps), rows)
            kernel.rotate_(qkv, cos, sin, rotated, self.head_dim)
        else:
            qkv = kernel.layer_pre(x, norm.weight, norm.eps, *self.qkv, cos, sin, rotated, self.head_dim)
        q, k, v = qkv.split(self.split, dim=-1)
        out = batch.attend(self.index, q.view(tokens, self.heads, self.head_dim),
                           k.view(tokens, self.kv_heads, self.head_dim), v.view(tokens, self.kv_heads, self.head_dim))
        out = out.reshape(tokens, self.split[0])
        if not rows:
            return kernel.layer_post(x, out, *self.post)
        summed, normed = kernel.add_rms_norm(x, project(self.attn.o_proj, out, rows), self.post_norm.weight,
                                             self.post_norm.eps)
        gate_up = project(self.mlp.gate_up_proj, normed, rows)
        return summed + project(self.mlp.down_proj, kernel.silu_mul(gate_up), rows)


def attach_native_layers(layers, kernel) -> int:
    """Gives every DecoderLayer in ``layers`` that can run on the native ``kernel`` its
    :class:`NativeDecoderLayer` (``layer.native``); returns how many."""
    from audio_pipeline.models.llama import DecoderLayer

    count = 0
    for layer in layers:
        if isinstance(layer, DecoderLayer) and NativeDecoderLayer.applies(layer):
            layer.native = NativeDecoderLayer(layer, kernel)
            count += 1
    return count


def native_block_call(gate_up, down, kernel):
    """A SwiGLU block's forward (``x + down(silu(gate) * up)`` of its normed input) as one native
    call over its packed ``gate_up`` and ``down`` weights, or None where they are not the native
    kernel's: ``call(x, norm)``."""
    if kernel is None or not (isinstance(gate_up, NativeWeight) and isinstance(down, NativeWeight)):
        return None
    weights = (gate_up.panels, gate_up.out_features, gate_up.bias, down.panels, down.out_features, down.bias)
    return lambda x, norm: kernel.mlp_block(x, norm.weight, norm.eps, *weights)

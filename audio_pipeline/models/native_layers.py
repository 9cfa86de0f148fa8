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


#: KV cache dtypes the fused call stores into (else the batch's own write: fp8 caches).
STORED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
        if not rows and hasattr(batch, "stored_kv"):
            caches = batch.stored_kv(self.index)
            if caches[0].dtype in STORED_DTYPES and caches[0].device.type == "cpu":
                # The keys and values go into the cache inside the call (as write_paged_kv would put them).
                qkv = kernel.layer_pre(x, norm.weight, norm.eps, *self.qkv, cos, sin, rotated, self.head_dim, *caches,
                                       self.split[1])
                query = qkv[:, :self.split[0]].view(tokens, self.heads, self.head_dim)
                out = batch.attend_stored(self.index, query).reshape(tokens, self.split[0])
                return kernel.layer_post(x, out, *self.post)
        if rows:  # the same per-row operations one by one: the products split by position
            qkv = project(self.attn.qkv_proj, kernel.rms_norm(x, norm.weight, norm.eps), rows)
            kernel.rotate_(qkv, cos, sin, rotated, self.head_dim)
        else:
            qkv = kernel.layer_pre(x, norm.weight, norm.eps, *self.qkv, cos, sin, rotated, self.head_dim, None, None,
                                   None, 0)
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


def attach_native_layers(layers, kernel, final_norm=None) -> int:
    """Gives every DecoderLayer in ``layers`` that can run on the native ``kernel`` its
    :class:`NativeDecoderLayer` (``layer.native``), and where any does, the backbone's
    ``final_norm`` (an RMSNorm) the kernel's rms_norm; returns how many layers."""
    from audio_pipeline.models.llama import DecoderLayer

    count = 0
    for layer in layers:
        if isinstance(layer, DecoderLayer) and NativeDecoderLayer.applies(layer):
            layer.native = NativeDecoderLayer(layer, kernel)
            count += 1
    if count and final_norm is not None and final_norm.weight.dtype == torch.float32:
        final_norm.native = kernel.rms_norm
    return count


def native_block_call(gate_up, down, kernel):
    """A SwiGLU block's forward (``x + down(silu(gate) * up)`` of its normed input) as one native
    call over its packed ``gate_up`` and ``down`` weights, or None where they are not the native
    kernel's: ``call(x, norm)``."""
    if kernel is None or not (isinstance(gate_up, NativeWeight) and isinstance(down, NativeWeight)):
        return None
    weights = (gate_up.panels, gate_up.out_features, gate_up.bias, down.panels, down.out_features, down.bias)
    return lambda x, norm: kernel.mlp_block(x, norm.weight, norm.eps, *weights)


def native_head_call(depth, embedding, kernel):
    """A frame model's DepthHead (models/frame_head.py) as one native call over its packed blocks
    and readout, or None where they are not all the native kernel's: ``call(hidden, token_codes)``."""
    blocks = list(depth.blocks)
    if kernel is None or any(block.native is None for block in blocks) or \
            not isinstance(depth.packed_readout, NativeWeight) or embedding.weight.dtype != torch.float32:
        return None
    head = depth.head
    norms = [block.norm.weight for block in blocks]
    gate_ups = [block.packed_gate_up.panels for block in blocks]
    downs = [block.down_proj.packed_weight.panels for block in blocks]
    if len({block.norm.eps for block in blocks} | {depth.norm.eps}) != 1:
        return None  # one eps for every norm is what the call takes
    gate_up_n, down_n = blocks[0].packed_gate_up.out_features, blocks[0].down_proj.packed_weight.out_features
    readout = depth.packed_readout
    offset = head.code_offsets[head.token_column]
    return lambda hidden, codes: kernel.depth_head(hidden, codes, embedding.weight, offset, norms, depth.norm.eps,
                                                   gate_ups, gate_up_n, downs, down_n, depth.norm.weight,
                                                   readout.panels, readout.out_features)

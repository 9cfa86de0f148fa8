"""The depth pass of the models whose positions are whole frames (CSM's depth decoder, Qwen3-TTS's
code predictor): after the backbone samples a frame's first code, a small transformer samples the
others one by one, its positions restarting at 0 every frame, over a dense cache of its own.

Written once here; a model says what differs (its projection into the small transformer, the
head that gives codebook k's logits, the embedding that feeds codebook k back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.models.llama import rotary_cos_sin


class FrameKVCache:
    """The depth decoder's dense per-frame KV cache ([layers, B, N, kv_heads, head_dim] keys and
    values), an AttentionBatch over B sequences that each compute positions
    [start, start + count) (set with ``step``); tokens are flat, sequence-major: row b * count + i."""

    def __init__(self, num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.keys = torch.empty(num_layers, batch, length, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.batch = batch
        self.start = 0
        self.count = 0
        self.mask: torch.Tensor | None = None

    def step(self, start: int, count: int) -> None:
        self.start, self.count = start, count
        # Causal among the new positions (key j is visible to query i where j <= start + i).
        self.mask = None if count == 1 else torch.ones(count, start + count, dtype=torch.bool,
                                                       device=self.keys.device).tril(diagonal=start)

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch, start, count = self.batch, self.start, self.count
        end = start + count
        self.keys[layer, :, start:end] = keys.view(batch, count, *keys.shape[1:])
        self.values[layer, :, start:end] = values.view(batch, count, *values.shape[1:])
        heads = query.shape[1]
        q = query.view(batch, count, heads, -1).transpose(1, 2)
        k = self.keys[layer, :, :end].transpose(1, 2)
        v = self.values[layer, :, :end].transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=k.shape[1] != heads)
        return out.transpose(1, 2).reshape(batch * count, heads, -1)


@dataclass
class DepthTransformer:
    """A model's small depth transformer: ``project`` takes backbone-width inputs to its width,
    then its ``layers`` and final ``norm``; rotary positions from ``inv_freq`` (and its scaling)."""

    project: nn.Module
    layers: Sequence[nn.Module]
    norm: nn.Module
    inv_freq: torch.Tensor
    rope_scaling: Any

    def run(self, embeds: torch.Tensor, start: int, cache: FrameKVCache, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
        """Positions [start, start + n) of every frame ([B, n, backbone width] inputs) through the
        transformer: [B, n, its width] after its final norm."""
        batch, count = embeds.shape[:2]
        x = self.project(embeds).reshape(batch * count, -1)
        cache.step(start, count)
        cos = cos[start:start + count].repeat(batch, 1)
        sin = sin[start:start + count].repeat(batch, 1)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        return self.norm(x).view(batch, count, -1)

    def frame(self, first: torch.Tensor, first_codes: torch.Tensor, count: int,
              choose: Callable[[int, torch.Tensor], torch.Tensor], *,
              logits: Callable[[int, torch.Tensor], torch.Tensor],
              embed: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The [B, count] frames of B sequences: ``first`` ([B, 2, backbone width]: the backbone's
        hidden state and the first code's embedding) goes in at positions 0 and 1; then for
        k = 1 .. count - 1, ``choose(k, logits(k, hidden))`` picks codebook k ([B]) from the last
        position's output, and ``embed(k, codes)`` ([B, backbone width]) feeds it back."""
        batch, dtype, device = first.shape[0], first.dtype, first.device
        attention = self.layers[0].self_attn
        cache = FrameKVCache(len(self.layers), batch, count, attention.num_kv_heads, attention.head_dim, dtype,
                             device)
        cos, sin = rotary_cos_sin(torch.arange(count, device=device), self.inv_freq, self.rope_scaling, dtype)
        frame = torch.empty(batch, count, dtype=torch.long, device=device)
        frame[:, 0] = first_codes
        hidden = self.run(first, 0, cache, cos, sin)[:, -1]
        for k in range(1, count):
            codes = choose(k, logits(k, hidden))
            frame[:, k] = codes
            if k == count - 1:
                break
            hidden = self.run(embed(k, codes)[:, None], k + 1, cache, cos, sin)[:, -1]
        return frame

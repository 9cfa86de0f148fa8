"""Attention of one ragged step over a paged KV cache, one batched computation per layer.

Cache layout, per layer: keys and values of shape [kv_heads, num_blocks * block_size, head_dim]
(head-major, so that a gathered sequence is a contiguous [length, head_dim] matrix per head, the
layout scaled_dot_product_attention reads fastest). Token t of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, i.e. slot
``block * block_size + offset``.

A step mixes decode rows (one new token), multi-token rows (a layout's forced tokens, prefill
chunks) and whole prompts. ``RaggedStep`` describes such a step once, from the block tables and
lengths (shared by every layer); ``ragged_paged_attention`` then runs each layer as one padded
``scaled_dot_product_attention`` call: queries padded to the longest row, each sequence's live
keys and values read with one ``index_select`` (exactly its tokens, padded to the longest
sequence), and one additive mask that encodes both the ragged lengths and causality.

The reference it must equal is plain causal attention over each sequence's contiguous keys and
values (``causal_attention_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores ``keys``/``values`` ([T, kv_heads, head_dim]) at the cache slots ``slot_mapping`` ([T])."""
    key_cache.index_copy_(1, slot_mapping, keys.transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(1, slot_mapping, values.transpose(0, 1).to(value_cache.dtype))


def sequence_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache slots of a sequence's first ``length`` tokens."""
    positions = torch.arange(length, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


@dataclass
class RaggedStep:
    """Per-step indices shared by every layer.

    ``query_index`` [B, Q]: the flat query row of each sequence's i-th new token (padding points at
    row 0), or None when every row has one query; ``output_rows`` [T]: where each flat row sits in
    the padded [B * Q] output; ``kv_slots`` [B * L]: the cache slots of each sequence's first L
    positions (L the longest sequence; shorter ones padded with slot 0); ``mask``: additive
    [B, 1, Q, L] (0 where visible, -inf elsewhere), or None when nothing needs masking (one query
    per row over keys of one common length).
    """

    query_index: torch.Tensor | None
    output_rows: torch.Tensor | None
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    batch: int
    max_len: int

    @classmethod
    def build(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
              block_size: int, dtype: torch.dtype = torch.float32, *, max_len: int | None = None,
              max_query: int | None = None, uniform: bool | None = None) -> "RaggedStep":
        """From block_tables [B, >= blocks of the longest sequence] (padded with any valid block),
        seq_lens [B] (each sequence's length including this step's tokens) and query_lens [B] (this
        step's new tokens, >= 1, the last ones of each sequence; flat rows are ordered sequence by
        sequence).

        ``max_len``, ``max_query`` (the largest of each) and ``uniform`` (all seq_lens equal) may
        come from the caller's host-side lists, so that no device value is read back here.
        """
        device = block_tables.device
        batch = seq_lens.shape[0]
        max_len = int(seq_lens.max()) if max_len is None else max_len
        max_query = int(query_lens.max()) if max_query is None else max_query
        if uniform is None:
            uniform = bool((seq_lens == max_len).all())
        positions = torch.arange(max_len, device=device)
        slots = block_tables[:, positions // block_size] * block_size + positions % block_size  # [B, L]
        live = positions[None, :] < seq_lens[:, None]
        kv_slots = torch.where(live, slots, torch.zeros_like(slots)).reshape(-1)
        steps = torch.arange(max_query, device=device)
        if max_query == 1:
            query_index = output_rows = None
        else:
            starts = torch.cumsum(query_lens, 0) - query_lens
            valid = steps[None, :] < query_lens[:, None]  # [B, Q]
            query_index = torch.where(valid, starts[:, None] + steps[None, :], torch.zeros_like(starts)[:, None])
            output_rows = (torch.arange(batch, device=device)[:, None] * max_query + steps[None, :])[valid]
        if max_query == 1 and uniform:
            mask = None
        else:
            # Query i of sequence b sits at position seq_len - query_len + i and sees keys up to it.
            last_visible = (seq_lens - query_lens)[:, None] + steps[None, :]  # [B, Q]
            visible = positions[None, None, :] <= last_visible[:, :, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None]
        return cls(query_index, output_rows, kv_slots, mask, batch, max_len)


def ragged_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           step: RaggedStep, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a ragged step whose new keys/values are already in the cache.

    query: [T, heads, dim] (flat rows, sequence by sequence); key_cache, value_cache:
    [kv_heads, slots, dim]. Returns [T, heads, dim].
    """
    tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[0]
    batch, length = step.batch, step.max_len
    if step.query_index is None:
        q = query.view(batch, 1, heads, dim)
    else:
        q = query[step.query_index]  # [B, Q, H, D]
    # [kv_heads, B * L, D] -> [B, kv_heads, L, D] with each head's [L, D] contiguous.
    keys = key_cache.index_select(1, step.kv_slots).view(kv_heads, batch, length, dim).transpose(0, 1)
    values = value_cache.index_select(1, step.kv_slots).view(kv_heads, batch, length, dim).transpose(0, 1)
    if heads != kv_heads:  # grouped-query attention: each kv head serves heads / kv_heads query heads
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=step.mask, scale=scale)
    out = out.transpose(1, 2)  # [B, Q, H, D]
    if step.query_index is None:
        return out.reshape(tokens, heads, dim)
    return out.reshape(-1, heads, dim)[step.output_rows]

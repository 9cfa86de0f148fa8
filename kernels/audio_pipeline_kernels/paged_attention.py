"""Attention of one ragged step over the paged KV cache in plain torch: the fallback that runs on
any device and dtype (the native CPU kernel and FlashInfer read the cache in place instead).

Each layer runs as one padded ``scaled_dot_product_attention`` call: queries padded to the longest
row, each sequence's live keys and values read with one ``index_select`` (exactly its tokens, padded
to the longest sequence), and one additive mask that encodes both the ragged lengths and causality.
``RaggedStep`` holds those indices, built once per step on the host from the step's metadata
(:class:`~audio_pipeline_kernels.paged_layout.StepMetadata`) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from audio_pipeline_kernels.paged_layout import StepMetadata, gather_slots


@dataclass
class RaggedStep:
    """Per-step indices shared by every layer.

    ``query_index`` [B, Q]: the flat query row of each sequence's i-th new token (padding points at
    row 0), or None when every row has one query; ``output_rows`` [T]: where each flat row sits in
    the padded [B * Q] output; ``kv_slots`` [B * L]: the cache slots of each sequence's first L
    positions (L the longest sequence; shorter ones padded with slot 0), or with a sliding window
    its L positions from the first its first query sees (the blocks before may be gone: block_manager's
    HOLE); ``mask``: additive [B, 1, Q, L] (0 where visible, -inf elsewhere), or None when nothing
    needs masking (one query per row over keys of one common length).
    """

    query_index: torch.Tensor | None
    output_rows: torch.Tensor | None
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    batch: int
    max_len: int

    @classmethod
    def build(cls, metadata: StepMetadata, device: torch.device, dtype: torch.dtype = torch.float32,
              window: int | None = None) -> "RaggedStep":
        """From the step's host metadata (numpy throughout; only the results are copied to ``device``);
        ``window``: a sliding window (each query sees the ``window`` positions ending at its own)."""
        page = metadata.page_size
        batch, max_len, max_query = metadata.batch_size, metadata.max_seq_len, metadata.max_query_len
        seq_lens = metadata.seq_lens.astype(np.int64)
        query_lens = metadata.query_lens.astype(np.int64)
        windowed = window is not None and max_len > window
        # Each row's keys from the first position its first query sees (0 without a window).
        first = np.maximum(0, seq_lens - query_lens + 1 - window) if windowed else np.zeros_like(seq_lens)
        max_len = int((seq_lens - first).max())
        positions = first[:, None] + np.arange(max_len)[None, :]  # [B, L]: each row's key positions
        live = positions < seq_lens[:, None]
        page_index = metadata.kv_indptr[:-1, None].astype(np.int64) + positions // page
        page_index = np.where(live, page_index, 0)
        slots = metadata.kv_indices[page_index].astype(np.int64) * page + positions % page
        kv_slots = np.where(live, slots, 0).reshape(-1)
        steps = np.arange(max_query)
        query_index = output_rows = None
        if max_query > 1:
            starts = metadata.qo_indptr[:-1].astype(np.int64)
            valid = steps[None, :] < query_lens[:, None]  # [B, Q]
            query_index = np.where(valid, starts[:, None] + steps[None, :], 0)
            output_rows = (np.arange(batch)[:, None] * max_query + steps[None, :])[valid]
        mask = None
        if max_query > 1 or (seq_lens - first).min() != max_len:
            # Query i of sequence b sits at position seq_len - query_len + i and sees keys up to it
            # (and, with a window, none ``window`` or more before it).
            last_visible = (seq_lens - query_lens)[:, None] + steps[None, :]  # [B, Q]
            visible = positions[:, None, :] <= last_visible[:, :, None]
            if windowed:
                visible &= positions[:, None, :] > last_visible[:, :, None] - window
            mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(torch.from_numpy(~visible), float("-inf"))
            mask = mask[:, None].to(device)

        def tensor(array):
            return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return cls(tensor(query_index), tensor(output_rows), tensor(kv_slots), mask, batch, max_len)


def ragged_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           step: RaggedStep, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a ragged step whose new keys/values are already in the cache.

    query: [T, heads, dim] (flat rows, sequence by sequence); key_cache, value_cache:
    [num_blocks, page_size, kv_heads, dim]. Returns [T, heads, dim].
    """
    tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    batch, length = step.batch, step.max_len
    if step.query_index is None:
        q = query.view(batch, 1, heads, dim)
    else:
        q = query[step.query_index]  # [B, Q, H, D]
    # [B * L, kv_heads, D] -> [B, kv_heads, L, D]
    keys = gather_slots(key_cache, step.kv_slots, query.dtype).view(batch, length, kv_heads, dim).transpose(1, 2)
    values = gather_slots(value_cache, step.kv_slots, query.dtype).view(batch, length, kv_heads, dim).transpose(1, 2)
    if heads != kv_heads:  # grouped-query attention: each kv head serves heads / kv_heads query heads
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=step.mask, scale=scale)
    out = out.transpose(1, 2)  # [B, Q, H, D]
    if step.query_index is None:
        return out.reshape(tokens, heads, dim)
    return out.reshape(-1, heads, dim)[step.output_rows]

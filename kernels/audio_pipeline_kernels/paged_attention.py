"""Attention over a paged KV cache (torch reference): cache writes by slot, decode and prefill attention.

Cache layout, per layer: keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block ``block_table[t // block_size]`` at offset ``t % block_size``,
i.e. slot ``block * block_size + offset`` of the flattened cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from audio_pipeline_kernels.attention import causal_attention_reference


def write_paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores ``keys``/``values`` ([T, kv_heads, head_dim]) at the cache slots ``slot_mapping`` ([T])."""
    blocks, block_size, heads, dim = key_cache.shape
    key_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, keys.to(key_cache.dtype))
    value_cache.view(blocks * block_size, heads, dim).index_copy_(0, slot_mapping, values.to(value_cache.dtype))


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, contiguous: [length, kv_heads, head_dim]."""
    _, block_size, heads, dim = cache.shape
    blocks = cache.index_select(0, block_table[: (length + block_size - 1) // block_size])
    return blocks.reshape(-1, heads, dim)[:length]


def paged_decode_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float | None = None) -> torch.Tensor:
    """One query token per sequence, all sequences in one padded batch.

    query: [B, heads, dim]; block_tables: [B, max_blocks] (rows padded with any valid block id);
    seq_lens: [B], each sequence's length including the query token. Returns [B, heads, dim].
    """
    batch, num_heads, dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_len = int(seq_lens.max())
    used_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :used_blocks]
    keys = key_cache[table].reshape(batch, used_blocks * block_size, num_kv_heads, dim)[:, :max_len]
    values = value_cache[table].reshape(batch, used_blocks * block_size, num_kv_heads, dim)[:, :max_len]
    group = num_heads // num_kv_heads
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, heads, L, dim]
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(query[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out[:, :, 0, :]


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_starts: list[int],
                              query_lens: list[int], scale: float | None = None) -> torch.Tensor:
    """Causal attention for a ragged batch whose new tokens are already written to the cache.

    query: [T, heads, dim], sequence i's queries at rows query_starts[i] .. + query_lens[i], which
    are that sequence's last query_lens[i] positions of seq_lens[i]. Decode rows (one query) run as
    one padded batch; longer ones (prefill chunks) one sequence at a time.
    """
    out = torch.empty_like(query)
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    if decode:
        rows = torch.tensor([query_starts[i] for i in decode], device=query.device)
        index = torch.tensor(decode, device=query.device)
        out[rows] = paged_decode_attention_reference(query[rows], key_cache, value_cache, block_tables[index],
                                                     seq_lens[index], scale)
    lengths = seq_lens.tolist()
    for i, n in enumerate(query_lens):
        if n <= 1:
            continue
        span = slice(query_starts[i], query_starts[i] + n)
        keys = gather_sequence_kv(key_cache, block_tables[i], lengths[i])
        values = gather_sequence_kv(value_cache, block_tables[i], lengths[i])
        out[span] = causal_attention_reference(query[span], keys, values, scale)
    return out

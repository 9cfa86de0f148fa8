"""Causal attention of new query tokens over a sequence's cached keys and values (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention for one sequence whose last ``n`` positions are the queries.

    query: [n, num_heads, head_dim]; keys, values: [L, num_kv_heads, head_dim] with L >= n, the
    whole sequence so far including the n new tokens. Query j sits at position L - n + j and sees
    keys 0 .. L - n + j. Grouped-query attention repeats each kv head num_heads / num_kv_heads
    times. ``window``: each query sees only the ``window`` positions ending at its own (a sliding
    window; None: all before it). Returns [n, num_heads, head_dim].
    """
    n, num_heads, _ = query.shape
    length, num_kv_heads, _ = keys.shape
    if length < n:
        raise ValueError(f"keys hold {length} positions, fewer than the {n} queries")
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1)  # [heads, n, d]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)
    if window is not None and window < length:
        query_pos = torch.arange(length - n, length, device=query.device)[:, None]
        key_pos = torch.arange(length, device=query.device)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    elif n == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    elif n == length:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        query_pos = torch.arange(length - n, length, device=query.device)[:, None]
        mask = torch.arange(length, device=query.device)[None, :] <= query_pos
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)

"""The paged KV cache tensors and their manager (block bookkeeping + tensors + per-step batch views)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from audio_pipeline.interfaces import KVCacheParams
from audio_pipeline.kv_cache.block_manager import BlockManager
from audio_pipeline_kernels import paged_attention_reference, write_paged_kv


class PagedKVCache:
    """Per layer, keys and values of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, params: KVCacheParams, num_blocks: int, device: torch.device):
        shape = (num_blocks, params.page_size, params.n_kv_heads, params.head_dim)
        self.keys = [torch.zeros(shape, dtype=params.dtype, device=device) for _ in range(params.num_layers)]
        self.values = [torch.zeros(shape, dtype=params.dtype, device=device) for _ in range(params.num_layers)]

    @staticmethod
    def bytes_per_block(params: KVCacheParams) -> int:
        return params.page_size * params.bytes_per_token


@dataclass
class PagedBatch:
    """Where each sequence's new tokens sit in the flat batch, and where their KV lives."""

    cache: PagedKVCache
    query_starts: list[int]
    query_lengths: list[int]
    #: [B] each sequence's length after this step's tokens.
    seq_lens: torch.Tensor
    #: [B, max_blocks] block ids (rows padded with block 0).
    block_tables: torch.Tensor
    #: [T] flat cache slot of every new token.
    slot_mapping: torch.Tensor

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Writes the new tokens' keys/values of ``layer`` and returns their causal attention output."""
        key_cache, value_cache = self.cache.keys[layer], self.cache.values[layer]
        write_paged_kv(key_cache, value_cache, keys, values, self.slot_mapping)
        return paged_attention_reference(query, key_cache, value_cache, self.block_tables, self.seq_lens,
                                         self.query_starts, self.query_lengths)


class PagedKVCacheManager:
    """The block manager plus the cache tensors it indexes."""

    def __init__(self, params: KVCacheParams, device: torch.device, total_num_blocks: int, *,
                 enable_prefix_caching: bool = True):
        if total_num_blocks < 1:
            raise ValueError(f"the KV cache holds {total_num_blocks} blocks of {params.page_size} tokens; "
                             "give it more memory (kv_cache_memory_bytes) or use a smaller kv_cache_page_size")
        self.params = params
        self.device = device
        self.block_manager = BlockManager(total_num_blocks, params.page_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.cache = PagedKVCache(params, total_num_blocks, device)

    @property
    def page_size(self) -> int:
        return self.params.page_size

    @property
    def total_num_blocks(self) -> int:
        return self.block_manager.total_num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    def claim(self, request_id: str, tokens: Sequence[int] = ()) -> int:
        return self.block_manager.claim(request_id, tokens)

    def contains(self, request_id: str) -> bool:
        return request_id in self.block_manager

    def release(self, request_id: str) -> None:
        self.block_manager.release(request_id)

    def batch(self, request_ids: Sequence[str], starts: Sequence[int], lengths: Sequence[int]) -> PagedBatch:
        """The attention view of a step where sequence i computes tokens [starts[i], starts[i] + lengths[i])."""
        manager = self.block_manager
        tables = [manager.block_table(r) for r in request_ids]
        for request_id, table, start, length in zip(request_ids, tables, starts, lengths):
            if (start + length) > len(table) * self.page_size:
                raise RuntimeError(f"request {request_id!r}: KV for {start + length} tokens not allocated")
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        slots: list[int] = []
        query_starts: list[int] = []
        for table, start, length in zip(tables, starts, lengths):
            query_starts.append(len(slots))
            slots.extend(table[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(start, start + length))
        device = self.device
        return PagedBatch(
            cache=self.cache, query_starts=query_starts, query_lengths=list(lengths),
            seq_lens=torch.tensor([s + n for s, n in zip(starts, lengths)], dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device))

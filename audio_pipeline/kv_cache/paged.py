"""The paged KV cache tensors and their manager (block bookkeeping + tensors + per-step batch views)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from audio_pipeline.interfaces import KVCacheParams
from audio_pipeline.kv_cache.block_manager import BlockManager
from audio_pipeline_kernels import RaggedStep, native_attention, ragged_paged_attention, write_paged_kv


class PagedKVCache:
    """Per layer, keys and values of shape [num_kv_heads, num_blocks * block_size, head_dim]: block b
    holds slots [b * block_size, (b + 1) * block_size) (the layout of audio_pipeline_kernels)."""

    def __init__(self, params: KVCacheParams, num_blocks: int, device: torch.device):
        shape = (params.n_kv_heads, num_blocks * params.page_size, params.head_dim)
        self.keys = [torch.zeros(shape, dtype=params.dtype, device=device) for _ in range(params.num_layers)]
        self.values = [torch.zeros(shape, dtype=params.dtype, device=device) for _ in range(params.num_layers)]

    @staticmethod
    def bytes_per_block(params: KVCacheParams) -> int:
        return params.page_size * params.bytes_per_token


@dataclass
class PagedBatch:
    """Where a step's new tokens go in the cache, and how they attend (shared by every layer)."""

    cache: PagedKVCache
    #: New tokens of each sequence (host-side).
    query_lengths: list[int]
    #: [B] each sequence's length after this step's tokens.
    seq_lens: torch.Tensor
    #: [T] flat cache slot of every new token.
    slot_mapping: torch.Tensor
    #: [B, max_blocks] block ids (rows padded with block 0), [B] first flat row and new tokens of each sequence.
    block_tables: torch.Tensor
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    page_size: int
    #: The native kernel (reads the cache in place), or None for the torch form.
    native: Callable | None = None
    #: The step's ragged layout for the torch form (None with the native kernel).
    step: RaggedStep | None = None

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Writes the new tokens' keys/values of ``layer`` and returns their causal attention output."""
        key_cache, value_cache = self.cache.keys[layer], self.cache.values[layer]
        write_paged_kv(key_cache, value_cache, keys, values, self.slot_mapping)
        if self.native is not None:
            return self.native(query, key_cache, value_cache, self.block_tables, self.seq_lens, self.query_starts,
                               self.query_lens, self.page_size, query.shape[-1] ** -0.5)
        return ragged_paged_attention(query, key_cache, value_cache, self.step)


class PagedKVCacheManager:
    """The block manager plus the cache tensors it indexes."""

    def __init__(self, params: KVCacheParams, device: torch.device, total_num_blocks: int, *,
                 enable_prefix_caching: bool = True, attention_kernel: str = "auto"):
        if total_num_blocks < 1:
            raise ValueError(f"the KV cache holds {total_num_blocks} blocks of {params.page_size} tokens; "
                             "give it more memory (kv_cache_memory_bytes) or use a smaller kv_cache_page_size")
        self.params = params
        self.device = device
        self.block_manager = BlockManager(total_num_blocks, params.page_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.cache = PagedKVCache(params, total_num_blocks, device)
        #: The native attention kernel when in use (attention_kernel: native, or auto on CPU with float32).
        self.native = None
        if attention_kernel != "torch" and device.type == "cpu" and params.dtype == torch.float32:
            self.native = native_attention()
        if attention_kernel == "native" and self.native is None:
            raise ValueError("model.kv_cache.attention_kernel=native: the native kernel runs on CPU with float32 "
                             "and needs a C++ compiler (see the log); use auto or torch")

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
        page = self.page_size
        tables = [manager.block_table(r) for r in request_ids]
        ends = [s + n for s, n in zip(starts, lengths)]
        for request_id, table, end in zip(request_ids, tables, ends):
            if end > len(table) * page:
                raise RuntimeError(f"request {request_id!r}: KV for {end} tokens not allocated")
        width = max(len(t) for t in tables)
        device = self.device
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        length_t = torch.tensor(lengths, dtype=torch.long, device=device)
        seq_lens = start_t + length_t
        # Slot of every new token, without a per-token loop: row -> its sequence -> its position.
        total = sum(lengths)
        sequence = torch.repeat_interleave(torch.arange(len(tables), device=device), length_t, output_size=total)
        first_row = torch.cumsum(length_t, 0) - length_t
        positions = start_t[sequence] + torch.arange(total, device=device) - first_row[sequence]
        slots = block_tables[sequence, torch.div(positions, page, rounding_mode="floor")] * page + positions % page
        step = None
        if self.native is None:
            max_len = max(ends)
            step = RaggedStep.build(block_tables, seq_lens, length_t, page, self.params.dtype, max_len=max_len,
                                    max_query=max(lengths), uniform=min(ends) == max_len)
        return PagedBatch(cache=self.cache, query_lengths=list(lengths), seq_lens=seq_lens, slot_mapping=slots,
                          block_tables=block_tables, query_starts=first_row, query_lens=length_t, page_size=page,
                          native=self.native, step=step)

"""The paged KV cache tensors and their manager (block bookkeeping + tensors + per-step batch views)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from audio_pipeline.models.interface import KVCacheParams
from audio_pipeline.core.kv_cache.block_manager import BlockManager
from audio_pipeline_kernels import (AttentionBackend, AttentionPlan, StepMetadata, allocate_paged_cache,
                                    select_attention_backend, write_paged_kv)


logger = logging.getLogger(__name__)


class PagedKVCache:
    """Per layer, keys and values of shape [num_blocks + 1, page_size, kv_heads, head_dim] (the layout
    of audio_pipeline_kernels.paged_layout, FlashInfer's NHD). The last block is scratch: the rows
    that pad a step to a static shape write there, and no sequence ever holds it."""

    def __init__(self, params: KVCacheParams, num_blocks: int, device: torch.device):
        self.params, self.device = params, device
        self.scratch_block = num_blocks
        self.keys, self.values = self._allocate(num_blocks)

    def _allocate(self, num_blocks: int):
        """Keys and values per layer for ``num_blocks`` blocks and the scratch block."""
        params = self.params
        return allocate_paged_cache(params.num_layers, num_blocks + 1, params.page_size, params.n_kv_heads,
                                    params.head_dim, params.dtype, self.device)

    def grow(self, num_blocks: int) -> None:
        """Room for ``num_blocks`` blocks (more than now), every block keeping its contents; the
        scratch block moves to the new end. Steps must not be running (their views would go stale)."""
        keys, values = self._allocate(num_blocks)
        kept = self.scratch_block
        for new, old in zip([*keys, *values], [*self.keys, *self.values]):
            new[:kept].copy_(old[:kept])
        self.keys, self.values, self.scratch_block = keys, values, num_blocks

    @staticmethod
    def bytes_per_block(params: KVCacheParams) -> int:
        return params.page_size * params.bytes_per_token


@dataclass
class PagedBatch:
    """Where a step's new tokens go in the cache, and how they attend (shared by every layer)."""

    cache: PagedKVCache
    metadata: StepMetadata
    #: [T] flat cache slot of every new token, on the cache's device.
    slot_mapping: torch.Tensor
    plan: AttentionPlan
    #: The row ranges that are prompt positions, where model.prompt_dtype applies (else empty).
    prompt_rows: tuple[tuple[int, int], ...] = ()

    @property
    def query_lengths(self) -> list[int]:
        return self.metadata.query_lens.tolist()

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Writes the new tokens' keys/values of ``layer`` and returns their causal attention output."""
        key_cache, value_cache = self.cache.keys[layer], self.cache.values[layer]
        write_paged_kv(key_cache, value_cache, keys, values, self.slot_mapping)
        return self.plan.attend(query, key_cache, value_cache)

    def stored_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s key and value caches and the step's slot mapping, for a caller that stores the
        new tokens' keys/values itself (as write_paged_kv would: models/native_layers.py) and then
        calls :meth:`attend_stored`."""
        return self.cache.keys[layer], self.cache.values[layer], self.slot_mapping

    def attend_stored(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` for a step whose new keys/values of ``layer`` are in the cache already."""
        return self.plan.attend(query, self.cache.keys[layer], self.cache.values[layer])


class PagedKVCacheManager:
    """The block manager plus the cache tensors it indexes and the attention backend that reads them."""

    def __init__(self, params: KVCacheParams, device: torch.device, total_num_blocks: int, *,
                 enable_prefix_caching: bool = True, attention_kernel: str = "auto", num_heads: int | None = None,
                 model_dtype: torch.dtype | None = None, prefill_backend: str = "auto",
                 max_num_blocks: int | None = None):
        if total_num_blocks < 1:
            raise ValueError(f"the KV cache holds {total_num_blocks} blocks of {params.page_size} tokens; "
                             "give it more memory (kv_cache_memory_bytes) or use a smaller kv_cache_page_size")
        self.params = params
        self.device = device
        #: Called before the cache grows (the engine waits there for steps in flight).
        self.before_grow = lambda: None
        growable = max_num_blocks is not None and max_num_blocks > total_num_blocks
        self.block_manager = BlockManager(total_num_blocks, params.page_size,
                                          enable_prefix_caching=enable_prefix_caching,
                                          max_num_blocks=max_num_blocks, grow=self._grow if growable else None,
                                          window=params.window)
        self.cache = PagedKVCache(params, total_num_blocks, device)
        self.backend: AttentionBackend = select_attention_backend(
            attention_kernel, device, model_dtype or params.dtype, num_heads=num_heads or params.n_kv_heads,
            num_kv_heads=params.n_kv_heads, head_dim=params.head_dim, page_size=params.page_size,
            cache_dtype=params.dtype, prefill_backend=prefill_backend, window=params.window)

    def _grow(self, num_blocks: int) -> int:
        self.before_grow()
        self.cache.grow(num_blocks)
        logger.info("KV cache grown to %d pages of %d tokens (%.0f MiB; at most %d)", num_blocks, self.page_size,
                    num_blocks * PagedKVCache.bytes_per_block(self.params) / 2**20, self.block_manager.max_num_blocks)
        return num_blocks

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

    def release(self, request_id: str) -> None:
        self.block_manager.release(request_id)

    def metadata(self, request_ids: Sequence[str], starts: Sequence[int], lengths: Sequence[int], *,
                 padding: int = 0) -> StepMetadata:
        """The host metadata of a step where sequence i computes tokens [starts[i], starts[i] + lengths[i]),
        then ``padding`` rows that each compute one token at position 0 of the scratch page (a static shape)."""
        tables = self.block_manager.block_tables(request_ids) + [[self.cache.scratch_block]] * padding
        try:
            return StepMetadata.build(tables, [*starts, *[0] * padding], [*lengths, *[1] * padding], self.page_size)
        except RuntimeError as exc:
            raise RuntimeError(f"requests {list(request_ids)!r}: {exc}") from None

    def decode_metadata(self, request_ids: Sequence[str], starts: Sequence[int], *, padding: int = 0,
                        page_rows: np.ndarray | None = None) -> StepMetadata:
        """:meth:`metadata` of a decode step (request i computes the one token at ``starts[i]``),
        from the block manager's page table; ``page_rows``: the requests' page-table rows, where the
        caller keeps them (else looked up by ``request_ids``)."""
        blocks = self.block_manager
        rows = blocks.page_rows(request_ids) if page_rows is None else page_rows
        try:
            return StepMetadata.for_decode(blocks.page_table, blocks.page_counts, rows,
                                           np.asarray(starts, dtype=np.int64), self.page_size, padding=padding,
                                           padding_page=self.cache.scratch_block)
        except RuntimeError as exc:
            raise RuntimeError(f"requests {list(request_ids)!r}: {exc}") from None

    def batch(self, request_ids: Sequence[str], starts: Sequence[int], lengths: Sequence[int]) -> PagedBatch:
        """The attention view of a step where sequence i computes tokens [starts[i], starts[i] + lengths[i])."""
        metadata = self.metadata(request_ids, starts, lengths)
        slots = torch.from_numpy(metadata.slot_mapping).to(self.device)
        return PagedBatch(self.cache, metadata, slots, self.backend.plan(metadata))

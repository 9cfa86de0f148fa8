"""The paged KV cache's layout and one step's metadata, in the form FlashInfer reads.

Cache, per layer: keys and values each of shape ``[num_blocks, page_size, kv_heads, head_dim]``
(FlashInfer's "NHD" layout). Token ``t`` of a sequence lives in page ``pages[t // page_size]`` at
row ``t % page_size``; its flat slot is ``page * page_size + row``.

A step's metadata is built on the host (numpy, no device values read) from each sequence's page
list, where it starts and how many new tokens it computes. The page lists travel in compressed
sparse-row form: ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` are sequence b's pages in order,
``kv_last_page_len[b]`` the rows used in its last page; ``qo_indptr`` delimits each sequence's new
tokens in the flat batch (all int32). Every backend reads this one form; ``paged_attention_reference``
reads it with plain torch, one sequence at a time, to check the builder and the backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np
import torch

from audio_pipeline_kernels.attention import causal_attention_reference


def allocate_paged_cache(num_layers: int, num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer key and value caches of shape [num_blocks, page_size, kv_heads, head_dim]."""
    shape = (num_blocks, page_size, kv_heads, head_dim)
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return keys, values


def _as_stored(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 caches are copied and indexed as bytes (torch has no index_copy / index_select for fp8)."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores ``keys``/``values`` ([T, kv_heads, head_dim]) at the flat cache slots ``slot_mapping`` ([T],
    int64). Slots are rows of the cache seen as [num_blocks * page_size, kv_heads, head_dim]."""
    _, _, kv_heads, head_dim = key_cache.shape
    if key_cache.dtype in FP8_DTYPES:
        keys, values = _as_stored(keys.to(key_cache.dtype)), _as_stored(values.to(value_cache.dtype))
        key_cache, value_cache = _as_stored(key_cache), _as_stored(value_cache)
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, keys.to(key_cache.dtype))
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, values.to(value_cache.dtype))


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` of a cache seen as [num_blocks * page_size, kv_heads, head_dim], in ``dtype``."""
    _, _, kv_heads, head_dim = cache.shape
    rows = _as_stored(cache).view(-1, kv_heads, head_dim).index_select(0, slots)
    return rows.view(cache.dtype).to(dtype)


@dataclass
class StepMetadata:
    """Where one ragged step's tokens sit, host-side (numpy). Sequence b computes its tokens
    [seq_lens[b] - query_lens[b], seq_lens[b]), flat rows [qo_indptr[b], qo_indptr[b + 1])."""

    page_size: int
    #: [B] new tokens of each sequence (>= 1).
    query_lens: np.ndarray
    #: [B + 1] int32: flat row where each sequence's new tokens begin.
    qo_indptr: np.ndarray
    #: [B] int32: each sequence's length after this step.
    seq_lens: np.ndarray
    #: [B + 1] int32 and [pages] int32: each sequence's pages (compressed sparse rows).
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    #: [B] int32: rows used in each sequence's last page (1 .. page_size).
    kv_last_page_len: np.ndarray
    #: [T] int64: the position and the flat cache slot of every new token.
    positions: np.ndarray
    slot_mapping: np.ndarray

    @classmethod
    def build(cls, page_tables: Sequence[Sequence[int]], starts: Sequence[int], lengths: Sequence[int],
              page_size: int) -> "StepMetadata":
        """Sequence b holds pages ``page_tables[b]`` (at least enough for its new length) and
        computes ``lengths[b]`` tokens from position ``starts[b]``."""
        start = np.asarray(starts, dtype=np.int64)
        query_lens = np.asarray(lengths, dtype=np.int64)
        if query_lens.size == 0 or query_lens.min() < 1:
            raise ValueError("every sequence of a step computes at least one token")
        seq_lens = start + query_lens
        pages = -(-seq_lens // page_size)
        for table, need in zip(page_tables, pages.tolist()):
            if len(table) < need:
                raise RuntimeError(f"KV for {need * page_size} tokens not allocated (the sequence holds "
                                   f"{len(table)} pages of {page_size})")
        kv_indptr = np.zeros(len(pages) + 1, dtype=np.int64)
        np.cumsum(pages, out=kv_indptr[1:])
        kv_indices = np.fromiter(chain.from_iterable(table[:need] for table, need in zip(page_tables, pages.tolist())),
                                 dtype=np.int64, count=int(kv_indptr[-1]))
        if query_lens.max() == 1:  # a decode step: one token per sequence, at its start
            qo_indptr = np.arange(len(pages) + 1)
            sequence, positions = qo_indptr[:-1], start
        else:
            qo_indptr = np.zeros(len(pages) + 1, dtype=np.int64)
            np.cumsum(query_lens, out=qo_indptr[1:])
            sequence = np.repeat(np.arange(len(pages)), query_lens)
            positions = start[sequence] + np.arange(int(qo_indptr[-1])) - qo_indptr[sequence]
        slots = kv_indices[kv_indptr[sequence] + positions // page_size] * page_size + positions % page_size
        return cls(page_size=page_size, query_lens=query_lens.astype(np.int32), qo_indptr=qo_indptr.astype(np.int32),
                   seq_lens=seq_lens.astype(np.int32), kv_indptr=kv_indptr.astype(np.int32),
                   kv_indices=kv_indices.astype(np.int32),
                   kv_last_page_len=(seq_lens - (pages - 1) * page_size).astype(np.int32),
                   positions=positions, slot_mapping=slots)

    @classmethod
    def for_decode(cls, page_table: np.ndarray, page_counts: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                   page_size: int, *, padding: int = 0, padding_page: int = 0) -> "StepMetadata":
        """:meth:`build`'s metadata for a decode step (one token per sequence), from page tables kept
        as rows of one array: sequence b holds pages ``page_table[rows[b], :page_counts[rows[b]]]``
        and computes the token at ``starts[b]``; then ``padding`` sequences of one token at position 0
        of ``padding_page``. A few numpy gathers, whatever the batch (:meth:`build` walks each
        sequence's list)."""
        start = np.asarray(starts, dtype=np.int64)
        pages = start // page_size + 1
        held = page_counts[rows]
        short = np.flatnonzero(held < pages)
        if short.size:
            b = int(short[0])
            raise RuntimeError(f"KV for {int(pages[b]) * page_size} tokens not allocated (the sequence holds "
                               f"{int(held[b])} pages of {page_size})")
        width = int(pages.max()) if pages.size else 1
        table = page_table[rows, :width]
        if padding:
            start = np.concatenate([start, np.zeros(padding, dtype=np.int64)])
            pages = np.concatenate([pages, np.ones(padding, dtype=np.int64)])
            table = np.concatenate([table, np.full((padding, width), padding_page, dtype=table.dtype)])
        batch = len(start)
        if batch == 0:
            raise ValueError("every sequence of a step computes at least one token")
        kv_indptr = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(pages, out=kv_indptr[1:])
        kv_indices = table[np.arange(width)[None, :] < pages[:, None]]
        seq_lens = start + 1
        slots = table[np.arange(batch), start // page_size] * page_size + start % page_size
        qo_indptr = np.arange(batch + 1, dtype=np.int32)
        return cls(page_size=page_size, query_lens=np.ones(batch, dtype=np.int32), qo_indptr=qo_indptr,
                   seq_lens=seq_lens.astype(np.int32), kv_indptr=kv_indptr.astype(np.int32),
                   kv_indices=kv_indices.astype(np.int32),
                   kv_last_page_len=(seq_lens - (pages - 1) * page_size).astype(np.int32),
                   positions=start, slot_mapping=slots.astype(np.int64))

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def read_sequence_kv(cache: torch.Tensor, metadata: StepMetadata, sequence: int) -> torch.Tensor:
    """Sequence ``sequence``'s keys (or values) from ``cache``, contiguous: [seq_len, kv_heads, head_dim]."""
    begin, end = int(metadata.kv_indptr[sequence]), int(metadata.kv_indptr[sequence + 1])
    page = metadata.page_size
    pages = metadata.kv_indices[begin:end].astype(np.int64)
    slots = (pages[:, None] * page + np.arange(page)[None, :]).reshape(-1)[: int(metadata.seq_lens[sequence])]
    return gather_slots(cache, torch.from_numpy(slots).to(cache.device), cache.dtype)


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              metadata: StepMetadata, scale: float | None = None,
                              window: int | None = None) -> torch.Tensor:
    """Causal attention of a ragged step read from the metadata's page lists one sequence at a time
    (slow; the check for the metadata builder and for every backend). query: [T, heads, head_dim];
    ``window``: a sliding window (each query sees the ``window`` positions ending at its own)."""
    outputs = []
    for b in range(metadata.batch_size):
        rows = slice(int(metadata.qo_indptr[b]), int(metadata.qo_indptr[b + 1]))
        keys = read_sequence_kv(key_cache, metadata, b).to(query.dtype)
        values = read_sequence_kv(value_cache, metadata, b).to(query.dtype)  # fp8 caches: read widened
        outputs.append(causal_attention_reference(query[rows], keys, values, scale=scale, window=window))
    return torch.cat(outputs)

"""Paged KV cache bookkeeping without torch: which blocks each sequence holds, and the prefix cache.

A sequence's token ``t`` lives in block ``table[t // block_size]`` at offset ``t % block_size``.

Lifecycle of a sequence (the names follow the seed pages):

- ``claim(seq_id, tokens)``: register it; with prefix caching, full blocks of ``tokens`` that another
  sequence already computed are attached (shared, read-only) and their count is returned.
- ``alloc(seq_id, total_tokens)``: make room for the KV of its first ``total_tokens`` tokens.
- ``step(seq_id, tokens)``: the KV of ``tokens`` (the sequence's tokens so far) is now written; the
  blocks they fill become reusable by later sequences with the same prefix.
- ``release(seq_id)``: drop its blocks. Blocks that hold a complete, hashed prefix stay cached
  (evictable, least recently used first) until another allocation needs the space.

Only whole blocks are shared, and a sequence never writes into a block it did not allocate, so a
shared block is never modified.

A model with a sliding attention window (``window``: each query sees the ``window`` positions
ending at its own) never reads a block again once the positions after the sequence's written ones
see none of it: such blocks go back to the pool as they fall behind, their places in the sequence's
table kept (positions still index it) but holding ``HOLE``, which no attention reads. So a long
sequence holds about a window's worth of blocks, not its whole length.

The cache may start smaller than it may become (``max_num_blocks``): when an allocation, or an
admission within a watermark, needs more blocks than there are, ``grow(total)`` (the cache's owner:
it enlarges its tensors, keeping every block's contents) is asked for about twice as many, up to
``max_num_blocks``, and the new blocks join the free list. So a server holds the memory its
streams use, not the most it could ever use.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import numpy as np


#: What a dropped block's place in a table holds (never read: see the module docstring).
HOLE = 0


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks for an allocation."""


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    #: Tokens whose keys and values are written (committed by step()).
    num_tokens: int = 0
    #: Prefix-cache key of each full, committed block, in order.
    keys: list[Hashable] = field(default_factory=list)
    #: Its row of the page table (BlockManager.page_table).
    row: int = -1
    #: Leading blocks dropped behind a sliding window (their places hold HOLE).
    dropped: int = 0


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found there."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Allocates fixed-size KV blocks to sequences; shares full prompt blocks between sequences."""

    def __init__(self, total_num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 max_num_blocks: int | None = None, grow: Callable[[int], int] | None = None,
                 window: int | None = None):
        if total_num_blocks < 1:
            raise ValueError(f"total_num_blocks must be at least 1, got {total_num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.total_num_blocks = total_num_blocks
        #: The most blocks the cache may grow to (``grow`` makes room for them); the start size
        #: where it may not grow.
        self.max_num_blocks = max(total_num_blocks, max_num_blocks or total_num_blocks)
        self.grow = grow
        self.block_size = block_size
        #: The model's sliding attention window (None: every query sees every position before it).
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(total_num_blocks))
        self._ref_counts = [0] * total_num_blocks
        #: Prefix key -> block holding it; and the reverse.
        self._cached: dict[Hashable, int] = {}
        self._block_key: dict[int, Hashable] = {}
        #: Cached blocks no sequence holds, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._sequences: dict[str, _Sequence] = {}
        self.prefix_stats = PrefixCacheStats()
        #: Every sequence's blocks as a row of one array (``page_counts``: how many of the row are
        #: its), kept beside the lists: a decode step's attention metadata gathers its rows' pages
        #: with a few numpy operations instead of flattening hundreds of lists.
        self.page_table = np.zeros((16, 8), dtype=np.int64)
        self.page_counts = np.zeros(16, dtype=np.int64)
        self._free_rows = list(range(15, -1, -1))

    # --- facts -----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (never used, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.total_num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a reusable prefix (held or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.total_num_blocks

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    @property
    def sequences(self) -> list[str]:
        return list(self._sequences)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._sequences[seq_id].blocks)

    def block_tables(self, seq_ids: Sequence[str]) -> list[list[int]]:
        """The block tables of ``seq_ids`` themselves, not copies (a step's metadata reads them at
        once; copying each row's cost a fifth of building it at 256 rows): read them, never change them."""
        sequences = self._sequences
        return [sequences[seq_id].blocks for seq_id in seq_ids]

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of ``seq_id`` whose KV is written (including attached prefix blocks)."""
        return self._sequences[seq_id].num_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held_tokens(self, length: int) -> int:
        """The most tokens' room a sequence of ``length`` tokens holds at once: all of them, or
        behind a sliding window the window and the blocks its two ends may part-fill."""
        if self.window is None:
            return length
        return min(length, self.window + 2 * self.block_size)

    # --- lifecycle -------------------------------------------------------------------------------

    def claim(self, seq_id: str, tokens: Sequence[int] = ()) -> int:
        """Registers ``seq_id``; returns how many leading ``tokens`` are already cached.

        At least the last token is always left uncached, so the model computes the logits that
        follow the prompt.
        """
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already claimed")
        sequence = _Sequence(row=self._take_row())
        self._sequences[seq_id] = sequence
        if not self.enable_prefix_caching or not tokens:
            return 0
        reusable_blocks = (len(tokens) - 1) // self.block_size
        self.prefix_stats.queried_tokens += len(tokens)
        parent: Hashable = None
        for index in range(reusable_blocks):
            key = self._key(parent, tokens[index * self.block_size:(index + 1) * self.block_size])
            block = self._cached.get(key)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            sequence.blocks.append(block)
            sequence.keys.append(key)
            parent = key
        sequence.num_tokens = len(sequence.blocks) * self.block_size
        self._write_pages(sequence, 0)
        self.prefix_stats.hit_tokens += sequence.num_tokens
        return sequence.num_tokens

    def holds(self, seq_id: str, total_tokens: int) -> bool:
        """Whether ``seq_id``'s blocks already cover ``total_tokens`` tokens (a decode step's usual
        case, checked for hundreds of rows a step: nothing to take, so can_alloc and alloc are moot)."""
        sequence = self._sequences.get(seq_id)
        return sequence is not None and len(sequence.blocks) * self.block_size >= total_tokens

    def can_alloc(self, seq_id: str | None, total_tokens: int, *, watermark: float = 1.0) -> bool:
        """Whether ``alloc(seq_id, total_tokens)`` would succeed and keep usage within ``watermark``."""
        held = len(self._sequences[seq_id].blocks) if seq_id is not None and seq_id in self._sequences else 0
        needed = max(0, self.blocks_for(total_tokens) - held)
        if needed == 0 and watermark >= 1.0:
            return True  # nothing to take, and usage never exceeds the whole cache (the decode passes' case)
        self._make_room(needed, watermark)
        if needed > self.num_free_blocks:
            return False
        return self.num_used_blocks + needed <= watermark * self.total_num_blocks

    def alloc(self, seq_id: str, total_tokens: int) -> None:
        """Grows ``seq_id``'s block table to hold ``total_tokens`` tokens; KVCacheFull if it cannot."""
        sequence = self._sequences[seq_id]
        needed = self.blocks_for(total_tokens) - len(sequence.blocks)
        if needed <= 0:
            return
        self._make_room(needed)
        if needed > self.num_free_blocks:
            raise KVCacheFull(f"sequence {seq_id!r} needs {needed} more KV blocks, {self.num_free_blocks} free")
        held = len(sequence.blocks)
        for _ in range(needed):
            sequence.blocks.append(self._take_block())
        self._write_pages(sequence, held)

    def step(self, seq_id: str, tokens: Sequence[int]) -> None:
        """Records that the KV of ``tokens`` (the sequence's first len(tokens) tokens) is written."""
        sequence = self._sequences.get(seq_id)
        if sequence is None:  # released while its last batch was in flight
            return
        self._written(seq_id, sequence, len(tokens))
        if not self.enable_prefix_caching:
            return
        full = len(tokens) // self.block_size
        parent = sequence.keys[-1] if sequence.keys else None
        for index in range(len(sequence.keys), full):
            key = self._key(parent, tokens[index * self.block_size:(index + 1) * self.block_size])
            block = sequence.blocks[index]
            if index >= sequence.dropped and key not in self._cached and block not in self._block_key:
                self._cached[key] = block
                self._block_key[block] = key
            sequence.keys.append(key)
            parent = key

    def commit(self, seq_id: str, count: int, tokens: Callable[[Any], Sequence[int]], owner: Any) -> None:
        """``step`` for a sequence whose first ``count`` tokens are written, with ``tokens(owner)``
        asked for them only where a block filled (the prefix cache keys full blocks): a decode step
        fills one in a page's worth of rows, and at hundreds of rows a step building every row's
        tokens was most of the update's time."""
        sequence = self._sequences.get(seq_id)
        if sequence is None:  # released while its last batch was in flight
            return
        if self.enable_prefix_caching and count // self.block_size > len(sequence.keys):
            self.step(seq_id, tokens(owner))
            return
        self._written(seq_id, sequence, count)

    def commit_all(self, owners: Sequence[Any], tokens: Callable[[Any], Sequence[int]]) -> None:
        """:meth:`commit` of each owner's sequence (``owner.request_id``) with its ``owner.processed``
        tokens written: one call for a step's rows, the common case (no block filled) without a
        call per row."""
        sequences, size = self._sequences, self.block_size
        prefix = self.enable_prefix_caching
        for owner in owners:
            seq_id, count = owner.request_id, owner.processed
            sequence = sequences.get(seq_id)
            if sequence is None:  # released while its last batch was in flight
                continue
            if prefix and count // size > len(sequence.keys):
                self.step(seq_id, tokens(owner))
            elif count > len(sequence.blocks) * size:
                self._written(seq_id, sequence, count)  # refused there
            elif count > sequence.num_tokens:
                sequence.num_tokens = count
                if self.window is not None and (count + 1 - self.window) // size > sequence.dropped:
                    self._drop_behind(sequence)

    def holds_all(self, seq_ids: Sequence[str], totals: Sequence[int]) -> list[bool]:
        """:meth:`holds` of each sequence (False for one not claimed), from the page table at once."""
        sequences = self._sequences
        rows = [sequences[seq_id].row if seq_id in sequences else -1 for seq_id in seq_ids]
        if not rows:
            return []
        index = np.array(rows, dtype=np.int64)
        held = self.page_counts[index] * self.block_size >= np.asarray(totals, dtype=np.int64)
        return (held & (index >= 0)).tolist()

    def _written(self, seq_id: str, sequence: _Sequence, count: int) -> None:
        """Records ``count`` tokens of ``sequence`` written (refused beyond its blocks)."""
        if count > len(sequence.blocks) * self.block_size:
            raise ValueError(f"sequence {seq_id!r}: {count} tokens committed but only "
                             f"{len(sequence.blocks)} blocks allocated")
        sequence.num_tokens = max(sequence.num_tokens, count)
        if self.window is not None:
            self._drop_behind(sequence)

    def _drop_behind(self, sequence: _Sequence) -> None:
        """Returns the blocks no query at or after the sequence's next position sees (every position
        of theirs before ``num_tokens + 1 - window``) to the pool; their places hold HOLE."""
        behind = min(len(sequence.blocks), max(0, sequence.num_tokens + 1 - self.window) // self.block_size)
        for index in range(sequence.dropped, behind):
            self._let_go(sequence.blocks[index])
            sequence.blocks[index] = HOLE
        if behind > sequence.dropped:
            self.page_table[sequence.row, sequence.dropped:behind] = HOLE
            sequence.dropped = behind

    def _let_go(self, block: int) -> None:
        """One holder less for ``block``: with none left it is free (or, holding a cached prefix,
        evictable)."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] > 0:
            return
        if block in self._block_key:
            self._evictable[block] = None
            self._evictable.move_to_end(block)
        else:
            self._free.append(block)

    def release(self, seq_id: str) -> None:
        """Frees what ``seq_id`` holds (no error if it holds nothing)."""
        sequence = self._sequences.pop(seq_id, None)
        if sequence is None:
            return
        self.page_counts[sequence.row] = 0
        self._free_rows.append(sequence.row)
        for block in reversed(sequence.blocks[sequence.dropped:]):  # the deepest block is evicted first
            self._let_go(block)

    # --- internals -------------------------------------------------------------------------------

    def _make_room(self, needed: int, watermark: float = 1.0) -> None:
        """Grows the cache where ``needed`` more blocks would not fit within ``watermark`` of it and
        it may grow: to twice its size, or what they need, up to max_num_blocks."""
        if self.grow is None or self.total_num_blocks >= self.max_num_blocks:
            return  # a fixed cache (CUDA's, or one at its most): nothing to do on every allocation
        used = self.num_used_blocks
        if needed <= self.num_free_blocks and used + needed <= watermark * self.total_num_blocks:
            return
        wanted = max(2 * self.total_num_blocks, math.ceil((used + needed) / watermark))
        target = self.grow(int(min(self.max_num_blocks, wanted)))
        if target > self.total_num_blocks:
            self._free.extend(range(self.total_num_blocks, target))
            self._ref_counts.extend([0] * (target - self.total_num_blocks))
            self.total_num_blocks = target

    def page_rows(self, seq_ids: Sequence[str]) -> np.ndarray:
        """The page-table rows of ``seq_ids``."""
        sequences = self._sequences
        return np.array([sequences[seq_id].row for seq_id in seq_ids], dtype=np.int64)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = len(self.page_counts)
            self.page_table = np.concatenate([self.page_table, np.zeros_like(self.page_table)])
            self.page_counts = np.concatenate([self.page_counts, np.zeros_like(self.page_counts)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _write_pages(self, sequence: _Sequence, first: int) -> None:
        """The sequence's blocks from index ``first`` on into its page-table row."""
        count = len(sequence.blocks)
        width = self.page_table.shape[1]
        if count > width:
            wider = np.zeros((len(self.page_table), max(count, 2 * width)), dtype=np.int64)
            wider[:, :width] = self.page_table
            self.page_table = wider
        self.page_table[sequence.row, first:count] = sequence.blocks[first:]
        self.page_counts[sequence.row] = count

    @staticmethod
    def _key(parent: Hashable, tokens: Sequence[int]) -> Hashable:
        # The parent key is hashed, the block's own tokens compared exactly.
        return (hash(parent), tuple(tokens))

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_key.pop(block)]
        self._ref_counts[block] = 1
        return block

"""The persistent decode batch: the scheduler's running requests while every one of them decodes
one token a pass, described by arrays instead of a scheduled item per row and pass.

A decode pass of hundreds of rows used to cost the host several microseconds a row in Python: the
scheduler walked every request to find the decode rows, checked each one's pages, advanced its
positions and built its item; the model runner looked up each request's row-table slot and page
row; the update decremented each request's in-flight count and committed each one's KV. While
nothing about the batch changes (no request joins, leaves, stops or is preempted), all of that is
the same from pass to pass but for positions that each grow by one. So once the scheduler makes
such a pass the usual way, it adopts the batch: the rows, in that pass's order, their request ids,
page-table rows (and, once the runner asks, row-table slots), and as arrays each row's next
position, the length it may not reach, and how many of the batch's rounds are in flight. A pass
then is a few array operations: every row still below its length, pages where a row crosses into a
new one (Python only for those rows), positions advanced by one; a multi-step round of several
passes, the same with each pass's positions one further.

The rows' scheduler entries are not written while the batch holds them, nor the requests'
``processed`` but where a page fills (the prefix cache commits it): the arrays are what is true.
:meth:`dissolve` writes them back (positions, processed counts, and the batch's rounds in flight
added to each entry's own count) whenever anything but a steady round or its update touches the
rows: a request that may join arrives, a row ends, is cancelled or removed, reaches its max length
or finds no free page. Passes of a dissolved batch still in flight are then applied the usual way,
row by row.

Torch-free, like the scheduler.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np


class SteadyBatch:
    """The persistent batch (see the module docstring): ``entries`` are the scheduler's entries of
    the rows, in order."""

    def __init__(self, entries: Sequence[Any], membership: int, page_rows: np.ndarray,
                 make_item: Callable[..., Any]):
        self.entries = list(entries)
        self.requests = [entry.request for entry in self.entries]
        self.request_ids = [request.request_id for request in self.requests]
        #: Each request's list of generated tokens (the update appends to them).
        self.generated = [request.generated for request in self.requests]
        #: Tokens each row has in the cache after the batch's latest pass applied (-1: none yet):
        #: the requests' ``processed``, written to them where a page fills and when dissolved.
        self.applied = np.full(len(self.entries), -1, dtype=np.int64)
        #: The position each row computes next.
        self.next = np.array([entry.next_pos for entry in self.entries], dtype=np.int64)
        #: Each row's max_length: a row decodes while the length it will know stays below it.
        self.max_length = np.array([entry.max_length for entry in self.entries], dtype=np.int64)
        #: The block manager's page-table row of each request (fixed while it holds blocks).
        self.page_rows = page_rows
        #: The scheduler's membership count when adopted: a change means the rows are not all there.
        self.membership = membership
        #: This batch's rounds launched and not yet applied (the entries' own counts exclude them).
        self.launched = 0
        #: False once dissolved: the entries are true again, and its passes in flight apply row by row.
        self.live = True
        #: The model runner's row-table slots of the rows and their unchanging columns
        #: (row_table.SlotColumns), filled at its first staging.
        self.slots: np.ndarray | None = None
        self.columns: Any = None
        self._make_item = make_item

    def __len__(self) -> int:
        return len(self.entries)

    def reserve(self, blocks: Any, planned: int) -> int:
        """Readies the rows for a round of up to ``planned`` passes, as the scheduler's usual round
        does: every row must still be below its max_length once it samples (else 0: the usual
        round ends it), and gets the pages ``planned`` passes need (within its max_length; else 0:
        a row crossing into a new page finds no free block, and the usual round preempts).
        Returns the most passes the rows' max_lengths allow. ``blocks``: the block manager."""
        following = self.next + 1  # what each row knows once it has sampled a pass
        if not (following < self.max_length).all():
            return 0
        need = np.minimum(self.next + planned, self.max_length)
        short = blocks.page_counts[self.page_rows] * blocks.block_size < need
        if short.any():  # a row in a page's worth, now and then
            for row in np.flatnonzero(short).tolist():
                request_id, tokens = self.request_ids[row], int(need[row])
                if not blocks.can_alloc(request_id, tokens):
                    return 0
                blocks.alloc(request_id, tokens)
        return int((self.max_length - self.next).min())

    def launch(self, passes: int) -> list["SteadyItems"]:
        """The items of a round of ``passes`` passes (each computes what the one before sampled)."""
        starts = self.next
        self.next = starts + passes
        self.launched += 1
        return [SteadyItems(self, starts + index if index else starts) for index in range(passes)]

    def dissolve(self) -> None:
        """Writes the rows' state back into their entries: from here on those are true."""
        if not self.live:
            return
        self.live = False
        for entry, position, applied in zip(self.entries, self.next.tolist(), self.applied.tolist()):
            entry.next_pos = position
            entry.expected_len = position + 1
            entry.in_flight += self.launched
            if applied >= 0:  # (else no pass of the batch applied: the passes before it wrote it)
                entry.request.processed = applied
        self.launched = 0


class SteadyItems(Sequence[Any]):
    """One steady pass's items: request i computes the one token at ``starts[i]`` and samples. The
    scheduled items themselves are made only where something reads them row by row."""

    __slots__ = ("batch", "starts", "_items")

    def __init__(self, batch: SteadyBatch, starts: np.ndarray):
        self.batch, self.starts = batch, starts
        self._items: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def rows(self) -> list[Any]:
        """The scheduled items, made once."""
        if self._items is None:
            make = self.batch._make_item
            self._items = [make(request, start, 1, True)
                           for request, start in zip(self.batch.requests, self.starts.tolist())]
        return self._items

    def __getitem__(self, index):
        return self.rows()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows())

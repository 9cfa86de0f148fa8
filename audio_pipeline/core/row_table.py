"""The row table: one slot per running request and fixed-size numpy columns of what its rows need
every step, written once, at the request's first step, and gathered by slot for each step.

Written once: the sampling settings, stop ids, min_tokens, the prompt's length, and what the
request's alignment fixes where it can be listed (a frame layout's one forced end of speech, and
the frame codes it fixes at each position). Changed as steps launch: the position of each
request's latest launched sample (the decode input a later step takes from the device, where the
model runner keeps each slot's latest sample), and each request's uniform draws.

A step's sampling rows (core/sampler.py's SamplingRows) come from the table by a few vectorised
gathers instead of reading every request row by row: at hundreds of rows a step those per-row reads
were most of the host's staging time. The uniform draws come from each request's own generator (so
a seed gives the same speech alone or batched), taken a block at a time into the slot's row and
handed out in order: every draw of a request on its rows goes through here, so the numbers are the
ones its generator gives one draw at a time. Python runs row by row only for what the table cannot
hold: alignments that force many positions (phoneme-lpc's tokens) and a slot whose draws ran out.

Torch-free; the model runner owns one and releases a request's slot with its other state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from audio_pipeline.core.sampler import FLOAT_FIELDS, NUCLEUS_PREFIX, SamplingRows

if TYPE_CHECKING:
    from audio_pipeline.core.request import TTSContext

#: The sampling settings a slot holds, in SamplingRows.floats' order (the uniform draw follows them).
SETTINGS = FLOAT_FIELDS[:6]
_UNIFORM = FLOAT_FIELDS.index("uniform")


class SlotColumns:
    """What the table holds for a list of slots that does not change while their requests run (their
    settings, stop ids, budgets, forced positions), gathered once: a step of the same rows as the
    one before it (the scheduler's persistent batch) reads these instead of gathering them again."""

    def __init__(self, table: "RowTable", slots: np.ndarray):
        self.counts = table.stop_count[slots]
        self.width = int(self.counts.max()) if len(slots) else 0
        self.extra_ids = table.stop_ids[slots, :self.width]
        self.min_tokens = table.min_tokens[slots]
        self.budget = table.budget[slots]
        self.prompt_len = table.prompt_len[slots]
        self.forced_at = table.forced_at[slots]
        self.forced_id = table.forced_id[slots]
        self.aligned_rows = np.flatnonzero(table.aligned[slots])
        # Rows the update may append as they are: no alignment, no listed forced position.
        self.unforced = ~table.aligned[slots] & (self.forced_at < 0)
        self.settings = np.ascontiguousarray(table.settings[slots].T)
        sampled = table.sampled[slots]
        self.sampling = np.flatnonzero(sampled)
        self.sampled_slots = slots[sampled]
        full = table.codebook + self.width
        limit = table.top_k[slots]
        self.top_k = np.where((limit > 0) & (limit < full), limit, full)
        sampled_top_k = self.top_k[sampled]
        self.flags = dict(any_sampling=bool(self.sampling.size), penalized=bool(table.penalized[slots].any()),
                          prefix_suffices=bool((sampled_top_k <= NUCLEUS_PREFIX).all()),
                          prefix_may_suffice=bool(((sampled_top_k <= NUCLEUS_PREFIX) | (sampled_top_k == full)).all()))


class RowTable:
    """Slots and columns for the running requests of one layout (see the module docstring)."""

    def __init__(self, layout: Any, capacity: int = 16):
        self.layout = layout
        self.codebook, self.frame = layout.codebook_size, layout.tokens_per_frame
        self.end_of_speech = layout.end_of_speech
        self.stops_by_token = bool(layout.stops_by_token)
        self.codes = layout.codes_per_token
        #: Draws a sampling row takes a step: the backbone's, then one per depth codebook.
        self.draws_per_row = layout.draws_per_position
        # A slot's draws come a block at a time (a call into its request's generator): for a token
        # layout 256 steps' worth, so that at hundreds of rows one row a step refills rather than a
        # handful. The generator's numbers do not depend on how many are taken at once.
        self.draw_block = max(256, 8 * self.draws_per_row)
        # A position's candidate range depends on its frame slot alone (its codebook).
        self.slot_starts = np.array([layout.token_range(slot)[0] for slot in range(self.frame)], dtype=np.int64)
        self._index: dict[str, int] = {}
        self._owner: list[Any] = []
        self._free: list[int] = []
        #: Slots written since :meth:`take_written` (their device state must start afresh).
        self._written: list[int] = []
        self.fixed = np.full((capacity, 1, self.codes), -1, dtype=np.int64)
        self._allocate(capacity, stop_width=1)

    def _allocate(self, capacity: int, stop_width: int) -> None:
        old = self._owner
        kept = len(old)
        columns = {
            "settings": np.zeros((capacity, len(SETTINGS)), dtype=np.float32),
            "top_k": np.zeros(capacity, dtype=np.int64),  # as set (0: unlimited)
            "stop_ids": np.full((capacity, stop_width), self.end_of_speech, dtype=np.int64),
            "stop_count": np.zeros(capacity, dtype=np.int64),
            "min_tokens": np.zeros(capacity, dtype=np.int64),
            "sampled": np.zeros(capacity, dtype=bool),  # temperature > 0
            "penalized": np.zeros(capacity, dtype=bool),
            # The request's alignment forces positions the table does not list (forced() row by row).
            "aligned": np.zeros(capacity, dtype=bool),
            # The one position its alignment forces, and the id (-1: none listed).
            "forced_at": np.full(capacity, -1, dtype=np.int64),
            "forced_id": np.zeros(capacity, dtype=np.int64),
            "prompt_len": np.zeros(capacity, dtype=np.int64),
            "budget": np.zeros(capacity, dtype=np.int64),  # the request's token_budget
            # Position (prompt included) of the request's latest launched sample (-1: none yet).
            "latest": np.full(capacity, -1, dtype=np.int64),
            # Positions whose frame codes ``fixed`` holds for the slot.
            "fixed_len": np.zeros(capacity, dtype=np.int64),
            "draws": np.zeros((capacity, self.draw_block), dtype=np.float32),
            "draw_next": np.full(capacity, self.draw_block, dtype=np.int64),
        }
        for name, column in columns.items():
            if kept:
                previous = getattr(self, name)
                if column.ndim == 2:
                    column[:kept, :previous.shape[1]] = previous
                else:
                    column[:kept] = previous
            setattr(self, name, column)
        if capacity > len(self.fixed):
            fixed = np.full((capacity, *self.fixed.shape[1:]), -1, dtype=np.int64)
            fixed[:len(self.fixed)] = self.fixed
            self.fixed = fixed
        self._owner = old + [None] * (capacity - kept)
        self._free.extend(range(capacity - 1, kept - 1, -1))

    def __len__(self) -> int:
        return len(self._index)

    @property
    def capacity(self) -> int:
        """Slots the columns hold (the model runner's device columns follow it)."""
        return len(self._owner)

    def slots(self, contexts: Sequence["TTSContext"]) -> np.ndarray:
        """Each request's slot, written at the request's first step (a request id that now names
        another request gets its slot written again)."""
        index, owner = self._index, self._owner
        found = []
        for context in contexts:
            slot = index.get(context.request_id)
            if slot is None or owner[slot] is not context:
                slot = self._write(context, slot)
            found.append(slot)
        return np.array(found, dtype=np.int64)

    def slot_of(self, request_id: str) -> int | None:
        """The slot of a request written already (None: none)."""
        return self._index.get(request_id)

    def take_written(self) -> list[int]:
        """The slots written since the last call."""
        written, self._written = self._written, []
        return written

    def release(self, request_id: str) -> None:
        slot = self._index.pop(request_id, None)
        if slot is not None:
            unused = self.draws[slot, self.draw_next[slot]:]
            if unused.size:  # back to the request, whose next draws they are
                self._owner[slot].give_back_uniforms(unused.tolist())
            self._owner[slot] = None
            self._free.append(slot)

    def _write(self, context: "TTSContext", slot: int | None) -> int:
        if slot is None:
            if not self._free:
                self._allocate(2 * len(self._owner), self.stop_ids.shape[1])
            slot = self._free.pop()
        stops = context.stop_ids
        if len(stops) > self.stop_ids.shape[1]:
            self._allocate(len(self._owner), len(stops))
        params = context.sampling
        self.settings[slot] = [getattr(params, name) for name in SETTINGS]
        self.top_k[slot] = params.top_k
        self.stop_ids[slot] = self.end_of_speech
        self.stop_ids[slot, :len(stops)] = stops
        self.stop_count[slot] = len(stops)
        self.min_tokens[slot] = params.min_tokens
        self.sampled[slot] = params.temperature > 0
        self.penalized[slot] = (params.repetition_penalty != 1 or bool(params.frequency_penalty)
                                or bool(params.presence_penalty))
        self.prompt_len[slot] = len(context.prompt_ids)
        self.budget[slot] = context.token_budget
        self.latest[slot] = -1
        self.draw_next[slot] = self.draw_block  # empty: the first draw takes a block
        self._write_alignment(slot, context.alignment)
        self._index[context.request_id] = slot
        self._owner[slot] = context
        self._written.append(slot)
        return slot

    def _write_alignment(self, slot: int, alignment: Any) -> None:
        lone = alignment.lone_forced() if alignment is not None else None
        self.aligned[slot] = alignment is not None and lone is None
        self.forced_at[slot], self.forced_id[slot] = lone if lone is not None else (-1, 0)
        table = alignment.frame_code_table() if alignment is not None and self.codes > 1 else None
        self.fixed_len[slot] = 0 if table is None else len(table)
        if table is not None:
            if len(table) > self.fixed.shape[1]:
                wider = np.full((len(self.fixed), max(len(table), 2 * self.fixed.shape[1]), self.codes), -1,
                                dtype=np.int64)
                wider[:, :self.fixed.shape[1]] = self.fixed
                self.fixed = wider
            self.fixed[slot, :len(table)] = table

    def columns(self, slots: np.ndarray) -> SlotColumns:
        """The unchanging columns of ``slots`` (:class:`SlotColumns`), gathered now."""
        return SlotColumns(self, slots)

    def stop_width(self, slots: np.ndarray) -> int:
        """Stop-id columns of a step of these slots' rows: the most stop ids any of them has."""
        return int(self.stop_count[slots].max())

    def draw(self, slots: np.ndarray, count: int) -> np.ndarray:
        """[len(slots), count] the next ``count`` uniform draws of each slot's request, in its
        generator's order (a slot appears once)."""
        block = self.draw_block
        start = self.draw_next[slots]
        for row in np.flatnonzero(start + count > block).tolist():  # a block's worth, now and then
            slot = int(slots[row])
            rest = self.draws[slot, self.draw_next[slot]:].copy()
            self.draws[slot, :len(rest)] = rest
            self.draws[slot, len(rest):] = self._owner[slot].uniforms(block - len(rest))
            self.draw_next[slot] = 0
            start[row] = 0
        picked = self.draws[slots[:, None], start[:, None] + np.arange(count)]
        self.draw_next[slots] = start + count
        return picked

    def plain_samples(self, slots: np.ndarray, positions: np.ndarray, ids: np.ndarray,
                      columns: SlotColumns | None = None) -> np.ndarray:
        """Per row, whether sampled id ``ids[i]`` at generated position ``positions[i]`` of a
        token layout (one code a position) is one the request appends as it is (TTSContext's
        append_sample, checked for all rows at once): a code of its position's codebook, no stop
        where the speech may end, not the last of the token budget, and no alignment of the
        request's. The rest are appended one by one, with those checks."""
        if columns is None:
            columns = self.columns(slots)
        frame_slots = positions % self.frame
        code = ids - self.slot_starts[frame_slots]
        plain = (code >= 0) & (code < self.codebook) & (positions + 1 < columns.budget)
        plain &= columns.unforced
        if self.stops_by_token:
            may_stop = (frame_slots == 0) & (positions > 0) & (positions >= columns.min_tokens)
            stop = (ids == self.end_of_speech) | (may_stop & (columns.extra_ids == ids[:, None]).any(axis=1))
            plain &= ~stop
        return plain

    def frame_codes(self, slots: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """Into ``out`` ([B, codes]): the frame codes each row's alignment fixes at its generated
        position (-1 where none)."""
        within = positions < self.fixed_len[slots]
        out[...] = -1
        if within.any():
            rows = np.flatnonzero(within)
            out[rows] = self.fixed[slots[rows], positions[rows]]

    def sampling_rows(self, contexts: Sequence["TTSContext"], positions: Sequence[int], *,
                      draw: bool = True, slots: np.ndarray | None = None,
                      out: dict[str, np.ndarray] | None = None, draws: np.ndarray | None = None,
                      columns: SlotColumns | None = None) -> SamplingRows:
        """Row i samples generated position ``positions[i]`` of ``contexts[i]``: the same rows
        SamplingRows.build makes from the requests one by one. With ``out`` (a step's staged host
        arrays, shaped for :meth:`stop_width`'s width) the rows' arrays are written there, and the
        rows are views of them: no array of the step is made twice. ``draws``: the sampling rows'
        draws taken already (:meth:`draw`; the first column is the backbone's), else one each is
        taken here where ``draw``. ``columns``: the slots' :meth:`columns`, where the caller keeps them."""
        if slots is None:
            slots = self.slots(contexts)
        if columns is None:
            columns = self.columns(slots)
        codebook = self.codebook
        batch = len(slots)
        position = np.asarray(positions, dtype=np.int64)
        frame_slots = position % self.frame
        width = columns.width
        if out is None:
            out = {"starts": np.empty(batch, dtype=np.int64), "extra_ids": np.empty((batch, width), dtype=np.int64),
                   "blocked": np.empty((batch, codebook + width), dtype=bool),
                   "floats": np.empty((len(FLOAT_FIELDS), batch), dtype=np.float32),
                   "top_k": np.empty(batch, dtype=np.int64)}
        starts, extra_ids, blocked, floats, top_k = (out[name] for name in ("starts", "extra_ids", "blocked",
                                                                             "floats", "top_k"))
        np.take(self.slot_starts, frame_slots, out=starts)
        extra_ids[...] = columns.extra_ids
        # Stop ids may be chosen only where the speech may end (request.py's may_stop); the padding never.
        if self.stops_by_token:
            may_stop = (frame_slots == 0) & (position > 0) & (position >= columns.min_tokens)
            allowed = np.where(may_stop, columns.counts, 0)
        else:
            allowed = np.zeros(batch, dtype=np.int64)
        blocked[:, :codebook] = False
        blocked[:, codebook:] = np.arange(width)[None, :] >= allowed[:, None]
        floats[:len(SETTINGS)] = columns.settings
        floats[len(SETTINGS):] = 0.0
        top_k[...] = columns.top_k
        sampling = columns.sampling
        if sampling.size and (draws is not None or draw):  # from each request's own generator: nothing read back
            floats[_UNIFORM, sampling] = (draws if draws is not None else self.draw(columns.sampled_slots, 1))[:, 0]
        built = SamplingRows(codebook, starts, extra_ids, blocked, floats, top_k, frame_slots, **columns.flags)
        # A forced row allows its forced id alone: the one listed position of a frame alignment...
        lone = np.flatnonzero(columns.forced_at == position)
        if lone.size:
            blocked[lone] = built.candidate_ids(lone) != columns.forced_id[lone, None]
        aligned = columns.aligned_rows
        if aligned.size:  # ...and the positions of other alignments, asked row by row
            forced = [(row, fixed) for row in aligned.tolist()
                      if (fixed := contexts[row].alignment.forced(int(position[row]))) is not None]
            if forced:
                rows = np.array([row for row, _ in forced], dtype=np.int64)
                ids = np.array([fixed for _, fixed in forced], dtype=np.int64)
                blocked[rows] = built.candidate_ids(rows) != ids[:, None]
        return built

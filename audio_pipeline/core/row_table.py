"""The row table: one slot per running request and fixed-size numpy columns of what its rows need
every step but that changes only when the request starts (its sampling settings, stop ids,
min_tokens), written once, at the request's first step, and gathered by slot for each step.

A step's sampling rows (core/sampler.py's SamplingRows) come from the table by a few vectorised
gathers instead of reading every request's settings row by row: at hundreds of rows a step those
per-row reads were most of the host's staging time. What does change every step stays per row
where it must: each sampling row's uniform draw comes from its request's own generator (so a seed
gives the same speech alone or batched), and rows of layouts with an alignment (forced tokens)
ask it for their position.

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


class RowTable:
    """Slots and columns for the running requests of one layout (see the module docstring)."""

    def __init__(self, layout: Any, capacity: int = 16):
        self.layout = layout
        self.codebook, self.frame = layout.codebook_size, layout.tokens_per_frame
        self.end_of_speech = layout.end_of_speech
        self.stops_by_token = bool(layout.stops_by_token)
        # A position's candidate range depends on its frame slot alone (its codebook).
        self.slot_starts = np.array([layout.token_range(slot)[0] for slot in range(self.frame)], dtype=np.int64)
        self._index: dict[str, int] = {}
        self._owner: list[Any] = []
        self._free: list[int] = []
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
            "aligned": np.zeros(capacity, dtype=bool),  # the request's layout forces tokens somewhere
        }
        for name, column in columns.items():
            if kept:
                previous = getattr(self, name)
                if column.ndim == 2:
                    column[:kept, :previous.shape[1]] = previous
                else:
                    column[:kept] = previous
            setattr(self, name, column)
        self._owner = old + [None] * (capacity - kept)
        self._free.extend(range(capacity - 1, kept - 1, -1))

    def __len__(self) -> int:
        return len(self._index)

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

    def release(self, request_id: str) -> None:
        slot = self._index.pop(request_id, None)
        if slot is not None:
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
        self.aligned[slot] = context.alignment is not None
        self._index[context.request_id] = slot
        self._owner[slot] = context
        return slot

    def stop_width(self, slots: np.ndarray) -> int:
        """Stop-id columns of a step of these slots' rows: the most stop ids any of them has."""
        return int(self.stop_count[slots].max())

    def sampling_rows(self, contexts: Sequence["TTSContext"], positions: Sequence[int], *,
                      draw: bool = True, slots: np.ndarray | None = None,
                      out: dict[str, np.ndarray] | None = None) -> SamplingRows:
        """Row i samples generated position ``positions[i]`` of ``contexts[i]``: the same rows
        SamplingRows.build makes from the requests one by one. With ``out`` (a step's staged host
        arrays, shaped for :meth:`stop_width`'s width) the rows' arrays are written there, and the
        rows are views of them: no array of the step is made twice."""
        if slots is None:
            slots = self.slots(contexts)
        codebook = self.codebook
        batch = len(contexts)
        position = np.asarray(positions, dtype=np.int64)
        frame_slots = position % self.frame
        counts = self.stop_count[slots]
        width = int(counts.max())
        if out is None:
            out = {"starts": np.empty(batch, dtype=np.int64), "extra_ids": np.empty((batch, width), dtype=np.int64),
                   "blocked": np.empty((batch, codebook + width), dtype=bool),
                   "floats": np.empty((len(FLOAT_FIELDS), batch), dtype=np.float32),
                   "top_k": np.empty(batch, dtype=np.int64)}
        starts, extra_ids, blocked, floats, top_k = (out[name] for name in ("starts", "extra_ids", "blocked",
                                                                             "floats", "top_k"))
        np.take(self.slot_starts, frame_slots, out=starts)
        extra_ids[...] = self.stop_ids[slots, :width]
        # Stop ids may be chosen only where the speech may end (request.py's may_stop); the padding never.
        if self.stops_by_token:
            may_stop = (frame_slots == 0) & (position > 0) & (position >= self.min_tokens[slots])
            allowed = np.where(may_stop, counts, 0)
        else:
            allowed = np.zeros(batch, dtype=np.int64)
        blocked[:, :codebook] = False
        blocked[:, codebook:] = np.arange(width)[None, :] >= allowed[:, None]
        floats[:len(SETTINGS)] = self.settings[slots].T
        floats[len(SETTINGS):] = 0.0
        limit = self.top_k[slots]
        top_k[...] = np.where((limit > 0) & (limit < codebook + width), limit, codebook + width)
        sampled = self.sampled[slots]
        sampling = np.flatnonzero(sampled).tolist()
        if draw and sampling:  # each row's from its request's own generator, on the host: nothing read back
            floats[_UNIFORM, sampling] = [contexts[row].uniforms(1)[0] for row in sampling]
        sampled_top_k = top_k[sampled]
        flags = dict(any_sampling=bool(sampling), penalized=bool(self.penalized[slots].any()),
                     prefix_suffices=bool((sampled_top_k <= NUCLEUS_PREFIX).all()),
                     prefix_may_suffice=bool(((sampled_top_k <= NUCLEUS_PREFIX)
                                              | (sampled_top_k == codebook + width)).all()))
        built = SamplingRows(codebook, starts, extra_ids, blocked, floats, top_k, frame_slots, **flags)
        aligned = np.flatnonzero(self.aligned[slots])
        if aligned.size:  # a forced row allows its forced id alone
            forced = [(row, fixed) for row in aligned.tolist()
                      if (fixed := contexts[row].alignment.forced(int(position[row]))) is not None]
            if forced:
                rows = np.array([row for row, _ in forced], dtype=np.int64)
                ids = np.array([fixed for _, fixed in forced], dtype=np.int64)
                blocked[rows] = built.candidate_ids(rows) != ids[:, None]
        return built

"""AudioGenerationScheduler: decides, step by step, which requests prefill (CE) and which decode (TG).

Torch-free. It owns the request queue and the admission to the paged KV cache (through the
:class:`~audio_pipeline.core.kv_cache.BlockManager`), and hands the engine core a list of
``(request, start, num_tokens)`` items per step. The knobs, all from the configuration:

- ``max_batch_size``: most requests in one step.
- ``max_queue_size_tg``: most requests admitted (holding KV blocks, in decode) at once; default
  ``max_batch_size``. When larger, decode batches rotate over the admitted requests.
- ``min_batch_size_tg``: soft floor on the decode batch. While fewer requests decode, waiting
  prompts are prefilled first; at or above it, decoding goes on and prompts wait. Default: the
  admission limit, i.e. prefill whenever a prompt waits and there is room.
- ``max_batch_input_tokens``: most tokens computed in one step (prompt tokens plus decode tokens).
- ``ce_delay_ms``: a new prompt waits up to this long for others to join its prefill batch
  (decoding goes on meanwhile); a full batch of prompts starts at once.
- ``enable_prioritize_first_decode``: after a prefill batch, the next step is a decode step, so
  new requests get their first tokens (and first audio) sooner.
- ``enable_chunked_prefill``: a prompt longer than the step's remaining token budget is split
  across steps; when off, a prompt only goes into a step whose budget holds all of it.
- ``enable_in_flight_batching``: prefill chunks ride along in decode steps (one mixed batch) instead
  of alternating prefill and decode steps.
- ``max_num_steps``: decode steps per scheduling round (multi-step); -1 lets the scheduler choose
  (4 when no prompt waits, else 1).
- ``kvcache_ce_watermark``: a prompt is admitted only while the projected KV usage, with its whole
  prompt allocated, stays within this fraction of the cache.
- ``deadline_scheduling``: steps are ordered and sized by the streams' playback deadlines (below).

Deadlines. The engine gives each running request a ``deadline`` (when its listener runs out of
audio, or for one not heard yet its arrival plus the first-audio target; None where an earlier
request of its stream still speaks) and ``passes_to_chunk`` (decode passes until its next audio
chunk is due), and the scheduler learns what steps cost (:class:`~audio_pipeline.core.deadlines.StepCosts`).
A row's *slack* is its deadline less now, less the passes its next chunk needs, less
``deadline_margin_ms``. With deadline scheduling:

- decode rows go in order of slack (the least first, where the batch cannot hold them all; every
  row that fits runs every pass: a stream ahead of its listener keeps its lead, which hides the
  engine's hiccups);
- a multi-step round ends where a row that has not been heard yet, or that a whole round would
  run dry, has its next chunk due (first chunks early for new arrivals);
- a prompt's prefill step is only as long as the smallest slack of the heard rows in decode allows
  (split where chunked prefill is on), and waits while no useful part of it fits: a new request
  queues rather than a running stream stalls. Where the slack holds some but not all of the prompts
  in line, they wait (decoding goes on and builds the rows' lead) for one step that takes them
  all, until the oldest is ``first_audio_target_ms`` old: a burst of arrivals is prefilled in few
  steps, not one or two prompts a pass.

Admission. A stream admitted beyond what the engine can keep ahead of its listener makes every
stream stall, not only itself. With ``rate_admission``, a waiting request that starts a
stream is admitted only while every running stream, with it, would still gain audio at least
``admission_headroom`` faster than real time (0.8: 1.8x; a small CPU's passes vary by tens of
milliseconds, and the streams' lead must absorb that): the decode passes a second the engine made over its last second of
work (:class:`~audio_pipeline.core.deadlines.PassRate`: prefill steps, the audio decoder and the
host's other work included) times the audio a pass adds to a stream (``audio_per_pass``, which the
engine sets), scaled by what one more row adds to a pass (:class:`~audio_pipeline.core.deadlines.StepCosts`).
Past that it waits (``max_queue_wait_ms`` then refuses new requests). A later piece of a running
stream (``continuation``) is admitted regardless: its stream is already playing. With nothing
running (the rate is then forgotten: a burst after a pause is admitted as the limits allow), or
before a rate is known, requests are admitted as the KV cache and the limits allow.

When a decode step cannot get a KV block, the most recently admitted other request is preempted:
its blocks are released and it goes back to the front of the queue, to be recomputed (its prompt
plus the tokens it generated; prefix caching makes that cheap) when memory frees up.

The scheduler is the one owner of a request's progress and end. :meth:`~AudioGenerationScheduler.update`
applies each step's sampled ids (the request's ``append_sample`` appends them with their forced
tokens and names the stop condition they meet), and ends the requests that meet one;
:meth:`~AudioGenerationScheduler.finish` ends a request for its caller (cancelled, failed). Both
hand back the requests they let go (:class:`Finished`: the request, its reason, its KV blocks
released, nothing of it in flight), so that the caller only delivers and frees its own state.

Requests are duck-typed: ``request_id``, ``arrival_time``, ``all_tokens`` (prompt plus generated so
far), ``total_length``, ``max_length`` (the most tokens it may ever hold), ``is_done`` (whether
``stop_reason`` is set) and ``append_sample(token) -> StopReason | None``, plus a writable
``processed`` (tokens whose KV is in the cache) and ``stop_reason``, which only the scheduler writes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from audio_pipeline.core.deadlines import PassRate, StepCosts
from audio_pipeline.core.kv_cache.block_manager import BlockManager
from audio_pipeline.core.steady_batch import SteadyBatch, SteadyItems
from audio_pipeline.core.stop import StopReason


class ScheduledRequest(Protocol):
    """What the scheduler reads and calls of a request (core/request.py's TTSContext; the tests'
    plain requests), declared here and never probed."""

    request_id: str
    arrival_time: float
    #: Tokens whose keys and values are in the KV cache (while the persistent batch holds the
    #: request, written where a page fills and when the batch ends: core/steady_batch.py).
    processed: int
    stop_reason: StopReason | None
    #: A later piece of a client request (a long text's next segment): waiting, it is not queued.
    continuation: bool
    #: Playback deadlines, written by the engine before each round (None: no deadline).
    deadline: float | None
    heard: bool
    passes_to_chunk: int
    #: What the prefix cache compares of each prompt and generated position (their tokens, or
    #: keys of positions that are frames), as lists the request appends to.
    cache_prompt: list
    cache_generated: list

    @property
    def cache_keys(self) -> list:
        """``cache_prompt`` then ``cache_generated``: every position as the prefix cache compares it."""

    @property
    def max_length(self) -> int: ...

    @property
    def total_length(self) -> int: ...

    @property
    def is_done(self) -> bool: ...

    @property
    def samples_alone(self) -> bool:
        """Whether every sample of the request comes alone (tokens_per_sample is always 1): no
        forced runs, so its decode passes can go in the persistent batch (core/steady_batch.py)."""

    def tokens_per_sample(self, position: int) -> int:
        """Tokens known after sampling the token at ``position``: 1, or more where the request's
        layout forces the tokens that follow (appended without a model step of their own)."""

    def append_sample(self, token: Any) -> StopReason | None:
        """Records a sampled token; the reason the request ends, if it does."""

#: The fewest prompt tokens a prefill step that deadlines shorten is worth running for.
MIN_PREFILL_TOKENS = 16


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue_size``."""


@dataclass(frozen=True)
class Finished:
    """A request the scheduler let go: it ended (``reason``; ``error`` says why it failed), nothing
    of it is in flight and its KV blocks are released."""

    request: ScheduledRequest
    reason: StopReason
    error: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """The knobs above, as the configuration resolved them for the device (``for_device``): the
    configuration's fields are the one place they are named, defaulted and checked."""

    max_batch_size: int
    max_queue_size: int
    max_queue_size_tg: int | None
    min_batch_size_tg: int | None
    max_batch_input_tokens: int
    ce_delay_ms: float
    enable_prioritize_first_decode: bool
    enable_chunked_prefill: bool
    enable_in_flight_batching: bool
    max_num_steps: int
    kvcache_ce_watermark: float
    deadline_scheduling: bool = True
    max_queue_wait_ms: float | None = 2000.0
    first_audio_target_ms: float = 100.0
    deadline_margin_ms: float = 20.0
    text_wait_lead_ms: float | None = 500.0
    rate_admission: bool = True
    admission_headroom: float = 0.8

    @classmethod
    def from_config(cls, config: Any) -> "SchedulerConfig":
        """From a PipelineConfig resolved for its device (``config.for_device``)."""
        values = {field.name: getattr(config, field.name) for field in dataclasses.fields(cls)
                  if hasattr(config, field.name)}
        unresolved = [name for name in ("max_batch_size", "max_queue_size", "enable_in_flight_batching",
                                        "deadline_scheduling", "rate_admission") if values.get(name, False) is None]
        if unresolved:
            raise ValueError(f"{', '.join(unresolved)}: resolve the configuration for its device first (for_device)")
        return cls(**values)

    @property
    def admission_limit(self) -> int:
        return max(self.max_queue_size_tg or self.max_batch_size, self.max_batch_size)

    @property
    def tg_floor(self) -> int:
        return self.min_batch_size_tg if self.min_batch_size_tg is not None else self.admission_limit


@dataclass(eq=False)
class _Entry:
    request: ScheduledRequest
    #: Position of the next token to schedule (tokens before it are computed or in flight).
    next_pos: int = 0
    #: Tokens the request will have known once its in-flight steps are done.
    expected_len: int = 0
    #: Scheduled steps whose outputs are not applied yet.
    in_flight: int = 0
    admitted_order: int = 0
    #: Why it failed, when it did (handed back with it once it is let go).
    error: str | None = None
    #: The request's max_length (fixed for its life), read every step.
    max_length: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def unscheduled(self) -> int:
        return self.expected_len - self.next_pos


@dataclass
class StepResult:
    """What a model step produced, as plain data: for each item it ran (``request``, ``start``,
    ``num_tokens``, ``sample``), the ids it sampled (empty where it did not sample). Nothing in it
    has touched a request yet; :meth:`AudioGenerationScheduler.update` applies it."""

    items: list[Any] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    #: Layouts whose positions carry frames: per item, the frame of each sampled id (else None).
    frames: list[list[list[int]]] | None = None
    #: Per item, whether its one sample is plain (checked already, for every row at once: a code
    #: of its position's codebook, no stop id, within the token budget, nothing forced after it),
    #: so the update only appends it to the request's tokens; None: every sample is checked as
    #: it is appended.
    plain: list[bool] | None = None
    #: Each item's one sampled id, where every item sampled one id (a token layout's decode pass).
    ids: list[int] | None = None


class OneEach(Sequence[list[int]]):
    """StepResult.tokens of a pass where every item sampled one id: ``[ids[i]]`` for item i, made
    only where read (the persistent batch's update reads the ids themselves)."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [[token] for token in self.ids[index]]
        return [self.ids[index]]

    def __iter__(self):
        return ([token] for token in self.ids)

    def by_request(self) -> dict[str, list[int]]:
        """Sampled ids by request id."""
        return {item.request.request_id: tokens for item, tokens in zip(self.items, self.tokens)}


class _TokenPrefix(Sequence[int]):
    """The first ``length`` tokens of prompt + generated, without joining the two lists: the block
    manager reads only the blocks that filled since the last step, so the update does not copy
    every request's whole context at every step."""

    def __init__(self, prompt: list[int], generated: list[int], length: int):
        self._prompt, self._generated, self._length = prompt, generated, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if not isinstance(index, slice):
            index = range(self._length)[index]
            split = len(self._prompt)
            return self._prompt[index] if index < split else self._generated[index - split]
        start, stop, step = index.indices(self._length)
        if step != 1:
            return [self[i] for i in range(start, stop, step)]
        split = len(self._prompt)
        return self._prompt[start:min(stop, split)] + self._generated[max(start - split, 0):max(stop - split, 0)]


def _computed_tokens(request: ScheduledRequest) -> Sequence[int]:
    """The cache keys of ``request``'s positions whose KV is in the cache (its first ``processed``)."""
    return _TokenPrefix(request.cache_prompt, request.cache_generated, request.processed)


def _prompt_tokens(request: ScheduledRequest) -> int:
    """Tokens a waiting request's prefill computes (its prompt, and what it generated before a
    preemption), at least one."""
    return max(1, len(request.cache_prompt) + len(request.cache_generated))


def _after_samples(entry: "_Entry", steps: int, plan: list["ScheduledItem"] | None = None) -> tuple[int, int]:
    """(tokens computed, tokens known) once ``steps`` decode steps of ``entry`` (``_decode_plan``,
    or ``plan``, that plan already made) have run."""
    if steps == 1:  # every decode pass with in-flight batching: no plan to build
        return entry.expected_len, entry.expected_len + entry.request.tokens_per_sample(entry.expected_len)
    last = (plan or _decode_plan(entry, steps))[-1]
    computed = last.start + last.num_tokens
    return computed, computed + entry.request.tokens_per_sample(computed)


def _decode_plan(entry: "_Entry", steps: int) -> list["ScheduledItem"]:
    """The items of ``steps`` consecutive decode steps of ``entry``: each computes what the one
    before it sampled (the sample and the forced run that follows it) and samples again."""
    known, computed, plan = entry.expected_len, entry.next_pos, []
    for _ in range(steps):
        plan.append(ScheduledItem(entry.request, computed, known - computed, True))
        computed = known
        known += entry.request.tokens_per_sample(known)
    return plan


class ScheduledItem(NamedTuple):
    """Compute tokens [start, start + num_tokens) of ``request``; sample after them if ``sample``.
    (A named tuple: a step makes one per row and pass, and a frozen dataclass's construction cost
    several times as much.)"""

    request: ScheduledRequest
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """One step's work. ``kind`` is 'ce' (prefill), 'tg' (decode), 'mixed' or 'idle'."""

    kind: str = "idle"
    items: list[ScheduledItem] = field(default_factory=list)
    #: Further decode steps of the same requests, each computing what the one before sampled
    #: (multi-step decoding, pure decode batches only): launched back to back, applied in order.
    substeps: list[list[ScheduledItem]] = field(default_factory=list)
    #: Requests that went back to the queue this step (their KV was released).
    preempted: list[Any] = field(default_factory=list)
    #: Requests this scheduling ended and let go: those that can never run (FAILED).
    finished: list[Finished] = field(default_factory=list)
    #: When idle with work waiting (ce_delay_ms), seconds until something can be scheduled.
    wait_s: float | None = None

    @property
    def num_steps(self) -> int:
        """Forward passes this output runs."""
        return 1 + len(self.substeps) if self.items else 0

    @property
    def steps(self) -> list[list[ScheduledItem]]:
        """The items of each forward pass, in order."""
        return [self.items, *self.substeps] if self.items else []

    @property
    def batch_size(self) -> int:
        return len(self.items)

    @property
    def input_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def requests(self) -> list[Any]:
        return [item.request for item in self.items]


class AudioGenerationScheduler:
    """Continuous batching over a paged KV cache; see the module docstring for the knobs."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 clock: Callable[[], float] = time.monotonic, steady_batches: bool = True):
        self.config = config
        #: Whether a batch of requests that all decode is kept from pass to pass (core/steady_batch.py);
        #: False schedules every pass row by row (the tests compare the two).
        self.steady_batches = steady_batches
        self._steady: SteadyBatch | None = None
        self.block_manager = block_manager
        self.clock = clock
        self._waiting: deque[_Entry] = deque()
        self._running: list[_Entry] = []
        #: Bumped whenever a request joins or leaves the queue or the running set: what a reader
        #: derives from those (the engine's load gauges) is recomputed only when it moved.
        self.membership = 0
        self._by_id: dict[str, _Entry] = {}
        self._admissions = 0
        self._rotation = 0
        self._last_kind = "idle"
        #: Preemptions since start.
        self.num_preemptions = 0
        #: Requests that sit out the rounds (:meth:`hold`).
        self._held: frozenset[str] = frozenset()
        #: What steps take, learned from the engine's (deadline scheduling).
        self.costs = StepCosts()
        #: Decode passes a second of work lately (the engine observes every round).
        self.pass_rate = PassRate()
        #: Seconds of audio a decode pass adds to a stream (the engine sets it); None: admission
        #: is not held back by the rate (see the module docstring).
        self.audio_per_pass: float | None = None

    # --- queue -----------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache can hold once grown to its most."""
        return self.block_manager.max_num_blocks * self.block_manager.block_size

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> list[Any]:
        return [e.request for e in self._waiting]

    @property
    def running(self) -> list[Any]:
        return [e.request for e in self._running]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def has_room(self, pending: int = 0) -> bool:
        """Whether one more request may be queued now (what ``add`` checks first), with ``pending``
        others on their way in."""
        # Free admission slots count too: a burst that arrives before the next step moves waiting
        # requests into them must not be turned away while they stand empty.
        free_slots = max(0, self.config.admission_limit - len(self._running))
        return len(self._waiting) + pending < self.config.max_queue_size + free_slots

    def queue_wait(self) -> float:
        """Seconds the oldest waiting request that starts a stream (not a later piece of one running)
        has waited for admission; 0 when none waits."""
        oldest = next((e.request for e in self._waiting if not e.request.continuation), None)
        return max(0.0, self.clock() - oldest.arrival_time) if oldest is not None else 0.0

    def add(self, request: ScheduledRequest) -> None:
        """Queues ``request``; QueueFull when the queue is full, ValueError when it can never fit."""
        if request.request_id in self._by_id:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if not self.has_room():
            raise QueueFull(f"the request queue is full ({self.config.max_queue_size} waiting); retry later")
        held = self.block_manager.held_tokens(request.max_length)
        if held > self.capacity_tokens:
            raise ValueError(f"the request may need {held} KV tokens, more than the whole cache "
                             f"({self.capacity_tokens}); lower max_tokens or give the KV cache more memory")
        entry = _Entry(request, max_length=request.max_length)
        self._waiting.append(entry)
        self._by_id[request.request_id] = entry
        self.membership += 1

    def remove(self, request_id: str) -> Any | None:
        """Drops a request without ending it and releases its KV blocks: for an owner that gives
        up on the scheduler (nothing of the request may be in flight)."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return None
        self._dissolve()
        del self._by_id[request_id]
        if entry in self._running:
            self._running.remove(entry)
        else:
            self._waiting.remove(entry)
        self.membership += 1
        self.block_manager.release(request_id)
        return entry.request

    def finish(self, request: ScheduledRequest, reason: StopReason, error: str | None = None, *,
               stopped: bool = False) -> list[Finished]:
        """Ends ``request`` for the caller (CANCELLED, or FAILED with ``error``). A request that
        ended already keeps its reason, except that a failure overrides any: what it made is lost.

        Returns it, let go, when nothing of it is in flight (or ``stopped``: the caller has given
        up its launched steps after a failure); otherwise the :meth:`update` that takes its last
        step out of flight returns it. A request let go earlier that fails afterwards (while its
        caller still delivers it) comes back with its new reason."""
        if request.is_done and reason is not StopReason.FAILED:
            return []
        self._dissolve()  # its entry is read below, and a row that ends leaves the batch
        request.stop_reason = reason
        entry = self._by_id.get(request.request_id)
        if entry is None:
            return [Finished(request, reason, error)]
        entry.error = error
        return [self._let_go(entry)] if stopped or not entry.in_flight else []

    def update(self, output: SchedulerOutput, result: StepResult | None = None, *,
               last: bool = True) -> list[Finished]:
        """The one place a step's result enters its requests: each sampled id is appended with the
        forced tokens that follow it (the request's ``append_sample``), and the stop condition they
        meet ends the request. When ``last`` (the step's final forward pass; a multi-step batch has
        several), ``output``'s requests leave flight and the KV they wrote is committed to the
        prefix cache. ``result`` is None for a step that failed: nothing is applied.

        Returns the requests that ended and left flight here, let go (KV blocks released): ended by
        this result, or earlier (cancelled, failed, stopped in an earlier pass) while in flight."""
        if type(output.items) is SteadyItems and output.items.batch.live:
            return self._steady_update(output.items.batch, result, last)
        if result is not None:
            frames, plain = result.frames, result.plain
            for index, (item, tokens) in enumerate(zip(result.items, result.tokens)):
                request = item.request
                if request.stop_reason is not None:  # ended meanwhile (cancelled while its step ran)
                    continue
                request.processed = item.start + item.num_tokens
                if plain is not None and plain[index]:  # checked with its step's rows: appended as it is
                    request.generated.append(tokens[0])
                elif len(tokens) == 1:  # a row's one sample (every decode row): _apply's work, without a call
                    if frames is None:
                        request.stop_reason = request.append_sample(tokens[0])
                    else:
                        request.stop_reason = request.append_sample(tokens[0], frames[index][0])
                elif tokens:
                    self._apply(item, tokens, frames[index] if frames is not None else None)
            if self._steady is not None and any(item.request.stop_reason is not None for item in result.items):
                self._dissolve()  # a row of the batch ended: its entries are read below
        if not last:
            return []
        finished = []
        by_id = self._by_id
        entries = [by_id.get(item.request.request_id) for item in output.items]
        self.block_manager.commit_all([entry.request for entry in entries if entry is not None],
                                      _computed_tokens)
        for entry in entries:
            if entry is None:
                continue
            entry.in_flight -= 1
            if entry.request.stop_reason is not None and not entry.in_flight:
                finished.append(self._let_go(entry))
        return finished

    def _steady_update(self, batch: SteadyBatch, result: StepResult | None, last: bool) -> list[Finished]:
        """:meth:`update` of a pass of the persistent batch while it holds: no row of it has
        ended (an end dissolves it), so each row takes its sample, and only rows whose page filled
        commit their KV (the prefix cache keys full pages). A row that ends here dissolves it."""
        requests = batch.requests
        ended = False
        if result is not None:
            items = result.items
            starts = items.starts if type(items) is SteadyItems else np.array([item.start for item in items],
                                                                              dtype=np.int64)
            plain, frames = result.plain, result.frames
            batch.applied = starts + 1
            if plain is not None and result.ids is not None and all(plain):
                # Checked with the step's rows: each appended as it is, the loop in C (map). Their
                # ``processed`` waits in batch.applied (written where a page fills, and at the end).
                deque(map(list.append, batch.generated, result.ids), maxlen=0)
            else:
                ends = batch.applied.tolist()
                for index, (request, tokens, end) in enumerate(zip(requests, result.tokens, ends)):
                    request.processed = end
                    if plain is not None and plain[index]:
                        request.generated.append(tokens[0])
                        continue
                    reason = (request.append_sample(tokens[0]) if frames is None
                              else request.append_sample(tokens[0], frames[index][0]))
                    if reason is not None:
                        request.stop_reason = reason
                        ended = True
            filled = np.flatnonzero((starts + 1) % self.block_manager.block_size == 0)
            if filled.size:
                owners = [requests[row] for row in filled.tolist()]
                for owner, end in zip(owners, (starts[filled] + 1).tolist()):
                    owner.processed = end
                self.block_manager.commit_all(owners, _computed_tokens)
        if last:
            batch.launched -= 1
        if not ended:
            return []
        self._dissolve()
        if not last:
            return []
        return [self._let_go(entry) for entry in batch.entries
                if entry.request.stop_reason is not None and not entry.in_flight]

    def _dissolve(self) -> None:
        """Ends the persistent batch, if any: its rows' entries are true again (core/steady_batch.py)."""
        batch, self._steady = self._steady, None
        if batch is not None and batch.live:
            batch.dissolve()
            # Rows whose page did not fill skipped their commits: the block manager's counts catch up.
            self.block_manager.commit_all(batch.requests, _computed_tokens)

    def _adopt(self, output: SchedulerOutput) -> None:
        """Keeps ``output``'s rows as the persistent batch where it is one: decode passes of every
        running request, each sampling alone, and no waiting request that could join them."""
        items = output.items
        if (not self.steady_batches or output.kind != "tg" or output.preempted or output.finished
                or not self._admission_closed() or len(items) != len(self._running)):
            return
        by_id = self._by_id
        entries = [by_id[item.request.request_id] for item in items]
        if not all(entry.request.samples_alone for entry in entries):
            return
        starts = np.array([item.start for item in items], dtype=np.int64)
        page_rows = self.block_manager.page_rows([entry.request_id for entry in entries])
        batch = SteadyBatch(entries, self.membership, page_rows, ScheduledItem)
        for entry in entries:  # this round is the batch's from here on
            entry.in_flight -= 1
        batch.launched = 1
        # A multi-step round's later passes compute what the one before sampled: one position further.
        output.items = SteadyItems(batch, starts)
        output.substeps = [SteadyItems(batch, starts + index) for index in range(1, len(output.substeps) + 1)]
        self._steady = batch

    def _admission_closed(self) -> bool:
        """Whether no waiting request can join the running ones now: none waits, as many run as
        may, or the running streams would not keep ahead of their listeners with another and none
        of those waiting continues a running stream (those that wait then change nothing of a
        round but its length, :meth:`_num_steps`)."""
        return not self._waiting or len(self._running) >= self.config.admission_limit or not self._may_admit_some()

    def _may_admit_some(self) -> bool:
        """Whether some waiting request may go in by the rate: any, or a later piece of a running stream."""
        return self._sustains_another() or any(e.request.continuation for e in self._waiting)

    def _sustains_another(self) -> bool:
        """Whether every running stream would still gain audio ``admission_headroom`` faster than
        real time with one more (see the module docstring); True where that is not known."""
        per_pass = self.audio_per_pass
        if not self.config.rate_admission or per_pass is None:
            return True
        if not self._running:  # a new busy spell: what the last one ran at says nothing of it
            self.pass_rate.clear()
            return True
        rate = self.pass_rate.per_second(self.clock())
        if rate is None:
            return True
        rows = len(self._running)
        # Beyond a batch, the rows take turns: each is in max_batch_size of every rows + 1 passes.
        share = min(1.0, self.config.max_batch_size / (rows + 1))
        slower = min(1.0, self.costs.decode_pass(rows) / self.costs.decode_pass(rows + 1))
        return rate * per_pass * share * slower >= 1.0 + self.config.admission_headroom

    def _steady_round(self, batch: SteadyBatch) -> SchedulerOutput | None:
        """The next round from the persistent batch, as :meth:`_schedule` would make it (its
        passes, pages, and a multi-step round's length), or None where it is not a steady round:
        the batch changed, a waiting request may join, a row reaches its max_length or finds no page."""
        if batch.membership != self.membership or not self._admission_closed():
            return None
        config = self.config
        planned = 1 if config.enable_in_flight_batching else self._num_steps()
        most = batch.reserve(self.block_manager, planned)
        if most <= 0:
            return None
        steps = min(planned, most)
        if steps > 1 and config.deadline_scheduling:
            steps = min(steps, self._steady_round_end(batch, steps))
        passes = batch.launch(max(steps, 1))
        return SchedulerOutput(kind="tg", items=passes[0], substeps=passes[1:])

    def _steady_round_end(self, batch: SteadyBatch, steps: int) -> int:
        """:meth:`_round_end` of the batch's rows, their slack (:meth:`_slack`) computed for all at once."""
        requests = batch.requests
        count = len(requests)
        now = self.clock()
        pass_seconds = self.costs.decode_pass(count)
        passes = np.fromiter((request.passes_to_chunk for request in requests), dtype=np.int64, count=count)
        deadlines = np.fromiter((math.inf if request.deadline is None else request.deadline for request in requests),
                                dtype=np.float64, count=count)
        heard = np.fromiter((request.heard for request in requests), dtype=bool, count=count)
        slack = deadlines - now - passes * pass_seconds - self.config.deadline_margin_ms / 1000.0
        ends = (passes > 0) & (~heard | (slack < steps * pass_seconds))
        return int(passes[ends].min()) if ends.any() else steps

    # --- scheduling ------------------------------------------------------------------------------

    def hold(self, request_ids: frozenset[str]) -> None:
        """``request_ids`` sit out the rounds until held no more: they stay running and keep their KV,
        but are not decoded (a text stream waiting for words while its listener has audio enough:
        core/engine_core.py). A change dissolves the persistent batch (its rows are the decode rows)."""
        if request_ids != self._held:
            self._held = request_ids
            self.membership += 1

    def schedule(self) -> SchedulerOutput:
        """The next step's work (possibly idle)."""
        if self._steady is not None:
            output = self._steady_round(self._steady)
            if output is not None:
                self._last_kind = "tg"
                return output
            self._dissolve()
        output = self._schedule()
        self._adopt(output)
        return output

    def _schedule(self) -> SchedulerOutput:
        config = self.config
        # One pass: rows with one token to compute that may grow decode; those with more are prompts
        # in progress. Requests that ended stay in _running only while a step of them is in flight.
        decode, prefill = [], []
        held = self._held
        for e in self._running:
            left = e.expected_len - e.next_pos
            if left == 1:
                if e.expected_len < e.max_length and e.request.stop_reason is None and (
                        not held or e.request.request_id not in held):
                    decode.append(e)
            elif left > 1 and e.request.stop_reason is None:
                prefill.append(e)
        slack = self._slack(decode) if config.deadline_scheduling and decode else None
        if config.enable_in_flight_batching:
            output = self._mixed(decode, prefill, slack)
        else:
            output = SchedulerOutput()
            prefer_ce = (prefill or self._waiting) and len(decode) < config.tg_floor and not (
                config.enable_prioritize_first_decode and self._last_kind == "ce" and decode)
            budget = config.max_batch_input_tokens
            if prefer_ce and slack:
                budget = self._prefill_budget(slack, prefill, 0, budget)
                prefer_ce = budget > 0
            if prefer_ce or not decode:
                output = self._prefill(prefill, budget=budget, slots=config.max_batch_size)
            if not output.items and decode:
                output = self._decode(decode, slack=slack)
        if not output.items and self._waiting and output.wait_s is None and not self._running:
            # Nothing runs and the head of the queue cannot be admitted: it can never fit.
            head = self._waiting[0]
            if self.block_manager.num_used_blocks == 0 and not self._delay_left():
                output.finished += self.finish(head.request, StopReason.FAILED,
                                               "the request does not fit in the KV cache")
        self._last_kind = output.kind
        return output

    # --- internals -------------------------------------------------------------------------------

    def _slack(self, entries: list[_Entry]) -> dict[_Entry, float]:
        """Each row's slack in seconds (see the module docstring); inf where it has no deadline."""
        now = self.clock()
        config = self.config
        pass_seconds = self.costs.decode_pass(len(entries))
        margin = config.deadline_margin_ms / 1000.0
        out = {}
        for entry in entries:
            request = entry.request
            deadline = request.deadline
            out[entry] = (math.inf if deadline is None else
                          deadline - now - request.passes_to_chunk * pass_seconds - margin)
        return out

    def _prefill_budget(self, slack: dict[_Entry, float], prefill: list[_Entry], rows: int, budget: int) -> int:
        """``budget`` prompt tokens, or fewer: what a step beside ``rows`` decode rows may compute
        before the heard row with the least slack runs dry; 0 where that is not worth a step (less
        than MIN_PREFILL_TOKENS, or than the next prompt's rest). Rows not heard yet do not hold a
        prompt back: their first audio is as late as the new one's, and no listener runs dry."""
        least = min((value for entry, value in slack.items() if entry.request.heard),
                    default=math.inf)
        if math.isinf(least):
            return budget
        fits = self.costs.prompt_tokens_within(least, rows)
        if fits >= budget:
            return budget
        if self._may_gather(prefill) and fits < self._queued_prompt_tokens(prefill):
            return 0
        return fits if fits >= min(MIN_PREFILL_TOKENS, self._next_prompt_tokens(prefill)) else 0

    def _queued_prompt_tokens(self, prefill: list[_Entry]) -> int:
        """Prompt tokens of every prompt in line: those admitted and partly computed, and those waiting."""
        return sum(entry.unscheduled for entry in prefill) + sum(_prompt_tokens(e.request) for e in self._waiting)

    def _may_gather(self, prefill: list[_Entry]) -> bool:
        """Whether the prompts in line (two or more) may wait for one prefill step that takes them all, rather than
        go a few at a time in the slack the heard rows leave: while the oldest is younger than the
        first-audio target. Decode passes meanwhile build the heard rows' lead, so the one step
        fits sooner; each small step would cost a pass of its own and leave the rows no lead. 32
        simultaneous starts on 2 cores (the built-in voice; they reach the engine core over about
        60 ms as the front end prepares them, and the first is heard before the last arrives): first
        audio p99 185 and 198 ms gathered, 400 and 413 ms a few at a time (p50 alike)."""
        if len(prefill) + len(self._waiting) < 2:  # one prompt: chunked prefill's splitting is the way
            return False
        head = prefill[0].request if prefill else self._waiting[0].request
        return self.clock() - head.arrival_time < self.config.first_audio_target_ms / 1000.0

    def _next_prompt_tokens(self, prefill: list[_Entry]) -> int:
        """Prompt tokens the next prefill would compute for the first prompt in line."""
        if prefill:
            return prefill[0].unscheduled
        if self._waiting:
            return _prompt_tokens(self._waiting[0].request)
        return 0

    def _let_go(self, entry: _Entry) -> Finished:
        request = self.remove(entry.request_id)
        return Finished(request, request.stop_reason, entry.error)

    @staticmethod
    def _apply(item: "ScheduledItem", tokens: list[int], frames: list[list[int]] | None = None) -> None:
        """Tokens [start, start + num_tokens) of the item's request are now in the KV cache; its
        sampled ids go in. A request that ended meanwhile (cancelled while its step ran) is left
        as it is."""
        request = item.request
        if request.is_done:
            return
        request.processed = item.start + item.num_tokens
        for index, token in enumerate(tokens):
            reason = (request.append_sample(token, frames[index]) if frames is not None
                      else request.append_sample(token))
            if reason is not None:
                request.stop_reason = reason
                return

    def _num_steps(self) -> int:
        if self.config.max_num_steps != -1:
            return self.config.max_num_steps
        # Short rounds while a request may join; those held back by the rate (module docstring:
        # admission) wait for the running streams to gain ground, which longer rounds help.
        return 1 if self._waiting and self._may_admit_some() else 4

    def _delay_left(self) -> float:
        """Seconds the oldest waiting prompt should still wait for company (ce_delay_ms)."""
        if not self._waiting or self.config.ce_delay_ms <= 0:
            return 0.0
        free_slots = self.config.admission_limit - len(self._running)
        if len(self._waiting) >= min(free_slots, self.config.max_batch_size):
            return 0.0
        waited = self.clock() - self._waiting[0].request.arrival_time
        return max(0.0, self.config.ce_delay_ms / 1000.0 - waited)

    def _take(self, entry: _Entry, num_tokens: int, output: SchedulerOutput) -> None:
        start = entry.next_pos
        sample = start + num_tokens == entry.expected_len
        entry.next_pos += num_tokens
        entry.in_flight += 1
        if sample:
            entry.expected_len += entry.request.tokens_per_sample(entry.expected_len)
        output.items.append(ScheduledItem(entry.request, start, num_tokens, sample))

    def _prefill_chunk(self, entry: _Entry, budget: int, first: bool) -> int:
        """Tokens of ``entry``'s prompt to compute within ``budget`` (0: none fit)."""
        remaining = entry.unscheduled
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # Unchunked: a whole prompt or nothing, except an oversize one alone in its step.
        return remaining if first and budget == self.config.max_batch_input_tokens else 0

    def _prefill(self, prefill: list[_Entry], *, budget: int, slots: int, output: SchedulerOutput | None = None,
                 ) -> SchedulerOutput:
        output = output or SchedulerOutput()
        manager = self.block_manager
        watermark = self.config.kvcache_ce_watermark
        for entry in prefill:  # prompts already admitted and partly computed go first
            if len(output.items) >= slots or budget <= 0:
                break
            if entry not in self._running:  # preempted earlier in this step
                continue
            count = self._prefill_chunk(entry, budget, first=not output.items)
            if count <= 0:
                continue
            while not manager.can_alloc(entry.request_id, entry.next_pos + count):
                if not self._preempt_for(entry, protected=[], output=output):
                    break
            if not manager.can_alloc(entry.request_id, entry.next_pos + count):
                continue
            manager.alloc(entry.request_id, entry.next_pos + count)
            self._take(entry, count, output)
            budget -= count
        delay = self._delay_left()
        if delay > 0:
            if not output.items:
                output.wait_s = delay
        else:
            while (self._waiting and len(output.items) < slots and budget > 0
                   and len(self._running) < self.config.admission_limit):
                entry = self._waiting[0]
                if not entry.request.continuation and not self._sustains_another():
                    # Only what continues a running stream goes in (module docstring: admission).
                    entry = next((e for e in self._waiting if e.request.continuation), None)
                    if entry is None:
                        break
                request = entry.request
                tokens = request.cache_keys
                cached = manager.claim(request.request_id, tokens)
                entry.next_pos = cached
                entry.expected_len = len(tokens)
                count = self._prefill_chunk(entry, budget, first=not output.items)
                if (count <= 0 or not manager.can_alloc(request.request_id, len(tokens), watermark=watermark)
                        or not manager.can_alloc(request.request_id, cached + count)):
                    manager.release(request.request_id)
                    manager.prefix_stats.queried_tokens -= len(tokens)
                    manager.prefix_stats.hit_tokens -= cached
                    break
                self._waiting.remove(entry)
                request.processed = cached
                self._admissions += 1
                entry.admitted_order = self._admissions
                self._running.append(entry)
                self.membership += 1
                manager.alloc(request.request_id, cached + count)
                self._take(entry, count, output)
                budget -= count
        if output.items and output.kind == "idle":
            output.kind = "ce"
        return output

    def _decode(self, decode: list[_Entry], *, multi_step: bool = True,
                slack: dict[_Entry, float] | None = None) -> SchedulerOutput:
        output = SchedulerOutput()
        pure = multi_step
        steps = self._num_steps() if pure else 1
        slots = self.config.max_batch_size - len(output.items)
        if slack:  # the least slack first: where the batch cannot hold every row, the others wait
            decode = sorted(decode, key=slack.__getitem__)
        elif len(decode) > slots:  # rotate so every admitted request gets its turn
            self._rotation %= len(decode)
            decode = decode[self._rotation:] + decode[:self._rotation]
            self._rotation += slots
        chosen: list[_Entry] = []
        # Each row's plan of the round's passes, made once (the KV it needs and its items come from it).
        plans: dict[_Entry, list[ScheduledItem]] = {}
        # A set: membership in the list, row by row, cost a quarter of the scheduler's time at 256 rows.
        running = set(self._running)
        multi = pure and steps > 1
        if multi:
            for entry in decode:
                plans[entry] = _decode_plan(entry, steps)
            needs = [min(_after_samples(entry, steps, plans[entry])[0], entry.max_length) for entry in decode]
        else:  # one pass: each row computes the one token it has (expected_len < max_length)
            needs = [entry.expected_len for entry in decode]
        # Whether each row's pages hold what it computes, for all rows at once (the page table's).
        held = self.block_manager.holds_all([entry.request.request_id for entry in decode], needs)
        for entry, need, holds in zip(decode, needs, held):
            if len(chosen) >= slots:
                break
            if entry.request.stop_reason is not None or entry not in running:
                continue
            if holds:
                chosen.append(entry)
                continue
            while not self.block_manager.can_alloc(entry.request_id, need):
                if not self._preempt_for(entry, protected=chosen, output=output):
                    break
                running = set(self._running)  # the victim left
            if self.block_manager.can_alloc(entry.request_id, need):
                self.block_manager.alloc(entry.request_id, need)
                chosen.append(entry)
        planned = steps
        if pure and chosen:
            steps = min(steps, min(e.max_length - e.next_pos for e in chosen))
            if slack and steps > 1:
                steps = min(steps, self._round_end(chosen, slack, steps))
            steps = max(steps, 1)
        if pure and steps > 1 and chosen:
            output.substeps = [[] for _ in range(steps - 1)]
        items = output.items
        for entry in chosen:
            if pure and steps > 1:
                plan = plans[entry] if steps == planned else _decode_plan(entry, steps)  # a shorter round
                first, *rest = plan
                entry.next_pos, entry.expected_len = _after_samples(entry, steps, plan)
                entry.in_flight += 1
                items.append(first)
                for substep, item in zip(output.substeps, rest):
                    substep.append(item)
            else:  # _take's work for a row that samples the one token it computes, without a call
                request, start = entry.request, entry.next_pos
                entry.next_pos = start + 1
                entry.in_flight += 1
                entry.expected_len += request.tokens_per_sample(entry.expected_len)
                items.append(ScheduledItem(request, start, 1, True))
        if chosen:
            output.kind = "tg"
        return output

    def _round_end(self, chosen: list[_Entry], slack: dict[_Entry, float], steps: int) -> int:
        """The passes a multi-step round may run: up to the next chunk of each row not heard yet,
        or whose slack a whole round would use up (its chunk goes out as soon as it is due)."""
        round_seconds = steps * self.costs.decode_pass(len(chosen))
        end = steps
        for entry in chosen:
            request = entry.request
            passes = request.passes_to_chunk
            if passes > 0 and (not request.heard or slack[entry] < round_seconds):
                end = min(end, passes)
        return end

    def _mixed(self, decode: list[_Entry], prefill: list[_Entry],
               slack: dict[_Entry, float] | None = None) -> SchedulerOutput:
        """In-flight batching: decode tokens first, then prefill chunks in the remaining budget
        (with deadlines, no more than the step may take before a row runs dry)."""
        output = SchedulerOutput()
        if decode:
            output = self._decode(decode, multi_step=False, slack=slack)
            output.kind = "tg" if output.items else "idle"
        budget = self.config.max_batch_input_tokens - len(output.items)
        if slack:
            budget = self._prefill_budget(slack, prefill, len(output.items), budget)
        before = len(output.items)
        self._prefill(prefill, budget=budget, slots=self.config.max_batch_size, output=output)
        if before and len(output.items) > before:
            output.kind = "mixed"
        elif len(output.items) > before:
            output.kind = "ce"
        return output

    def _preempt_for(self, entry: _Entry, *, protected: list[_Entry], output: SchedulerOutput) -> bool:
        """Frees blocks for ``entry`` by sending the newest request admitted after it (not in flight) back
        to the queue. Only newer requests are preempted, so the oldest one always makes progress."""
        candidates = [e for e in self._running
                      if e.admitted_order > entry.admitted_order and e not in protected and e.in_flight == 0
                      and e.request not in output.requests]
        if not candidates:
            return False
        victim = max(candidates, key=lambda e: e.admitted_order)
        self._running.remove(victim)
        self.block_manager.release(victim.request_id)
        victim.request.processed = 0
        victim.next_pos = 0
        victim.expected_len = victim.request.total_length
        self._waiting.appendleft(victim)
        self.membership += 1
        self.num_preemptions += 1
        output.preempted.append(victim.request)
        return True

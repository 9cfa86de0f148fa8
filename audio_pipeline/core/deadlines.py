"""Playback deadlines: when each stream's listener would run out of audio, and what the engine's
steps cost, so the scheduler can serve the streams closest to running dry first; and how fast
the running streams gain audio, so that it admits no more of them than it can keep ahead of
their listeners (torch-free).

The engine plays every client stream as its listener would (audio/playback.py's model, on the
engine's deliveries): a stream's deadline is the moment the audio delivered so far has played out.
A long text is several requests, one after another on one stream: a later one's audio plays after
the earlier ones', so it is not due before they are done. A request whose stream has no audio yet
is due at its arrival plus the first-audio target.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from audio_pipeline.audio.playback import Playback


@dataclass
class _Stream:
    """One client stream: its player, and its requests not yet played out, in order."""

    playback: Playback = field(default_factory=lambda: Playback(record=False))
    #: Request ids in the order they speak; the first one is playing (or next to play).
    order: list[str] = field(default_factory=list)
    #: Seconds delivered for a later request, waiting for the ones before it to end.
    waiting: dict[str, float] = field(default_factory=dict)


class Listeners:
    """Each stream as its listener hears it. Call :meth:`add` when a request is submitted,
    :meth:`delivered` for each piece of its audio, :meth:`ended` once its last audio is out."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._stream_of: dict[str, str] = {}

    def add(self, request_id: str, stream_id: str) -> None:
        stream = self._streams.setdefault(stream_id, _Stream())
        stream.order.append(request_id)
        self._stream_of[request_id] = stream_id

    def delivered(self, request_id: str, now: float, seconds: float) -> None:
        stream = self._streams.get(self._stream_of.get(request_id, ""))
        if stream is None:
            return
        if stream.order and stream.order[0] == request_id:
            stream.playback.arrive(now, seconds)
        else:
            stream.waiting[request_id] = stream.waiting.get(request_id, 0.0) + seconds

    def ended(self, request_id: str, now: float) -> None:
        """``request_id`` has delivered all its audio: the next request of its stream plays on, its
        waiting audio out now. A stream with nothing left is forgotten once it has played out."""
        stream_id = self._stream_of.pop(request_id, None)
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if request_id in stream.order:
            stream.order.remove(request_id)
        stream.waiting.pop(request_id, None)
        if stream.order:
            head = stream.order[0]
            if head in stream.waiting:
                stream.playback.arrive(now, stream.waiting.pop(head))
        else:
            del self._streams[stream_id]

    def deadline(self, request_id: str) -> float | None:
        """When ``request_id``'s listener runs out of audio: its stream's, where the request is the
        one playing; None where it has no audio yet or an earlier request of its stream still speaks
        (its audio is not due before that one's end)."""
        stream = self._streams.get(self._stream_of.get(request_id, ""))
        if stream is None or not stream.order or stream.order[0] != request_id or stream.playback.started is None:
            return None
        return stream.playback.plays_until

    def follows(self, request_id: str) -> bool:
        """Whether an earlier request of the same stream is still to play out before this one."""
        stream = self._streams.get(self._stream_of.get(request_id, ""))
        return stream is not None and bool(stream.order) and stream.order[0] != request_id

    def __len__(self) -> int:
        return len(self._streams)


class StepCosts:
    """What a step takes, learned from the steps the engine ran: a decode pass's seconds by its
    rows (an exponential average per row count, so it follows the machine and the load; between
    the row counts seen, interpolated; beyond them, scaled by ``pass_seconds + per_row x rows``), and
    a prompt's prefill as a pass plus ``per_prompt_token x tokens``."""

    #: Weight of each new observation in its average.
    WEIGHT = 0.1
    #: The longest a pass is ever taken to be (an outlier, a stall of the machine, must not make
    #: every stream look late for good).
    LONGEST_PASS = 1.0

    def __init__(self, pass_seconds: float = 0.005, per_row: float = 0.0002, per_prompt_token: float = 0.0001):
        self.pass_seconds, self.per_row = pass_seconds, per_row
        self.per_prompt_token = per_prompt_token
        self._by_rows: dict[int, float] = {}
        self._rows: list[int] = []  # the row counts seen, in order

    def _model(self, rows: float) -> float:
        return self.pass_seconds + self.per_row * rows

    def decode_pass(self, rows: int) -> float:
        """Seconds a decode pass of ``rows`` rows takes (never below 0.1 ms)."""
        seen, known = self._rows, self._by_rows
        if rows in known:
            value = known[rows]
        elif not seen:
            value = self._model(rows)
        else:
            at = bisect.bisect_left(seen, rows)
            if at == 0 or at == len(seen):  # beyond what was seen: the nearest, scaled by the model
                nearest = seen[0] if at == 0 else seen[-1]
                value = known[nearest] * self._model(rows) / self._model(nearest)
            else:
                low, high = seen[at - 1], seen[at]
                value = known[low] + (known[high] - known[low]) * (rows - low) / (high - low)
        return min(self.LONGEST_PASS, max(1e-4, value))

    def prefill(self, tokens: int, rows: int = 1) -> float:
        """Seconds a step computing ``tokens`` prompt tokens takes (beside ``rows`` decode rows)."""
        return self.decode_pass(rows) + self.per_prompt_token * tokens

    def prompt_tokens_within(self, seconds: float, rows: int = 1) -> int:
        """The most prompt tokens a step beside ``rows`` decode rows computes within ``seconds``."""
        spare = seconds - self.decode_pass(rows)
        return max(0, int(spare / self.per_prompt_token)) if spare > 0 else 0

    def observe_decode(self, rows: int, seconds_per_pass: float) -> None:
        """A decode step of ``rows`` rows took ``seconds_per_pass`` a forward pass."""
        if not (seconds_per_pass > 0 and math.isfinite(seconds_per_pass)) or rows < 1:
            return
        seconds = min(seconds_per_pass, self.LONGEST_PASS)
        known = self._by_rows.get(rows)
        if known is None:
            bisect.insort(self._rows, rows)
            self._by_rows[rows] = seconds
        else:
            self._by_rows[rows] = known + self.WEIGHT * (seconds - known)

    def observe_prefill(self, tokens: int, rows: int, seconds: float) -> None:
        """A step computing ``tokens`` prompt tokens beside ``rows`` decode rows took ``seconds``."""
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        per_token = min(max(0.0, seconds - self.decode_pass(max(rows, 1))) / tokens, self.LONGEST_PASS / 64)
        self.per_prompt_token += self.WEIGHT * (per_token - self.per_prompt_token)


class PassRate:
    """Decode passes a second of the engine's work over its last ``WINDOW`` seconds of rounds: how
    fast every row in decode gains audio, with what else the rounds did in that time (prefill
    steps, the audio decoder, the host's other work, and the other processes the machine runs).
    Time the engine sits idle between rounds is not counted; rounds older than ``STALE`` seconds
    are forgotten (a busy spell long ago says nothing of the load now)."""

    #: Seconds of rounds the rate is taken over.
    WINDOW = 1.0
    #: The least seconds of rounds that give a rate (fewer: None).
    MIN_SECONDS = 0.25
    #: Rounds that ended longer ago than this are dropped.
    STALE = 5.0

    def __init__(self) -> None:
        self._rounds: deque[tuple[float, float, int]] = deque()  # (end, seconds, decode passes)
        self._seconds = 0.0
        self._passes = 0

    def observe(self, now: float, seconds: float, passes: int) -> None:
        """A round ending at ``now`` took ``seconds`` and made ``passes`` decode passes (0: prefill alone)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self._rounds.append((now, seconds, passes))
        self._seconds += seconds
        self._passes += passes
        while len(self._rounds) > 1 and self._seconds - self._rounds[0][1] >= self.WINDOW:
            self._drop()

    def per_second(self, now: float) -> float | None:
        """Decode passes a second of work lately; None where too little is known."""
        while self._rounds and self._rounds[0][0] < now - self.STALE:
            self._drop()
        return self._passes / self._seconds if self._seconds >= self.MIN_SECONDS else None

    def clear(self) -> None:
        """Forgets every round (the engine has nothing running: its next busy spell starts afresh)."""
        self._rounds.clear()
        self._seconds, self._passes = 0.0, 0

    def _drop(self) -> None:
        _, seconds, passes = self._rounds.popleft()
        self._seconds -= seconds
        self._passes -= passes
        if not self._rounds:  # no float drift left over
            self.clear()

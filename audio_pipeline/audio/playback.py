"""The playback model streaming is judged by: a player that starts at the first received sample and
plays continuously. A piece that arrives after the audio in hand ran out is an *underrun* (any delay
counts); the player waits for it and plays on from its arrival, so a stall shifts every later sample.

The open-loop benchmark applies it to what a client receives, the server's streaming metrics to
what it sends (service/stream_metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Playback:
    """One stream's player. :meth:`arrive` takes each piece's arrival time (seconds, any clock) and
    length; the fields hold what the listener got so far."""

    #: When the first sample arrived (and began to play); None before.
    started: float | None = None
    #: When the audio received so far will have finished playing.
    plays_until: float = 0.0
    #: Seconds of audio received.
    received: float = 0.0
    underruns: int = 0
    #: Total and largest time the player waited, out of audio, for a piece.
    stalled: float = 0.0
    largest_stall: float = 0.0
    #: When the last piece's first sample plays.
    last_start: float = 0.0
    #: Keep every piece for :meth:`plays_at` (a server tracking many long streams need not).
    record: bool = True
    #: Per piece, when ``record``: (when its first sample plays, its offset in the stream, its length).
    pieces: list[tuple[float, float, float]] = field(default_factory=list)

    def slack(self, now: float) -> float:
        """Seconds of audio the player holds at ``now`` (negative: it ran out that long ago)."""
        return self.plays_until - now if self.started is not None else 0.0

    def arrive(self, now: float, seconds: float) -> float:
        """A piece of ``seconds`` of audio arrives at ``now``: returns the stall it caused (0 when
        the player still had audio)."""
        if seconds <= 0:
            return 0.0
        stall = 0.0
        if self.started is None:
            self.started = self.plays_until = now
        elif now > self.plays_until:
            stall = now - self.plays_until
            self.underruns += 1
            self.stalled += stall
            self.largest_stall = max(self.largest_stall, stall)
            self.plays_until = now
        self.last_start = self.plays_until
        if self.record:
            self.pieces.append((self.plays_until, self.received, seconds))
        self.plays_until += seconds
        self.received += seconds
        return stall

    def plays_at(self, offset: float) -> float | None:
        """When the sample ``offset`` seconds into the stream plays (None: not received)."""
        for start, at, seconds in reversed(self.pieces):
            if at <= offset < at + seconds:
                return start + (offset - at)
        return None

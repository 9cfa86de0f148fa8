"""The server's own view of streaming as listeners hear it, on /metrics: every stream's audio is
played, as it leaves the server, by the playback model (audio/playback.py: play from the first
sample, continuously), so an operator sees first audio, audible first audio, gaps, the audio each
client holds, and the underruns the server caused, without a client-side tool.

Times are on the server's clock from the request's admission to the moment its audio is handed
to the front door (after encoding); a client further away hears each a network delay later.
"""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from audio_pipeline.audio.audibility import OnsetTracker
from audio_pipeline.audio.playback import Playback

#: First byte and audible first audio: fine below 300 ms, where streaming is judged.
FIRST_AUDIO_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
#: Gaps between a stream's sends and the audio a client holds (seconds). A slack of 0 or less
#: (the first bucket) means the chunk left after the client's audio ran out: an underrun.
GAP_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
SLACK_BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class StreamMetrics:
    """The histograms and counters, in ``registry``; :meth:`watch` follows one stream."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.first_byte = Histogram(
            "tts_stream_time_to_first_byte_seconds", "Admission to the stream's first audio leaving the server",
            buckets=FIRST_AUDIO_BUCKETS, registry=r)
        self.first_audible = Histogram(
            "tts_stream_time_to_first_audible_seconds", "Admission to the first audible sample (two 20 ms frames "
            "at -45 dBFS or more) playing, on the player's clock of the audio the server sends",
            buckets=FIRST_AUDIO_BUCKETS, registry=r)
        self.leading_silence = Histogram(
            "tts_stream_leading_silence_seconds", "Audio before the first audible sample", buckets=FIRST_AUDIO_BUCKETS,
            registry=r)
        self.chunk_gap = Histogram(
            "tts_stream_chunk_gap_seconds", "Time between consecutive audio sends of one stream",
            buckets=GAP_BUCKETS, registry=r)
        self.slack = Histogram(
            "tts_stream_slack_seconds", "Audio a client playing from the first sample still holds when the stream's "
            "next chunk leaves (0 or less: it had run out, an underrun)", buckets=SLACK_BUCKETS, registry=r)
        self.underruns = Counter(
            "tts_stream_underruns", "Chunks that left after the client's audio ran out (playback model)", registry=r)
        self.stall_seconds = Counter(
            "tts_stream_stall_seconds", "Time clients waited, out of audio, for the next chunk (playback model)",
            registry=r)
        self.stalled = Counter(
            "tts_streams_stalled", "Streams that ended with one underrun or more", registry=r)

    def watch(self, sample_rate: int, opened: float | None = None) -> "StreamWatch":
        """Follows one stream whose engine audio is at ``sample_rate``, admitted at ``opened``
        (time.monotonic(); default now)."""
        return StreamWatch(self, sample_rate, time.monotonic() if opened is None else opened)


class StreamWatch:
    """One stream: :meth:`audio` for each piece the engine made (for the onset), :meth:`sent` when
    audio leaves, :meth:`end` once."""

    def __init__(self, metrics: StreamMetrics, sample_rate: int, opened: float):
        self.metrics = metrics
        self.opened = opened
        self.sample_rate = sample_rate
        self.playback = Playback(record=False)
        self._onset = OnsetTracker(sample_rate)
        #: The onset's offset into the stream in seconds, once found; observed once it has been sent.
        self._onset_seconds: float | None = None
        self._audible_observed = False
        self._last_send: float | None = None

    def audio(self, samples: np.ndarray) -> None:
        """The engine made ``samples`` (its rate), to be sent next."""
        if self._onset_seconds is None and (onset := self._onset.feed(samples)) is not None:
            self._onset_seconds = onset / self.sample_rate
            self.metrics.leading_silence.observe(self._onset_seconds)

    def sent(self, seconds: float, now: float | None = None) -> None:
        """``seconds`` of audio leave the server now."""
        if seconds <= 0:
            return
        now = time.monotonic() if now is None else now
        metrics, playback = self.metrics, self.playback
        if self._last_send is None:
            metrics.first_byte.observe(now - self.opened)
        else:
            metrics.chunk_gap.observe(now - self._last_send)
            metrics.slack.observe(playback.slack(now))
        self._last_send = now
        stall = playback.arrive(now, seconds)
        if stall > 0:
            metrics.underruns.inc()
            metrics.stall_seconds.inc(stall)
        onset = self._onset_seconds
        if onset is not None and not self._audible_observed and playback.received >= onset:
            piece_offset = playback.received - seconds
            metrics.first_audible.observe(playback.last_start + max(0.0, onset - piece_offset) - self.opened)
            self._audible_observed = True

    def end(self) -> None:
        if self.playback.underruns:
            self.metrics.stalled.inc()

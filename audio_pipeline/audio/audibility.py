"""Where speech becomes audible: the industry's definition of audible first audio, on a stream or a
whole signal.

A sample is the *audible onset* when it starts the first two consecutive 20 ms frames (10 ms hop,
each frame's mean removed) whose RMS is at or above -45 dBFS (full scale: 1.0 for float samples).
The benchmark (bench/open_loop.py) measures it on what a client received, the server's streaming
metrics on what it sends; both use this one definition so their figures agree.
"""

from __future__ import annotations

import numpy as np

#: Frame and hop of the onset analysis, in seconds.
FRAME_S = 0.020
HOP_S = 0.010
#: RMS at or above this (dB relative to full scale) is audible.
AUDIBLE_DBFS = -45.0
#: Consecutive audible frames that make an onset.
FRAMES_NEEDED = 2


def _loud_frames(samples: np.ndarray, frame: int, hop: int) -> np.ndarray:
    """For each frame start 0, hop, 2 hop, ... that fits in ``samples``: whether its RMS, mean
    removed, reaches the audible level."""
    count = (samples.shape[0] - frame) // hop + 1
    if count <= 0:
        return np.zeros(0, dtype=bool)
    frames = np.lib.stride_tricks.sliding_window_view(samples, frame)[::hop][:count].astype(np.float64)
    frames = frames - frames.mean(axis=1, keepdims=True)
    rms = np.sqrt(np.mean(frames * frames, axis=1))
    return rms >= 10.0 ** (AUDIBLE_DBFS / 20.0)


def audible_onset(samples: np.ndarray, sample_rate: int) -> int | None:
    """The index of the audible onset in ``samples`` (mono floats), or None when nothing is audible."""
    frame, hop = round(FRAME_S * sample_rate), round(HOP_S * sample_rate)
    loud = _loud_frames(np.asarray(samples, dtype=np.float32).reshape(-1), frame, hop)
    run = np.convolve(loud, np.ones(FRAMES_NEEDED), mode="valid") >= FRAMES_NEEDED if loud.size else loud
    hits = np.flatnonzero(run)
    return int(hits[0]) * hop if hits.size else None


def audible_end(samples: np.ndarray, sample_rate: int) -> int | None:
    """One past the last sample of the last audible frame pair (the onset of the reversed signal),
    or None when nothing is audible: ``len(samples) - audible_end`` is the trailing silence."""
    onset = audible_onset(np.asarray(samples).reshape(-1)[::-1], sample_rate)
    return None if onset is None else len(samples) - onset


class OnsetTracker:
    """The audible onset of a stream fed in pieces: :meth:`feed` returns the onset's sample index
    (counted from the stream's start) in the piece that completes it, else None; afterwards it
    returns None and costs nothing. Keeps only the last frame's worth of samples between pieces."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate
        self._frame, self._hop = round(FRAME_S * sample_rate), round(HOP_S * sample_rate)
        #: Samples not yet past every frame that may start in them, and the stream index of the first.
        self._tail = np.zeros(0, dtype=np.float32)
        self._tail_start = 0
        #: Whether the last frame analysed was loud (a pair may straddle two pieces).
        self._last_loud = False
        #: The onset, once found.
        self.onset: int | None = None

    def feed(self, samples: np.ndarray) -> int | None:
        if self.onset is not None:
            return None
        pending = np.concatenate([self._tail, np.asarray(samples, dtype=np.float32).reshape(-1)])
        loud = _loud_frames(pending, self._frame, self._hop)
        for index, is_loud in enumerate(loud):
            if is_loud and self._last_loud:
                self.onset = self._tail_start + (index - 1) * self._hop
                self._tail = np.zeros(0, dtype=np.float32)
                return self.onset
            self._last_loud = bool(is_loud)
        consumed = loud.size * self._hop
        self._tail = pending[consumed:]
        self._tail_start += consumed
        return None

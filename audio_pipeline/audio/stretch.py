"""Streaming time-stretching without a change of pitch (WSOLA: waveform-similarity overlap-add),
for models that speak at one speed.

Output frames of ``window`` samples are overlap-added every ``window // 2`` samples with a Hann
window (which sums to one at that overlap). The frame for output position ``k * hop`` is read from
the input near ``k * hop * speed``: within ``tolerance`` samples of it, where it best continues the
previous frame (the highest cross-correlation with the input that followed the previous frame).
So the waveform stays continuous while the frames skip (speed > 1) or repeat (speed < 1) input.

Streaming: ``process(samples)`` returns what can be made with the input so far, ``finish()`` the
rest. A frame is made only once all the input it may read has arrived, so the output does not
depend on how the input was cut into chunks.
"""

from __future__ import annotations

import numpy as np


class TimeStretch:
    def __init__(self, speed: float, sample_rate: int, *, window_ms: float = 30.0, tolerance_ms: float = 8.0):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self.window = max(16, int(sample_rate * window_ms / 1000) // 2 * 2)
        self.hop = self.window // 2
        self.tolerance = int(sample_rate * tolerance_ms / 1000)
        self._weights = np.hanning(self.window + 1)[:-1].astype(np.float64)  # periodic: sums to 1 at 50 %
        self._input = np.zeros(0, dtype=np.float64)
        self._offset = 0  # input samples dropped from the front of _input
        self._frame = 0  # the next output frame
        self._previous_start: int | None = None  # input position of the previous frame
        self._tail = np.zeros(self.hop, dtype=np.float64)  # the previous frame's second half, windowed
        self._emitted = 0  # output samples given out

    def _start(self, frame: int) -> int:
        """The input position the frame is read from (chosen for continuity)."""
        nominal = int(round(frame * self.hop * self.speed))
        if self._previous_start is None:
            return nominal
        natural = self._previous_start + self.hop  # what would follow the previous frame
        target = self._input[natural - self._offset:natural - self._offset + self.window]
        lo = max(0, nominal - self.tolerance)
        hi = nominal + self.tolerance
        segment = self._input[lo - self._offset:hi - self._offset + self.window]
        if target.size < self.window or segment.size < self.window:
            return nominal
        scores = np.correlate(segment, target, mode="valid")
        return lo + int(np.argmax(scores))

    def _ready(self, frame: int) -> bool:
        """Whether all the input this frame may read has arrived."""
        nominal = int(round(frame * self.hop * self.speed))
        needed = max(nominal + self.tolerance, (self._previous_start or 0) + self.hop) + self.window
        return needed <= self._offset + self._input.size

    def _make(self, frame: int) -> np.ndarray:
        start = self._start(frame)
        piece = self._input[start - self._offset:start - self._offset + self.window]
        if piece.size < self.window:
            piece = np.concatenate([piece, np.zeros(self.window - piece.size)])
        windowed = piece * self._weights
        out = self._tail + windowed[:self.hop]
        self._tail = windowed[self.hop:].copy()
        self._previous_start = start
        # Input before the earliest position a later frame may read is no longer needed.
        keep_from = min(start + self.hop, int(round((frame + 1) * self.hop * self.speed)) - self.tolerance)
        drop = max(0, keep_from - self._offset)
        if drop:
            self._input = self._input[drop:]
            self._offset += drop
        return out

    def process(self, samples: np.ndarray) -> np.ndarray:
        self._input = np.concatenate([self._input, np.asarray(samples, dtype=np.float64)])
        out = []
        while self._ready(self._frame):
            out.append(self._make(self._frame))
            self._frame += 1
        result = np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)
        self._emitted += result.size
        return result

    def finish(self) -> np.ndarray:
        """The rest, up to the stretched length of all the input (round(input / speed) samples)."""
        length = int(round((self._offset + self._input.size) / self.speed))
        out = []
        while self._emitted + sum(o.size for o in out) < length:
            out.append(self._make(self._frame))
            self._frame += 1
        out.append(self._tail)
        self._tail = np.zeros(self.hop)
        result = np.concatenate(out).astype(np.float32)[:max(0, length - self._emitted)]
        self._emitted += result.size
        return result

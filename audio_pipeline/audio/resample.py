"""A streaming resampler whose output keeps up with its input: a windowed-sinc polyphase filter at
the rates' rational ratio, linear phase, holding back a fixed 2 ms or so.

A block resampler (soxr's stream) returns its output in blocks: fed 40 ms chunks at 16 kHz, it
held back 9 to 22 ms of each at 24 kHz, and a listener whose first chunks are that short runs
out of audio while the rest waits in the resampler. Here every input sample is out as soon as
the filter's half length past it has arrived; the last call flushes the rest, and the whole
stream comes out the same however it was cut into chunks. The filtering is scipy's ``upfirdn``
(C, no Python per sample) over the new input and the little history the filter reaches back to.
"""

from __future__ import annotations

import logging
from math import gcd

import numpy as np

logger = logging.getLogger(__name__)


def scipy_signal():
    """scipy.signal, imported on first use: its import takes 0.3 to 1 s and a server whose streams
    keep the model's rate never needs it (the server imports it in a thread while it warms up:
    :func:`preload`, so no request pays it on the event loop)."""
    from scipy import signal

    return signal


def preload() -> None:
    """Imports scipy.signal ahead of the first resampling stream; where scipy is missing (it is a
    dependency: a broken install) the server still serves the model's own rate, and says so."""
    try:
        scipy_signal()
    except ImportError as exc:
        logger.warning("scipy.signal cannot be imported (%s): streams at other sample rates will fail", exc)


#: Filter length in samples of the lower of the two rates: a transition band of about 1.25 kHz
#: at 16 kHz; the stream is delayed by half of it (2 ms at 16 kHz).
TAPS = 64
#: Kaiser window shape (about 80 dB of stopband attenuation).
BETA = 8.0
#: The passband edge as a fraction of the lower rate's Nyquist frequency.
CUTOFF = 0.92


class StreamResampler:
    """``in_rate`` to ``out_rate`` mono float32, chunk by chunk (:meth:`process`, then
    :meth:`finish` once): ``ceil(n * out_rate / in_rate)`` samples in all for ``n`` in.

    Output sample ``n`` is the filtered, upsampled stream at ``n * down + delay`` (``delay``: the
    filter's half length, so the filter is centred: linear phase, no shift). The filter is padded in
    front so that its delay is a multiple of ``down``: then every window of input that starts at a
    multiple of ``down`` meets the filter in the same phase as the whole stream does."""

    def __init__(self, in_rate: int, out_rate: int, taps: int = TAPS):
        divisor = gcd(in_rate, out_rate)
        self.up, self.down = out_rate // divisor, in_rate // divisor
        self.in_rate = in_rate
        # ``taps`` per sample of the lower rate; odd, so the group delay is whole upsampled samples.
        length = taps * max(self.up, self.down) + 1
        cutoff = CUTOFF * min(in_rate, out_rate) / 2
        signal = scipy_signal()
        self._upfirdn = signal.upfirdn
        h = signal.firwin(length, cutoff, window=("kaiser", BETA), fs=in_rate * self.up) * self.up
        half = (length - 1) // 2
        pad = -half % self.down
        self._filter = np.concatenate([np.zeros(pad), h]).astype(np.float32)
        self._centre = half  # the delay the output removes
        self._delay = half + pad  # the padded filter's: a multiple of down
        # Input held from global index _start (a multiple of down; negative: zeros before the stream).
        reach = -(-self._filter.size // self.up) + self.down
        self._start = -(-reach // self.down) * self.down
        self._start = -self._start
        self._buffer = np.zeros(-self._start, dtype=np.float32)
        self._received = 0
        self._next = 0  # the next output sample's index

    @property
    def delay_seconds(self) -> float:
        """What the filter holds back (its half length), in seconds."""
        return self._centre / self.up / self.in_rate

    def process(self, samples: np.ndarray) -> np.ndarray:
        """The output samples the input so far determines (float32)."""
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        self._buffer = np.concatenate([self._buffer, samples])
        self._received += samples.size
        end = self._start + self._buffer.size  # one past the last input index held
        # Output n reaches the input up to (n * down + delay) // up.
        count = (end * self.up - 1 - self._delay) // self.down + 1
        return self._emit(count)

    def finish(self) -> np.ndarray:
        """The rest: every output sample the stream has, its end padded with silence."""
        total = -(-self._received * self.up // self.down)
        tail = -(-self._filter.size // self.up) + self.down
        self._buffer = np.concatenate([self._buffer, np.zeros(tail, dtype=np.float32)])
        return self._emit(total)

    def _emit(self, count: int) -> np.ndarray:
        if count <= self._next:
            return np.zeros(0, dtype=np.float32)
        # The window's first output is the stream's sample at upsampled index _start * up.
        first = (self._delay - self._start * self.up) // self.down + self._next
        out = self._upfirdn(self._filter, self._buffer, self.up, self.down)[first:first + count - self._next]
        self._next = count
        # Keep, from a multiple of down, what the next output's filter reaches back to.
        oldest = (self._next * self.down + self._delay - (self._filter.size - 1)) // self.up
        keep_from = (oldest // self.down) * self.down
        drop = max(0, min(keep_from - self._start, self._buffer.size))
        drop -= drop % self.down
        self._buffer, self._start = self._buffer[drop:], self._start + drop
        return out.astype(np.float32, copy=False)

"""The streaming resampler: the same output however the stream is cut, the length of a one-shot
resample, the speech band as an independent resampler passes it, and output that keeps up with
its input (a fixed 2 ms held back, where a block resampler held back up to 22 ms of a 40 ms chunk)."""

import numpy as np
import pytest
from scipy.signal import butter, resample_poly, sosfiltfilt

from audio_pipeline.audio.resample import StreamResampler

RATES = [(16000, 24000), (24000, 16000), (16000, 44100), (24000, 8000), (16000, 48000)]


def band_limited(rate: int, band: float, seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0, 0.1, int(rate * seconds))
    return sosfiltfilt(butter(10, band, fs=rate, output="sos"), noise).astype(np.float32)


@pytest.mark.parametrize("rates", RATES)
def test_a_stream_cut_anyhow_is_resampled_as_one_piece_to_the_one_shot_length(rates):
    a, b = rates
    signal = band_limited(a, 0.4 * min(a, b))
    whole = StreamResampler(a, b)
    one = np.concatenate([whole.process(signal), whole.finish()])
    assert one.size == -(-signal.size * b // a)
    rng = np.random.default_rng(1)
    streamed, pieces, start = StreamResampler(a, b), [], 0
    while start < signal.size:
        size = int(rng.integers(0, 1500))  # empty pieces too
        pieces.append(streamed.process(signal[start:start + size]))
        start += size
    pieces.append(streamed.finish())
    assert np.array_equal(np.concatenate(pieces), one)


@pytest.mark.parametrize("rates", RATES)
def test_the_speech_band_comes_out_as_an_independent_resampler_gives_it(rates):
    a, b = rates
    signal = band_limited(a, 0.8 * min(a, b) / 2)
    resampler = StreamResampler(a, b)
    ours = np.concatenate([resampler.process(signal), resampler.finish()])
    divisor = np.gcd(a, b)
    theirs = resample_poly(signal.astype(np.float64), b // divisor, a // divisor)
    edge = b // 50  # both pad the ends differently
    error = ours[edge:-edge] - theirs[edge:ours.size - edge]
    assert np.sqrt(np.mean(error ** 2)) < 10 ** (-40 / 20) * np.sqrt(np.mean(theirs ** 2))


def test_each_chunk_comes_out_at_once_but_for_the_filters_fixed_half_length():
    resampler = StreamResampler(16000, 24000)
    held = resampler.delay_seconds
    assert held <= 0.0025
    fed = out = 0
    for _ in range(20):  # 40 ms chunks, as a stream's first chunks are
        out += resampler.process(np.zeros(640, dtype=np.float32)).size
        fed += 640
        assert fed * 1.5 - out <= held * 24000 + 2
    assert out + resampler.finish().size == fed * 1.5

"""Streaming time-stretch (WSOLA): the length follows the speed, the pitch stays, and the output
does not depend on how the input was cut into chunks."""

import numpy as np
import pytest

from audio_pipeline.audio.stretch import TimeStretch

RATE = 24000


def tone(seconds=2.0, pitch=180.0):
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.5 * np.sin(2 * np.pi * pitch * t) + 0.2 * np.sin(2 * np.pi * 3 * pitch * t)).astype(np.float32)


def peak_frequency(samples):
    middle = samples[2000:-2000]
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(middle.size)))
    return np.argmax(spectrum) * RATE / middle.size


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_the_length_follows_the_speed_and_the_pitch_stays(speed):
    x = tone()
    stretch = TimeStretch(speed, RATE)
    out = np.concatenate([stretch.process(x), stretch.finish()])
    assert out.size == round(x.size / speed)
    assert peak_frequency(out) == pytest.approx(180.0, abs=2.0)
    assert np.abs(out).max() <= 0.75  # overlap-add at 50 % with a Hann window keeps the level


@pytest.mark.parametrize("pieces", [1, 7, 50, 333])
def test_streamed_output_equals_one_shot(pieces):
    x = tone(1.3)
    whole = TimeStretch(1.7, RATE)
    expected = np.concatenate([whole.process(x), whole.finish()])
    chunked = TimeStretch(1.7, RATE)
    out = np.concatenate([chunked.process(p) for p in np.array_split(x, pieces)] + [chunked.finish()])
    np.testing.assert_array_equal(out, expected)


def test_a_continuous_tone_stays_continuous():
    """No clicks at frame seams: the stretched tone's sample-to-sample steps stay those of a tone."""
    x = tone(1.0)
    stretch = TimeStretch(1.5, RATE)
    out = np.concatenate([stretch.process(x), stretch.finish()])[1000:-1000]
    assert np.abs(np.diff(out)).max() < 1.5 * np.abs(np.diff(x)).max()

"""The lpc decoder (the built-in voice's codec): frame layout, exact block-causal streaming, checks."""

import numpy as np
import pytest
import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.lpc import save_lpc_decoder
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows
from vocoder_checks import assert_frames_are_four_codes_and_twenty_milliseconds


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    rng = np.random.default_rng(0)
    codebook = rng.normal(0, 0.8, size=(64, 16))  # any log-area ratios give a stable filter
    return load_audio_decoder("lpc", str(save_lpc_decoder(tmp_path_factory.mktemp("lpc"), codebook)))


def codes(frames=30, seed=0):
    rng = np.random.default_rng(seed)
    f0 = np.where(rng.random(frames) < 0.3, 0, rng.integers(1, 32, frames))
    rows = np.stack([rng.integers(0, 90, frames), rng.integers(0, 20, frames), rng.integers(0, 64, frames),
                     f0 * 32 + rng.integers(10, 30, frames)], axis=1)
    return torch.from_numpy(rows.reshape(-1))


def test_a_frame_is_four_codes_and_twenty_milliseconds(decoder):
    """30 frames are 30 x 320 samples at 16 kHz, and frame k's codes sound from sample 320 k on,
    never before: with its envelope code changed, the audio before it stays as it was and its own
    20 ms change."""
    assert_frames_are_four_codes_and_twenty_milliseconds(decoder, codes(30))


@pytest.mark.parametrize("chunk_size", [[4], [8, 16], [40]])
def test_block_causal_streaming_equals_one_shot_exactly(decoder, chunk_size):
    tokens = codes(25, seed=1)
    stream = DecoderStream(decoder, chunk_size=chunk_size, block_causal=True)
    parts, known = [], 0
    while True:
        known = min(known + 12, tokens.numel())
        finished = known == tokens.numel()
        while (window := stream.next_window(known, finished)) is not None:
            parts.append(decode_windows(decoder, [(stream, window, tokens[window.start:window.end])])[0])
        if finished:
            break
    torch.testing.assert_close(torch.cat(parts), decoder.decode(tokens), atol=1e-6, rtol=0)


def test_the_alignment_slots_do_not_change_the_audio(decoder):
    a = codes(10, seed=2)
    b = a.clone()
    b[0::4] = 7
    b[1::4] = 3
    torch.testing.assert_close(decoder.decode(a), decoder.decode(b))


def test_codes_out_of_range_are_refused(decoder):
    bad = codes(3)
    bad[2] = 64  # envelope codebook has 64 entries
    with pytest.raises(ValueError, match="frame position 2"):
        decoder.decode(bad)
    bad = codes(3)
    bad[3] = 32 * 32  # prosody: 31 F0 levels + unvoiced, times 32 gain levels
    with pytest.raises(ValueError, match="frame position 3"):
        decoder.decode(bad)
    with pytest.raises(ValueError, match="whole number of 4-code frames"):
        decoder.decode(codes(3)[:-1])


def test_missing_weights_are_reported(tmp_path):
    with pytest.raises(ValueError, match="envelope_codebook.npy"):
        load_audio_decoder("lpc", str(tmp_path))

"""Checks shared by the project's own vocoders' tests (lpc, mcep): both speak 4-code frames of
320 samples at 16 kHz."""

from __future__ import annotations

import torch


def assert_frames_are_four_codes_and_twenty_milliseconds(decoder, tokens: torch.Tensor) -> None:
    """30 frames of ``tokens`` are 30 x 320 samples at 16 kHz, and frame k's codes sound from
    sample 320 k on, never before: with its envelope code changed, the audio before it stays as it
    was and its own 20 ms change."""
    audio = decoder.decode(tokens)
    assert decoder.tokens_per_frame == 4 and decoder.sample_rate == 16000 and decoder.samples_per_frame == 320
    assert audio.shape == (30 * 320,) and audio.dtype == torch.float32
    assert 0 < audio.abs().max() <= 1 and torch.isfinite(audio).all()
    for k in (0, 7, 29):
        changed = tokens.clone().view(30, 4)
        changed[k, 2] = (changed[k, 2] + 17) % 64
        other = decoder.decode(changed.reshape(-1))
        torch.testing.assert_close(other[:320 * k], audio[:320 * k], rtol=0, atol=0)
        assert (other[320 * k:320 * (k + 1)] - audio[320 * k:320 * (k + 1)]).abs().max() > 1e-3, k

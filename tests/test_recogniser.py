"""The voice recipe's judge (recipes/builtin_voice/evaluate.py): pocketsphinx hears each utterance
as a fresh decoder would, whatever it heard before, so a voice's figures do not depend on the order
of its sentences."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pocketsphinx")

from audio_pipeline.text.espeak import espeak  # noqa: E402
from recipes.builtin_voice.evaluate import _pcm16, recogniser  # noqa: E402

SENTENCE = "the quick brown fox jumps over the lazy dog"


def _spoken(text: str) -> bytes:
    utterance = espeak().synthesize(text)
    return _pcm16(utterance.samples, utterance.sample_rate)


def _noise() -> bytes:
    """Four seconds of loud noise: a decoder that carried its features' running mean over would
    hear the next sentence differently."""
    return _pcm16(np.random.default_rng(0).normal(0, 0.3, 4 * 16000).astype(np.float32), 16000)


def test_an_utterance_is_heard_as_a_fresh_decoder_hears_it_after_any_other():
    sentence = _spoken(SENTENCE)
    fresh = recogniser()(sentence)
    assert fresh
    recognise = recogniser()
    recognise(_noise())
    assert recognise(sentence) == fresh

"""eSpeak NG for the recipe: the engine's own front-end (audio_pipeline/text/espeak.py),
used here with its audio kept, as the training speech."""

from __future__ import annotations

from audio_pipeline.text.espeak import Utterance, espeak, frame_count, phoneme_frames

__all__ = ["ESpeak", "Utterance", "frame_count", "phoneme_frames"]


def ESpeak():  # noqa: N802 - the recipe's scripts construct it like a class
    """The process's eSpeak NG engine (US English)."""
    return espeak()

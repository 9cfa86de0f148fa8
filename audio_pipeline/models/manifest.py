"""The optional `audio_pipeline.json` beside a model: its family, voices and audio decoder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from audio_pipeline.models import orpheus

MANIFEST_NAME = "audio_pipeline.json"


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    description: str = ""
    language: str = "en-US"


@dataclass(frozen=True)
class ModelManifest:
    """What the engine needs to know about a model beyond its Hugging Face files."""

    family: str = "orpheus"
    description: str = ""
    voices: tuple[VoiceInfo, ...] = field(default_factory=tuple)
    default_voice: str | None = None
    audio_decoder: str | None = None
    #: Decoder weights, relative to the model directory.
    audio_decoder_weights: str | None = None

    @classmethod
    def read(cls, model_dir: Path) -> "ModelManifest":
        """The manifest of ``model_dir``; Orpheus defaults (its preset voices) when there is none."""
        path = model_dir / MANIFEST_NAME
        if not path.is_file():
            return cls(voices=tuple(VoiceInfo(v, f"Orpheus preset voice {v}") for v in orpheus.ORPHEUS_VOICES),
                       default_voice=orpheus.ORPHEUS_VOICES[0])
        try:
            data = json.loads(path.read_text())
            voices = tuple(VoiceInfo(**v) for v in data.pop("voices", []))
            manifest = cls(voices=voices, **data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: invalid model manifest: {exc}") from exc
        if manifest.family != "orpheus":
            raise ValueError(f"{path}: unsupported model family {manifest.family!r} (supported: orpheus)")
        names = [v.name for v in manifest.voices]
        if manifest.default_voice is not None and manifest.default_voice not in names:
            raise ValueError(f"{path}: default_voice {manifest.default_voice!r} is not one of its voices {names}")
        return manifest

    def make_layout(self, model_dir: Path) -> "orpheus.OrpheusLayout":
        """The speech-token layout of this model's family (prompt format, token ids <-> codes).

        A layout provides: ``tokens_per_frame``, ``codebook_size``, ``end_of_speech``,
        ``min_vocab_size``, ``token_range(position)``, ``token_to_code``, ``tokens_to_codes``,
        ``codes_to_tokens`` and ``build_prompt(tokenizer, text, voice)``.
        """
        return orpheus.OrpheusLayout()

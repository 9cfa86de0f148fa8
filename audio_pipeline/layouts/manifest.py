"""The optional `audio_pipeline.json` beside a model: its family, voices and audio decoder."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from audio_pipeline.errors import RequestError
from audio_pipeline.layouts.registry import DEFAULT_FAMILY, Family, detect_family, family_voices, get_family
from audio_pipeline.layouts.voice_info import VoiceInfo
from audio_pipeline.text.languages import AUTO, SpokenLanguages

if TYPE_CHECKING:
    from audio_pipeline.layouts.base import Layout

MANIFEST_NAME = "audio_pipeline.json"
#: Streaming settings a manifest may name (``streaming``), used where the configuration sets none.
STREAMING_KEYS = ("chunk_size", "buffer", "block_causal", "prepend_prompt_speech_tokens")


@dataclass(frozen=True)
class ModelManifest:
    """What the engine needs to know about a model beyond its Hugging Face files."""

    family: str = DEFAULT_FAMILY
    description: str = ""
    voices: tuple[VoiceInfo, ...] = field(default_factory=tuple)
    default_voice: str | None = None
    audio_decoder: str | None = None
    #: Decoder weights, relative to the model directory.
    audio_decoder_weights: str | None = None
    #: Streaming defaults for this model (chunk_size, buffer, block_causal, prepend), below every
    #: configuration source: the manifest's ``streaming``, else its family's.
    streaming: dict = field(default_factory=dict)
    #: Settings of the family's layout (its record's ``layout_options`` says which it takes; the
    #: phoneme-lpc families' text front end among them).
    layout_options: dict = field(default_factory=dict)
    #: The languages the model speaks (names, ISO 639 codes or BCP 47 tags: English, en, en-US);
    #: None: the checkpoint's own list where it has one (Qwen3-TTS), else its family's declaration
    #: (layouts/registry.py). A request's ``language`` must name one of them, or auto.
    languages: tuple[str, ...] | None = None
    #: The directory holds no language model checkpoint: its weights are drawn at load (a random
    #: model of a real shape, for benchmarks; testing/random_models.py).
    random_weights: bool = False

    @classmethod
    def read(cls, model_dir: Path) -> "ModelManifest":
        """The manifest of ``model_dir``; when there is none, the detected family's defaults (its
        preset voices and decoder)."""
        path = model_dir / MANIFEST_NAME
        if not path.is_file():
            family = detect_family(model_dir)
            voices, default = family_voices(family, model_dir)
            return cls(family=family.name, voices=voices, default_voice=default, audio_decoder=family.decoder,
                       audio_decoder_weights=family.decoder_weights, streaming=dict(family.streaming))
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("the manifest must be a JSON object")
            names_voices = "voices" in data
            names_streaming = "streaming" in data
            # Manifests written before the front end became a layout option name it at the top.
            moved = {key: data.pop(key) for key in ("front_end", "front_end_dir") if key in data}
            if moved:
                data["layout_options"] = {**moved, **data.get("layout_options", {})}
            voices = tuple(VoiceInfo(**v) for v in data.pop("voices", []))
            languages = data.pop("languages", None)
            if languages is not None and (not isinstance(languages, list)
                                          or not all(isinstance(v, str) and v.strip() for v in languages)):
                raise ValueError("languages must be a list of language names, codes or tags")
            manifest = cls(voices=voices, languages=None if languages is None else tuple(languages), **data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: invalid model manifest: {exc}") from exc
        unknown = set(manifest.streaming) - set(STREAMING_KEYS)
        if unknown:
            raise ValueError(f"{path}: unknown streaming settings {sorted(unknown)} "
                             f"(known: {', '.join(STREAMING_KEYS)})")
        try:
            family = get_family(manifest.family)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if manifest.audio_decoder is None and family.decoder is not None:  # the family's own codec
            manifest = dataclasses.replace(manifest, audio_decoder=family.decoder,
                                           audio_decoder_weights=manifest.audio_decoder_weights or family.decoder_weights)
        if not names_streaming:  # the family's streaming defaults, where the manifest names none
            manifest = dataclasses.replace(manifest, streaming=dict(family.streaming))
        if not names_voices:  # the family's presets, where the manifest names none
            voices, default = family_voices(family, model_dir)
            manifest = dataclasses.replace(manifest, voices=voices, default_voice=manifest.default_voice or default)
        unknown = set(manifest.layout_options) - set(family.layout_options)
        if unknown:
            known = ", ".join(family.layout_options) or "none"
            raise ValueError(f"{path}: unknown layout_options {sorted(unknown)} for the {family.name} family "
                             f"(known: {known})")
        names = [v.name for v in manifest.voices]
        if manifest.default_voice is not None and manifest.default_voice not in names:
            raise ValueError(f"{path}: default_voice {manifest.default_voice!r} is not one of its voices {names}")
        return manifest

    @property
    def family_record(self) -> Family:
        """The family's declaration (layouts/registry.py)."""
        return get_family(self.family)

    def spoken_languages(self, layout: "Layout") -> SpokenLanguages:
        """The languages the model speaks, as its ``layout`` takes them: the manifest's
        ``languages`` (where the checkpoint lists its own, each must be one of them), else the
        checkpoint's own list, else the family's declaration. ValueError naming the manifest's
        field where it names what the model cannot speak."""
        own = layout.spoken_languages()
        if self.languages is None:
            return SpokenLanguages(tuple(own) if own is not None else tuple(self.family_record.languages))
        declared = SpokenLanguages(tuple(entry for entry in self.languages if entry.strip().lower() != AUTO))
        if own is None:
            declared.check(f"{MANIFEST_NAME}: languages")
            return declared
        checkpoint, entries = SpokenLanguages(tuple(own)), []
        for entry in declared.entries:
            try:
                entries.append(checkpoint.resolve(entry))
            except RequestError:
                raise ValueError(f"{MANIFEST_NAME}: languages: {entry!r} is not one of the checkpoint's: "
                                 f"{checkpoint.listing()}") from None
        return SpokenLanguages(tuple(entries))

    def make_layout(self, model_dir: Path, tokenizer=None) -> "Layout":
        """The speech-token layout of this model's family (prompt format, token ids <-> codes:
        layouts/base.py); ``tokenizer`` is the model's own (read from ``model_dir`` where a family
        needs it and none is given)."""
        return self.family_record.make_layout(Path(model_dir), tokenizer, self.layout_options)


def declared_manifest(model_path: str) -> ModelManifest | None:
    """The manifest of the model at ``model_path`` (a directory or ``builtin:NAME``), read as the
    engine reads it but without loading or writing anything: what the configuration takes the
    model's defaults from. None where there is no such directory yet (a test model written on
    first use) or its manifest is invalid (the engine reports that when it loads the model)."""
    if model_path.startswith("builtin:"):
        from audio_pipeline.builtin import SHIPPED_MODELS, shipped_model_dir

        name = model_path.removeprefix("builtin:")
        if name not in SHIPPED_MODELS:  # the test models written on first use are Orpheus-layout
            return None
        try:
            directory = shipped_model_dir(name)
        except FileNotFoundError:
            return None
    else:
        directory = Path(model_path).expanduser()
    if not directory.is_dir():
        return None
    try:
        return ModelManifest.read(directory)
    except (OSError, ValueError):
        return None


def declared_defaults(model_path: str) -> tuple[str | None, dict, dict]:
    """What the model at ``model_path`` declares for the configuration, from one reading of its
    manifest: its audio decoder, its streaming defaults (only the known settings) and its
    family's sampling defaults; the default family's where the manifest cannot be read."""
    manifest = declared_manifest(model_path)
    if manifest is None:
        family = get_family(DEFAULT_FAMILY)
        return family.decoder, dict(family.streaming), dict(family.sampling)
    streaming = {k: v for k, v in manifest.streaming.items() if k in STREAMING_KEYS}
    return manifest.audio_decoder, streaming, dict(manifest.family_record.sampling)


def declared_audio_decoder(model_path: str) -> str | None:
    """The audio decoder the model at ``model_path`` speaks with: its manifest's, else its
    family's, or None."""
    return declared_defaults(model_path)[0]

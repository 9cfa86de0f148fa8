"""Model families: each declares, in one record, everything the engine needs to serve it.

A family's module (``layouts/<family>.py``) defines its layout and registers a :class:`Family`:
how to build the layout, how to recognise a checkpoint of the family that comes without a
manifest, its preset voices, its audio decoder, and its streaming and sampling defaults. The
manifest (``layouts/manifest.py``) and the configuration only look families up here; nothing
else names a family. Built-in families' modules are imported on first lookup, as the audio
decoders' are (``decoders/registry.py``).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from audio_pipeline.layouts.voice_info import VoiceInfo

if TYPE_CHECKING:
    from audio_pipeline.layouts.base import Layout


@dataclass(frozen=True)
class Family:
    """One model family's declaration."""

    name: str
    #: ``(model_dir, tokenizer, layout_options) -> Layout``; the tokenizer is the model's own (None:
    #: the factory reads it from ``model_dir`` where it needs one), the options its manifest's
    #: ``layout_options`` (checked against the keys below; the factory checks their values).
    make_layout: Callable[[Path, Any, Mapping[str, Any]], "Layout"]
    #: ``(config.json as a dict, model_dir) -> bool``: a checkpoint without a manifest is of this
    #: family. None: only a manifest names it. The first family (in registration order) whose
    #: ``detect`` says yes wins; a checkpoint none claims is of DEFAULT_FAMILY.
    detect: Callable[[dict, Path], bool] | None = None
    #: Preset voices and the default one (else the first), for a checkpoint whose manifest names
    #: none; ``preset_voices(model_dir)`` reads them from the checkpoint where they are its own.
    voices: tuple[VoiceInfo, ...] = ()
    default_voice: str | None = None
    preset_voices: Callable[[Path], tuple[VoiceInfo, ...]] | None = None
    #: The audio decoder the family speaks with, and where its weights are relative to the model
    #: directory (None: the decoder's own default); a manifest's ``audio_decoder`` wins.
    decoder: str | None = None
    decoder_weights: str | None = None
    #: Streaming settings (chunk_size, buffer, block_causal, prepend_prompt_speech_tokens) used
    #: where neither the configuration nor the manifest sets them.
    streaming: Mapping[str, Any] = field(default_factory=dict)
    #: Sampling defaults where the reference implementation samples otherwise than the
    #: configuration's defaults (below every source).
    sampling: Mapping[str, Any] = field(default_factory=dict)
    #: The languages the family's checkpoints speak: names, ISO 639 codes or BCP 47 tags
    #: (text/languages.py). A checkpoint that lists its own (the layout's ``spoken_languages``:
    #: Qwen3-TTS) speaks those instead, and a manifest's ``languages`` wins over both. A request's
    #: ``language`` must name one of them, or auto.
    languages: tuple[str, ...] = ("en",)
    #: Settings of the family's layout a manifest may give (``layout_options``; the factory reads
    #: them from the manifest), with what each does.
    layout_options: Mapping[str, str] = field(default_factory=dict)
    #: ``(model_dir) -> tokenizer``: the family's own text tokenizer, for checkpoints that do not
    #: ship one transformers reads (None: transformers' AutoTokenizer, or the plain vocabulary).
    tokenizer: Callable[[Path], Any] | None = None
    #: The family's checkpoints are plain Llamas whose layout reads only the tokenizer's vocabulary
    #: (the project's own voices): the engine reads config.json and tokenizer.json without
    #: transformers (checkpoints/plain_config.py), about 77 MiB less resident memory.
    plain_checkpoint: bool = False


#: The family of a checkpoint that nothing else claims.
DEFAULT_FAMILY = "orpheus"
_FAMILIES: dict[str, Family] = {}
#: Built-in families and their modules, in detection order (the more specific first).
_BUILTIN_MODULES = {"csm": "audio_pipeline.layouts.csm", "qwen3-tts": "audio_pipeline.layouts.qwen3_tts",
                    "kyutai-tts": "audio_pipeline.layouts.kyutai_tts",
                    "maya1": "audio_pipeline.layouts.maya1",
                    "neutts": "audio_pipeline.layouts.neutts", "phoneme-lpc": "audio_pipeline.layouts.phoneme_lpc",
                    "phoneme-lpc-frame": "audio_pipeline.layouts.phoneme_lpc_frame",
                    "orpheus": "audio_pipeline.layouts.orpheus"}


def family_voices(family: Family, model_dir: Path) -> tuple[tuple[VoiceInfo, ...], str | None]:
    """The family's preset voices for the checkpoint in ``model_dir``, and the default one."""
    voices = family.preset_voices(Path(model_dir)) if family.preset_voices is not None else family.voices
    default = family.default_voice or (voices[0].name if voices else None)
    return voices, default


def register_family(family: Family) -> Family:
    """Makes ``family`` available under its name (a second family of that name is refused)."""
    existing = _FAMILIES.get(family.name)
    if existing is not None and existing is not family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def available_families() -> list[str]:
    """Names a manifest's ``family`` may take."""
    return sorted(set(_FAMILIES) | set(_BUILTIN_MODULES))


def get_family(name: str) -> Family:
    """The family registered as ``name``; ValueError naming the choices otherwise."""
    if name not in _FAMILIES and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unsupported model family {name!r} (supported: {', '.join(available_families())})") from None


def detect_family(model_dir: Path) -> Family:
    """The family of a checkpoint that comes without a manifest, from its ``config.json`` (and
    its directory's name where a family's checkpoints are known by it): built-in families in
    their order, then the others as registered."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    for name in _BUILTIN_MODULES:
        get_family(name)
    for name in [*_BUILTIN_MODULES, *(name for name in _FAMILIES if name not in _BUILTIN_MODULES)]:
        family = _FAMILIES[name]
        if family.detect is not None and family.detect(config, Path(model_dir)):
            return family
    return get_family(DEFAULT_FAMILY)

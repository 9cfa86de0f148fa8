"""Name -> AudioDecoder class registry, and the loader used by the pipeline and the CLI."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from audio_pipeline.decoders.base import AudioDecoder

_DECODERS: dict[str, type[AudioDecoder]] = {}
# Built-in decoders, imported on first lookup so that reading the registry stays cheap.
_BUILTIN_MODULES = {"snac": "audio_pipeline.decoders.snac", "causal-conv": "audio_pipeline.decoders.causal_conv",
                    "lpc": "audio_pipeline.decoders.lpc", "mcep": "audio_pipeline.decoders.mcep",
                    "mimi": "audio_pipeline.decoders.mimi", "neucodec": "audio_pipeline.decoders.neucodec",
                    "qwen3-tts-12hz": "audio_pipeline.decoders.qwen3_tts_12hz"}


def register_audio_decoder(cls: type[AudioDecoder]) -> type[AudioDecoder]:
    """Class decorator: makes ``cls`` available under ``cls.name``."""
    existing = _DECODERS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"audio decoder {cls.name!r} is already registered by {existing.__qualname__}")
    _DECODERS[cls.name] = cls
    return cls


def available_audio_decoders() -> list[str]:
    """Names accepted by ``audio_decoder``."""
    return sorted(set(_DECODERS) | set(_BUILTIN_MODULES))


def audio_decoder_class(name: str) -> type[AudioDecoder]:
    """The class registered as ``name``; ValueError naming the choices otherwise."""
    if name not in _DECODERS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _DECODERS[name]
    except KeyError:
        raise ValueError(
            f"unknown audio_decoder {name!r}; available: {', '.join(available_audio_decoders())}"
        ) from None


def load_audio_decoder(name: str, weights: str, config: dict[str, Any] | None = None, *,
                       device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> AudioDecoder:
    """Loads decoder ``name`` from ``weights`` (a local directory or file)."""
    return audio_decoder_class(name).load(weights, config, device=device, dtype=dtype)

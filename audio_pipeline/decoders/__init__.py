"""Audio decoders: the interface, the registry, and the built-in decoders."""

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.registry import (
    audio_decoder_class,
    available_audio_decoders,
    load_audio_decoder,
    register_audio_decoder,
)

__all__ = [
    "AudioDecoder",
    "audio_decoder_class",
    "available_audio_decoders",
    "load_audio_decoder",
    "register_audio_decoder",
]

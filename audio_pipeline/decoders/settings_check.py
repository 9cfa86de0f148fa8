"""The streaming settings an audio decoder can honour, checked against the configuration.

The configuration (config/) knows no decoder: it resolves which decoder a model speaks with and
checks the rules among its own fields. What a decoder takes (whole frames of its
``tokens_per_frame`` codes, block-causal decoding or not) is the decoder's to say, so the check
lives here; the engine runs it before it loads anything, and the command line as it reads the
configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from audio_pipeline.config.settings import problems_message
from audio_pipeline.decoders.registry import audio_decoder_class

if TYPE_CHECKING:
    from audio_pipeline.config import AudioGenerationConfig


def decoder_setting_problems(config: "AudioGenerationConfig") -> list[str]:
    """Each streaming setting of ``config`` its audio decoder cannot honour, named (empty: none)."""
    name = config.resolved_audio_decoder
    try:
        decoder = audio_decoder_class(name)
    except (ValueError, ImportError) as exc:
        return [f"audio_decoder {name!r} cannot be used: {exc}"]
    problems = []
    frame = decoder.tokens_per_frame
    if config.chunk_size is not None and any(size % frame for size in config.chunk_size):
        problems.append(f"chunk_size {config.chunk_size}: every entry must be a multiple of "
                        f"{name}'s {frame} tokens per frame")
    if config.buffer % frame:
        problems.append(f"buffer ({config.buffer}) must be a multiple of {name}'s {frame} tokens per frame")
    try:
        decoder.check_streaming_settings(block_causal=config.block_causal,
                                         prepend_causal=config.prepend_prompt_speech_tokens_causal,
                                         weights=config.audio_decoder_weights or None)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def check_decoder_settings(config: "AudioGenerationConfig") -> "AudioGenerationConfig":
    """``config``, unless its audio decoder cannot honour its streaming settings: then ValueError
    listing every such setting (worded as the configuration's own rules are)."""
    problems = decoder_setting_problems(config)
    if problems:
        raise ValueError(problems_message(problems))
    return config

"""Decides which speech tokens each decoder call gets: the chunk_size schedule, the buffer of left
context, block_causal and the prompt-token prepend modes.

See ../shared/design/streaming.md. Counts are in speech tokens. This module says *which* tokens go
to the decoder; decoders/streaming.py says *how* (one window, or blocks on a cached state).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from audio_pipeline.config import PrependPromptSpeechTokens

PREPEND_MODES = ("never", "once", "rolling")


def prepend_mode(value: PrependPromptSpeechTokens | str) -> str:
    """``never`` / ``once`` / ``rolling`` from the config enum or its value; ValueError otherwise."""
    mode = str(value.value if isinstance(value, Enum) else value).lower()
    if mode not in PREPEND_MODES:
        raise ValueError(f"prepend_prompt_speech_tokens must be one of {', '.join(PREPEND_MODES)}, got {value!r}")
    return mode


@dataclass(frozen=True)
class DecodeWindow:
    """One decoder call: the last ``prompt_tokens`` prompt tokens, then tokens [start, end) of the
    generated stream. The audio of the prompt tokens and of the first ``context_tokens`` generated
    tokens is left context and is dropped."""

    start: int
    end: int
    context_tokens: int
    chunk_index: int
    final: bool
    prompt_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return self.end - self.start - self.context_tokens


class ChunkSchedule:
    """The chunk_size / buffer / block_causal / prepend rules, applied to one stream's progress.

    - chunk ``k`` holds ``chunk_size[min(k, len - 1)]`` new tokens and is due as soon as they exist;
      once generation has finished the remainder is the final chunk. ``None``: one chunk at the end.
    - buffer: ``eff = min(buffer, decoded_index)`` generated tokens of left context.
    - block_causal: no generated context (the decoder's per-stream state holds the past).
    - prepend NEVER: no prompt tokens. ONCE: the whole prompt before chunk 0 only. ROLLING: the
      whole prompt before chunk 0; before a later chunk, while ``eff < buffer``, the last
      ``buffer - eff`` prompt tokens (the window is filled with generated tokens first, the rest from
      the prompt's tail). With block_causal, only chunk 0 gets the prompt: the state keeps it after.
    """

    def __init__(self, chunk_size: list[int] | None, buffer: int = 0, *, block_causal: bool = False,
                 prepend: PrependPromptSpeechTokens | str = "never", prompt_tokens: int = 0):
        if chunk_size is not None and (not chunk_size or min(chunk_size) < 1):
            raise ValueError(f"chunk_size must be None or a non-empty list of positive sizes, got {chunk_size}")
        if buffer < 0:
            raise ValueError(f"buffer must be >= 0, got {buffer}")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        self.chunk_size = list(chunk_size) if chunk_size is not None else None
        self.buffer = buffer
        self.block_causal = block_causal
        self.prepend = prepend_mode(prepend)
        self.prompt_tokens = prompt_tokens

    def chunk_length(self, chunk_index: int) -> int | None:
        """New tokens in chunk ``chunk_index`` (None: no streaming, one chunk at the end)."""
        if self.chunk_size is None:
            return None
        return self.chunk_size[min(chunk_index, len(self.chunk_size) - 1)]

    def prompt_context(self, chunk_index: int, context_tokens: int) -> int:
        """How many of the prompt's last tokens go before chunk ``chunk_index`` as context."""
        if self.prepend == "never" or self.prompt_tokens == 0:
            return 0
        if chunk_index == 0:
            return self.prompt_tokens
        if self.prepend == "rolling" and not self.block_causal:
            return min(self.prompt_tokens, self.buffer - context_tokens)
        return 0

    def next_window(self, generated: int, decoded_index: int, chunk_index: int, finished: bool) -> DecodeWindow | None:
        """The next decode call for a stream with ``generated`` tokens, or None when none is due."""
        pending = generated - decoded_index
        length = self.chunk_length(chunk_index)
        if length is not None and pending >= length and not (finished and pending == length):
            end = decoded_index + length
            final = False
        elif finished and pending > 0:
            end, final = generated, True
        else:
            return None
        context = 0 if self.block_causal else min(self.buffer, decoded_index)
        return DecodeWindow(start=decoded_index - context, end=end, context_tokens=context,
                            chunk_index=chunk_index, final=final,
                            prompt_tokens=self.prompt_context(chunk_index, context))

    def steady_window_lengths(self, tokens: int = 4096) -> list[int]:
        """Generated tokens in each distinct window of a stream that goes on for ``tokens`` tokens
        without finishing (no prompt): the shapes its decoder calls take but for the final chunk's.
        A decoder that captures a call per shape (snac_graphs.py) captures these at start-up."""
        lengths: list[int] = []
        decoded = chunk = 0
        for generated in range(1, tokens + 1):
            window = self.next_window(generated, decoded, chunk, finished=False)
            if window is None:
                continue
            if window.end - window.start not in lengths:
                lengths.append(window.end - window.start)
            decoded, chunk = window.end, chunk + 1
        return lengths

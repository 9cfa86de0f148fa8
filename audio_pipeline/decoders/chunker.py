"""Decides which speech tokens to decode now: the chunk_size schedule and the buffer of left context.

See ../shared/design/streaming.md ("chunk_size", "buffer"). Counts are in speech tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeWindow:
    """One decoder call: tokens [start, end) of the generated stream; audio of the first
    ``context_tokens`` of them is left context and is dropped."""

    start: int
    end: int
    context_tokens: int
    chunk_index: int
    final: bool

    @property
    def new_tokens(self) -> int:
        return self.end - self.start - self.context_tokens


class ChunkSchedule:
    """The chunk_size / buffer rules, applied to one stream's progress."""

    def __init__(self, chunk_size: list[int] | None, buffer: int = 0):
        if chunk_size is not None and (not chunk_size or min(chunk_size) < 1):
            raise ValueError(f"chunk_size must be None or a non-empty list of positive sizes, got {chunk_size}")
        if buffer < 0:
            raise ValueError(f"buffer must be >= 0, got {buffer}")
        self.chunk_size = list(chunk_size) if chunk_size is not None else None
        self.buffer = buffer

    def chunk_length(self, chunk_index: int) -> int | None:
        """New tokens in chunk ``chunk_index`` (None: no streaming, one chunk at the end)."""
        if self.chunk_size is None:
            return None
        return self.chunk_size[min(chunk_index, len(self.chunk_size) - 1)]

    def next_window(self, generated: int, decoded_index: int, chunk_index: int, finished: bool) -> DecodeWindow | None:
        """The next decode call for a stream with ``generated`` tokens, or None when none is due.

        A chunk is due as soon as its full length of undecoded tokens exists; once generation has
        finished, whatever remains is decoded as the final chunk.
        """
        pending = generated - decoded_index
        length = self.chunk_length(chunk_index)
        if length is not None and pending >= length and not (finished and pending == length):
            end = decoded_index + length
            final = False
        elif finished and pending > 0:
            end, final = generated, True
        else:
            return None
        context = min(self.buffer, decoded_index)
        return DecodeWindow(start=decoded_index - context, end=end, context_tokens=context,
                            chunk_index=chunk_index, final=final)

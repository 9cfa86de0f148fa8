"""Live text: pieces of any size (an LLM's tokens) become sentences for a SegmentedSynthesis.

A sentence is spoken once it is complete, which the segmenter knows when the next one has begun;
a flush speaks what has come so far, even an unfinished sentence; the end of input speaks the
rest and closes the synthesis. Segments keep their place in all the text received, so word
timings point into the pieces joined. Every front door with live text (gRPC's SynthesizeStream,
the HTTP WebSocket) feeds text through this.

A model that reads a text stream (Kyutai TTS: SegmentedSynthesis's ``text_stream``) is given every
whole word as soon as the space after it arrives, not whole sentences: it speaks while the text is
still coming. A word whose reading may depend on the word after it, or decide that word's, waits
for it (text/normalize.py's ``reads_with_next``: "7:30 am", "120 m", "$5 million", "in 1847",
"May 5": normalized together); at most the last two such words wait, so a list of numbers still
goes out as it comes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Executor

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.text.normalize import reads_with_next
from audio_pipeline.text.segment import Segment, segments

#: Trailing words held for the next (a year's cue and its number, a number and its unit).
HELD_WORDS = 2


class LiveText:
    """Feeds one synthesis. Callers await one method at a time (a door's reader task), so the
    pieces keep their order; the segmenter runs on ``executor``, off the event loop."""

    def __init__(self, synthesis, *, max_chars: int, max_segment_chars: int, executor: Executor | None = None):
        self.synthesis = synthesis
        self.max_chars = max_chars
        self.max_segment_chars = max_segment_chars
        self.executor = executor
        self.buffer = ""
        self.total = 0
        #: Characters of the text before ``buffer``.
        self.consumed = 0

    async def _speak(self, everything: bool) -> None:
        if self.synthesis.text_stream:
            self._words(everything)
            return
        text = self.buffer
        found = await asyncio.get_running_loop().run_in_executor(self.executor, segments, text,
                                                                 self.max_segment_chars)
        for segment in found if everything else found[:-1]:
            self.synthesis.add_segment(dataclasses.replace(segment, start=segment.start + self.consumed,
                                                           end=segment.end + self.consumed))
        rest = "" if everything or not found else text[found[-1].start:]
        self.consumed += len(text) - len(rest)
        self.buffer = rest

    def _words(self, everything: bool) -> None:
        """The buffer's whole words (all of it with ``everything``; the last ones whose reading
        may go with the next word wait for it) as segments of at most max_segment_chars."""
        text = self.buffer
        cut = len(text) if everything else _after_last_space(text, len(text))
        for _ in range(0 if everything else HELD_WORDS):
            start = _after_last_space(text, cut - 1) if cut else 0
            if not cut or not reads_with_next(text[start:cut]):
                break
            cut = start
        start = 0
        while start < cut:  # pieces of at most max_segment_chars (a request takes whole pieces)
            end = min(cut, start + self.max_segment_chars)
            if end < cut and _after_last_space(text, end) > start:  # at a word's start where one is
                end = _after_last_space(text, end)
            if text[start:end].strip():
                self.synthesis.add_segment(Segment(text[start:end], self.consumed + start, self.consumed + end, 0.0))
            start = end
        self.consumed += cut
        self.buffer = text[cut:]

    async def add(self, text: str) -> None:
        """A piece of text; InvalidArgument (naming ``text``) past the limit of all text."""
        self.total += len(text)
        if self.total > self.max_chars:
            raise InvalidArgument(f"over the limit of {self.max_chars} characters in all", field="text")
        self.buffer += text
        await self._speak(everything=False)

    async def flush(self) -> None:
        """Speak what has come so far."""
        await self._speak(everything=True)

    async def end(self) -> None:
        """No more text: the rest is spoken and the synthesis closed."""
        await self._speak(everything=True)
        self.synthesis.close()


def _after_last_space(text: str, end: int) -> int:
    """Where the word that ends at ``end`` starts: just after the last blank before ``end`` (0: none)."""
    return max(text.rfind(" ", 0, end), text.rfind("\n", 0, end), text.rfind("\t", 0, end)) + 1

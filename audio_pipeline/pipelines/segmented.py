"""A text of any length spoken as one audio stream: segment after segment, the next one already
generating while the current one plays out.

The text is cut into sentences (and long sentences into clauses, :mod:`audio_pipeline.text.segment`);
each segment is one engine request with the same voice and settings. Segment n+1 is prepared (text
front end, off the event loop) and submitted as soon as segment n is, so its prefill and first
frames run while n is still decoding; its audio waits until n's is out. A short silence by the
punctuation separates them. Cancelling the synthesis cancels every segment it submitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.errors import InvalidArgument, ResourceExhausted
from audio_pipeline.pipelines.audio_generation import AudioEvent, Usage
from audio_pipeline.text.segment import Segment, segments

#: How long a continuation segment waits between tries while the engine's queue is full.
REQUEUE_DELAY_S = 0.05


class SegmentedSynthesis:
    """One request: ``prepare(segment text, index)`` makes a segment's engine context (it may raise
    InvalidArgument); :meth:`events` runs the segments and yields one stream of AudioEvents."""

    def __init__(self, engine: Any, text: str, prepare: Callable[[str, int], TTSContext], *,
                 executor: Executor, request_id: str, max_segment_chars: int):
        self.engine = engine
        self.prepare = prepare
        self.executor = executor
        self.request_id = request_id
        self.text = text
        self.max_segment_chars = max_segment_chars
        self.segments: list[Segment] = []
        #: The voice of the first segment (every segment has the same).
        self.voice: str | None = None
        self._submitted: list[TTSContext] = []
        self._tasks: list[asyncio.Task] = []
        self._cancelled = False

    async def _prepare(self, text: str, index: int) -> list[TTSContext]:
        """The contexts of one segment: itself, or its halves when it needs more speech tokens than
        one request may have (cut at the space nearest the middle, again if need be)."""
        loop = asyncio.get_running_loop()
        try:
            return [await loop.run_in_executor(self.executor, self.prepare, text, index)]
        except InvalidArgument as error:
            middle = text.rfind(" ", 0, len(text) // 2 + 1)
            if error.field != "text" or "split the text" not in str(error) or middle <= 0:
                raise
            return await self._prepare(text[:middle], index) + await self._prepare(text[middle + 1:], index)

    async def _submit(self, context: TTSContext, queue: asyncio.Queue, first: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._cancelled:
                raise asyncio.CancelledError
            try:
                self.engine.submit(context, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
                self._submitted.append(context)
                return
            except ResourceExhausted:
                if first:  # the request itself is refused: the caller says so
                    raise
                await asyncio.sleep(REQUEUE_DELAY_S)  # a continuation of an admitted request waits

    async def _start(self, index: int) -> list[tuple[TTSContext, asyncio.Queue]]:
        started = []
        for part, context in enumerate(await self._prepare(self.segments[index].text, index)):
            queue: asyncio.Queue = asyncio.Queue()
            await self._submit(context, queue, first=index == 0 and part == 0)
            started.append((context, queue))
        return started

    async def start(self) -> None:
        """Segments the text and prepares and submits the first segment: what can be refused
        (bad settings, a full queue) is refused here, before any audio."""
        self.segments = await asyncio.get_running_loop().run_in_executor(
            self.executor, segments, self.text, self.max_segment_chars)
        if not self.segments:
            raise InvalidArgument("must not be empty", field="text")
        self._tasks = [asyncio.create_task(self._start(0))]
        try:
            first = await self._tasks[0]
        except BaseException:
            self.cancel()
            raise
        self.voice = first[0][0].voice

    def cancel(self) -> None:
        """Stops every segment (idempotent)."""
        self._cancelled = True
        for task in self._tasks:
            task.cancel()
        for context in self._submitted:
            self.engine.cancel(context.request_id)

    async def events(self) -> AsyncIterator[AudioEvent]:
        """Audio events of every segment in order, silences between them, then one ``complete``
        with the usage of them all. An ``error`` event of a segment ends the stream with it."""
        started_at = time.monotonic()
        sample_rate = self.engine.sample_rate
        prompt_tokens = generated_tokens = audio_samples = 0
        first_audio: float | None = None
        stop_reason = StopReason.END_OF_SPEECH
        chunk_index = 0
        if not self._tasks:
            await self.start()
        for index, segment in enumerate(self.segments):
            parts = await self._tasks[index]
            if index + 1 < len(self.segments):  # the next segment prefills while this one plays out
                self._tasks.append(asyncio.create_task(self._start(index + 1)))
            for context, queue in parts:
                while True:
                    event: AudioEvent = await queue.get()
                    if event.kind == "audio":
                        if first_audio is None:
                            first_audio = time.monotonic() - started_at
                        audio_samples += event.samples.shape[0]
                        yield dataclasses.replace(event, request_id=self.request_id, chunk_index=chunk_index)
                        chunk_index += 1
                        continue
                    if event.kind == "error" or event.stop_reason == StopReason.CANCELLED:
                        yield dataclasses.replace(event, request_id=self.request_id)
                        return
                    usage = event.usage
                    prompt_tokens += usage.prompt_tokens
                    generated_tokens += usage.generated_tokens
                    if event.stop_reason == StopReason.MAX_TOKENS:
                        stop_reason = StopReason.MAX_TOKENS
                    break
            if index + 1 < len(self.segments) and segment.pause > 0:
                silence = np.zeros(int(round(segment.pause * sample_rate)), dtype=np.float32)
                audio_samples += silence.shape[0]
                yield AudioEvent("audio", self.request_id, samples=silence, chunk_index=chunk_index)
                chunk_index += 1
        elapsed = time.monotonic() - started_at
        yield AudioEvent("complete", self.request_id, stop_reason=stop_reason, usage=Usage(
            prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, audio_samples=audio_samples,
            time_to_first_audio_seconds=first_audio if first_audio is not None else elapsed,
            generation_seconds=elapsed))

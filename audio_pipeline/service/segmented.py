"""Text spoken as one audio stream, segment after segment, the next already generating while the
current one plays out.

Segments come from a whole text (:meth:`SegmentedSynthesis.add_text` cuts it into sentences, and
long sentences into clauses, with :mod:`audio_pipeline.text.segment`) or one by one as a live text
arrives (:meth:`add_segment`); :meth:`close` says no more will come. Each segment is one engine
request with the same voice and settings. A segment is prepared (text front end, off the event
loop) and submitted as soon as it is known and the one before it has started, so its prefill and
first frames run while that one is still decoding; its audio waits until the earlier audio is out.
A short silence by the punctuation separates segments. :meth:`cancel` cancels every segment
submitted.

A text stream's model (a layout's ``text_stream``: Kyutai TTS) reads its text as it comes: the
segments are one engine request (a *run*). The first starts it with its words, those of the
segments already known beside them, and the queue left open; each later one's words join it as
they are known (``engine.extend``); the close ends its words, and the model ends the speech after
the last. A run takes words while they fit in what its request may generate (the layout's bound on
the frames words take, a quarter of it kept for waiting on words that have not come): a text too
long for one request goes on in the next run, at a segment's start (a whole text is cut into
sentences for that), its audio after the first's, as a later segment's would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from audio_pipeline.core.request import TTSContext

from audio_pipeline.core.stop import StopReason
from audio_pipeline.audio.stretch import TimeStretch
from audio_pipeline.errors import InvalidArgument, ResourceExhausted
from audio_pipeline.core.engine_core import AudioEvent, Usage
from audio_pipeline.text.segment import Segment, segments
from audio_pipeline.text.timings import WordTiming, segment_timing

#: Characters in the first piece segmented; the rest follows in larger pieces.
HEAD_CHARS = 1000
#: How long a continuation segment waits between tries while the engine's queue is full.
REQUEUE_DELAY_S = 0.05
#: Segments started ahead of the one playing out: enough to hide a segment's prefill and first
#: frames, few enough that a long text does not take the engine's batch from other requests.
LOOKAHEAD = 1

_END = object()
#: The share of a text stream's request kept for frames spent waiting for words (live text).
WAIT_SHARE = 4
#: Put in the started queue by cancel(): whatever waits for the next segment stops waiting.
_CANCELLED = object()


class SegmentedSynthesis:
    """One request's segments as one stream of AudioEvents. ``prepare(segment, index)`` makes the
    engine context of ``segments[index]`` (it may raise InvalidArgument or another RequestError)."""

    def __init__(self, engine: Any, prepare: Callable[[Segment, int], TTSContext], *, executor: Executor,
                 request_id: str, max_segment_chars: int, stretch: float | None = None):
        self.engine = engine
        self.prepare = prepare
        self.executor = executor
        self.request_id = request_id
        self.max_segment_chars = max_segment_chars
        #: Time-stretch the whole stream by this speed (for models that speak at one speed).
        self.stretch = stretch
        #: Segments known so far, in order.
        self.segments: list[Segment] = []
        #: The voice of the first segment (every segment has the same).
        self.voice: str | None = None
        self._incoming: asyncio.Queue = asyncio.Queue()  # Segment, an exception, or _END
        self._started: asyncio.Queue = asyncio.Queue()  # (Segment, [(context, events)]), an exception, or _END
        self._played = 0
        self._progress = asyncio.Event()
        self._submitted: list[TTSContext] = []
        self._producer: asyncio.Task | None = None
        self._first: Any = None
        self._cancelled = False
        #: The model reads a text stream: every segment joins one request (see the module docstring).
        #: (No engine: the segments are only collected.)
        self.text_stream = engine is not None and engine.layout.text_stream
        #: A text stream's words sent, in order: (written text, start, end in the whole text, the word
        #: said); its model's words read (AudioEvent.read) index them.
        self._sent_words: list[tuple[str, int, int, str]] = []
        #: A text stream's runs: where each request's words start in ``_sent_words``, the last
        #: segment it reads, and the requests that have ended.
        self._word_base: dict[str, int] = {}
        self._last_segment: dict[str, Segment] = {}
        self._ended: set[str] = set()

    # --- input -----------------------------------------------------------------------------------

    async def add_text(self, text: str) -> None:
        """Cuts ``text`` into segments (off the event loop) and adds them, piece by piece (a
        sentence that crosses a piece's end is segmented again with the next piece; the result
        equals segmenting the whole text at once)."""
        loop = asyncio.get_running_loop()
        offset = 0
        head = HEAD_CHARS
        while offset < len(text):
            piece = text[offset:offset + head]
            found = await loop.run_in_executor(self.executor, segments, piece, self.max_segment_chars)
            last_piece = offset + len(piece) >= len(text)
            # The head's last sentence may go on past it: it is segmented again with the rest.
            keep = found if last_piece or len(found) < 2 else found[:-1]
            for segment in keep:
                self.add_segment(dataclasses.replace(segment, start=segment.start + offset,
                                                     end=segment.end + offset))
            if last_piece:
                return
            offset += keep[-1].end if keep else len(piece)
            head *= 8  # the rest in a few large pieces

    async def add_ssml(self, document: str, *, normalize_text: bool = True) -> None:
        """Adds the segments of an SSML document (audio_pipeline/text/ssml.py; read off the event
        loop). Raises the InvalidArgument that names what is wrong with it, before any is added."""
        from audio_pipeline.text.ssml import parse

        found = await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(parse, document, normalize_text=normalize_text,
                                             max_segment_chars=self.max_segment_chars))
        for segment in found:
            self.add_segment(segment)

    def add_segment(self, segment: Segment) -> None:
        self.segments.append(segment)
        self._incoming.put_nowait(segment)

    def close(self) -> None:
        """No more segments will come."""
        self._incoming.put_nowait(_END)

    def fail(self, error: BaseException) -> None:
        """Ends the stream with ``error`` after the audio already under way."""
        self._incoming.put_nowait(error)

    # --- running ---------------------------------------------------------------------------------

    async def _prepare(self, segment: Segment, index: int, offset: int = 0) -> list[tuple[TTSContext, int, str]]:
        """(context, offset of its text in the segment's, its text) of one segment: itself, or its
        halves when it needs more speech tokens than one request may have (cut at the space
        nearest the middle, again if need be; an SSML segment, whose words are already read out,
        is not cut)."""
        loop = asyncio.get_running_loop()
        text = segment.text
        try:
            return [(await loop.run_in_executor(self.executor, self.prepare, segment, index), offset, text)]
        except InvalidArgument as error:
            middle = text.rfind(" ", 0, len(text) // 2 + 1)
            if (error.field != "text" or "split the text" not in str(error) or middle <= 0
                    or segment.normalized is not None):
                raise
            first = dataclasses.replace(segment, text=text[:middle])
            second = dataclasses.replace(segment, text=text[middle + 1:])
            return (await self._prepare(first, index, offset)
                    + await self._prepare(second, index, offset + middle + 1))

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

    async def _produce(self) -> None:
        """Prepares and submits segments in order, at most LOOKAHEAD ahead of the one playing out
        (a text stream's: :meth:`_produce_runs`)."""
        if self.text_stream:
            await self._produce_runs()
            return
        index = 0
        try:
            while True:
                segment = await self._incoming.get()
                if segment is _END or isinstance(segment, BaseException):
                    await self._started.put(segment)
                    return
                await self._await_turn(index)
                parts = []
                for part, (context, offset, text) in enumerate(await self._prepare(segment, index)):
                    queue: asyncio.Queue = asyncio.Queue()
                    await self._submit(context, queue, first=index == 0 and part == 0)
                    parts.append((context, queue, segment.start + offset, text))
                await self._started.put((segment, parts))
                index += 1
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the reader, in order
            await self._started.put(error)

    async def _await_turn(self, started: int) -> None:
        """Waits until the item after ``started`` ones may start (LOOKAHEAD ahead of the one playing)."""
        while started - self._played > LOOKAHEAD:
            self._progress.clear()
            await self._progress.wait()

    async def _produce_runs(self) -> None:
        """A text stream's segments as runs (see the module docstring): each segment joins the
        running request while its words fit, else starts the next one."""
        index = runs = 0
        running: TTSContext | None = None
        frames = limit = 0  # the running request's words' bound, and what it may take
        pending: deque = deque()  # segments (or the end) taken from the queue or cut off, not yet used
        loop = asyncio.get_running_loop()
        layout = self.engine.layout

        async def joining(segment: Segment) -> tuple[TTSContext, list]:
            context = await loop.run_in_executor(self.executor, self.prepare, segment, index, True)
            return context, list(context.text_rule.state.words) + self._break_after(segment)

        try:
            while True:
                segment = pending.popleft() if pending else await self._incoming.get()
                if segment is _END or isinstance(segment, BaseException):
                    if running is not None:
                        self.engine.extend(running.request_id, [], close=True)
                    await self._started.put(segment)
                    return
                if running is not None:
                    context, words = await joining(segment)
                    if running.request_id not in self._ended and frames + layout.speech_frames(words) <= limit:
                        self._note_words(segment, context)
                        self.engine.extend(running.request_id, words)
                        frames += layout.speech_frames(words)
                        self._last_segment[running.request_id] = segment
                        index += 1
                        continue
                    self.engine.extend(running.request_id, [], close=True)  # it ends after its words
                    running = None
                await self._await_turn(runs)
                while True:  # a segment too long for one request is cut in two, the rest held
                    [(running, _, _)] = await self._prepare(segment, index)
                    state = running.text_rule.state
                    budget = running.token_budget // layout.tokens_per_frame
                    limit = budget - layout.frames_beyond_words - budget // WAIT_SHARE
                    halves = (self._halves(segment, index, state.words)
                              if layout.speech_frames(state.words) > limit else None)
                    if halves is None:
                        break
                    segment = halves[0]
                    pending.appendleft(halves[1])
                self._word_base[running.request_id] = len(self._sent_words)
                self._note_words(segment, running)
                state.words.extend(self._break_after(segment))
                self._last_segment[running.request_id] = segment
                index += 1
                frames = layout.speech_frames(state.words)
                # The segments already here join before it starts: their words are there from its first frame.
                while not pending and not self._incoming.empty():
                    following = self._incoming.get_nowait()
                    if following is _END or isinstance(following, BaseException):
                        pending.append(following)
                        break
                    context, words = await joining(following)
                    if frames + layout.speech_frames(words) > limit:
                        pending.append(following)
                        break
                    self._note_words(following, context)
                    state.words.extend(words)
                    frames += layout.speech_frames(words)
                    self._last_segment[running.request_id] = following
                    index += 1
                state.open = True  # more words may come: the model waits for them
                queue: asyncio.Queue = asyncio.Queue()
                await self._submit(running, queue, first=runs == 0)
                await self._started.put((segment, [(running, queue, segment.start, segment.text)]))
                runs += 1
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the reader, in order
            await self._started.put(error)

    def _halves(self, segment: Segment, index: int, words) -> tuple[Segment, Segment] | None:
        """``segment`` (``segments[index]``) as two, cut where its middle word was written, in its
        place in ``segments``; None where it cannot be cut (an SSML segment, whose words are read
        out already, or one written word: "$42.50" is read as six words written in one place)."""
        starts = sorted({word.at[0] for word in words if word.tokens and word.at is not None})
        if segment.normalized is not None or len(starts) < 2:
            return None
        cut = starts[len(starts) // 2]  # after the first word's start: each half holds a word
        first = dataclasses.replace(segment, text=segment.text[:cut], end=segment.start + cut, pause=0.0,
                                    break_after=False)
        rest = dataclasses.replace(segment, text=segment.text[cut:], start=segment.start + cut)
        self.segments[index:index + 1] = [first, rest]
        return first, rest

    def _break_after(self, segment: Segment) -> list:
        """A text stream's pause words for an SSML <break> after ``segment`` (the model keeps the
        pause; punctuation's pauses it makes itself)."""
        return self.engine.layout.pause_words(segment.pause) if segment.break_after and segment.pause > 0 else []

    def _note_words(self, segment: Segment, context: TTSContext) -> None:
        """Where each word of a text stream's piece was written in the whole text (its place in the
        segment's written text, ``word.at``: a spoken form's source after text normalization, "1847"
        for "eighteen", and for "forty-seven"), with what it was written as and said as."""
        written = segment.normalized.original if segment.normalized is not None else segment.text
        for word in context.text_rule.state.words:
            if not word.tokens:  # a pause: the model reads no word
                continue
            start, end = word.at if word.at is not None else (0, len(written))
            self._sent_words.append((written[start:end], segment.start + start, segment.start + end, word.text))

    async def start(self) -> None:
        """Starts the segments and waits until the first one is submitted: what can be refused
        (bad settings, a full queue) is refused here, before any audio. Raises that error."""
        self._producer = asyncio.create_task(self._produce())
        first = await self._started.get()
        if isinstance(first, BaseException):
            self.cancel()
            raise first
        if first is _END:
            raise InvalidArgument("no text to speak", field="text")
        if first is _CANCELLED:
            self._first = _CANCELLED
            return
        self._first = first
        self.voice = first[1][0][0].voice

    def cancel(self) -> None:
        """Stops every segment (idempotent)."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._producer is not None:
            self._producer.cancel()
        for context in self._submitted:
            self.engine.cancel(context.request_id)
        self._started.put_nowait(_CANCELLED)

    def _edge_seconds(self, before: TTSContext | None, after: TTSContext) -> float:
        """Seconds of pause the context ``before`` speaks at its end and ``after`` at its start
        (layouts whose alignment knows its edge pauses: the built-in voices; else 0)."""
        if before is None:
            return 0.0
        frames = before.edge_pause_frames[1] + after.edge_pause_frames[0]
        return frames * self.engine.samples_per_frame / self.engine.sample_rate

    async def events(self) -> AsyncIterator[AudioEvent]:
        """Audio events of every segment in order, silences between them, then one ``complete``
        with the usage of them all. A segment's ``error`` (or CANCELLED) event ends the stream with
        it; a segment that cannot be prepared raises its RequestError.

        Events carry word timings (``words``; text offsets into the whole text, samples of the
        whole stream): a word goes with the audio event its first sample is in. Where a segment
        has no word alignment, one timing for the whole segment goes with the first event after
        its audio (the silence after it, the next segment's audio, or the ``complete``)."""
        if self._first is None:
            await self.start()
        started_at = time.monotonic()
        sample_rate = self.engine.sample_rate
        prompt_tokens = generated_tokens = audio_samples = chunk_index = 0
        first_audio: float | None = None
        stop_reason = StopReason.END_OF_SPEECH
        item, self._first = self._first, None
        pause = 0.0
        previous: TTSContext | None = None  # the last context spoken
        carried: list[WordTiming] = []  # timings for the next event out
        stretcher = TimeStretch(self.stretch, sample_rate) if self.stretch not in (None, 1.0) else None

        source = 0  # samples of the speech before any stretching: timings are made on this clock

        def stretched(samples):
            nonlocal source
            source += samples.shape[0]
            return stretcher.process(samples) if stretcher is not None else samples

        def on_stream(timing: WordTiming) -> WordTiming:
            """A timing on the source clock, on the stream's (stretched) clock."""
            if stretcher is None:
                return timing
            return dataclasses.replace(timing, start_sample=int(round(timing.start_sample / self.stretch)),
                                       end_sample=int(round(timing.end_sample / self.stretch)))

        while item is not _END:
            if item is _CANCELLED:
                yield AudioEvent("complete", self.request_id, stop_reason=StopReason.CANCELLED)
                return
            if isinstance(item, BaseException):
                raise item
            segment, parts = item
            # The silence the previous segment's punctuation (or <break>) asks for, less the pause
            # frames the two segments speak at their edges: the gap between their words is the pause.
            pause -= self._edge_seconds(previous, parts[0][0])
            if pause > 0:
                silence = stretched(np.zeros(int(round(pause * sample_rate)), dtype=np.float32))
                audio_samples += silence.shape[0]
                yield AudioEvent("audio", self.request_id, samples=silence, chunk_index=chunk_index, words=carried)
                carried = []
                chunk_index += 1
            for context, queue, text_offset, text in parts:
                base = source
                words = [on_stream(w.shifted(text_offset, base)) for w in context.words or ()]
                read: WordTiming | None = None  # a text stream's latest word read (its end comes next)
                word_base = self._word_base.get(context.request_id, 0)
                while True:
                    event: AudioEvent = await queue.get()
                    if event.kind == "audio":
                        if first_audio is None:
                            first_audio = time.monotonic() - started_at
                        samples = stretched(event.samples)
                        audio_samples += samples.shape[0]
                        heard = 0
                        while heard < len(words) and words[heard].start_sample < audio_samples:
                            heard += 1
                        out, words = carried + words[:heard], words[heard:]
                        for index, start in event.read or ():  # the model's own timestamps
                            text, text_start, text_end, said = self._sent_words[word_base + index]
                            if read is not None and text_start < read.text_end:
                                # Said for the same written word ("1847": "eighteen", "forty-seven,"): one timing.
                                joined = read.text + text[max(0, read.text_end - text_start):]
                                read = dataclasses.replace(read, text=joined, text_end=max(read.text_end, text_end),
                                                           spoken=f"{read.spoken} {said}")
                                continue
                            timing = on_stream(WordTiming(text, text_start, text_end, base + start, base + start, said))
                            if read is not None:
                                out.append(dataclasses.replace(read, end_sample=timing.start_sample))
                            read = timing
                        carried = []
                        yield dataclasses.replace(event, samples=samples, request_id=self.request_id,
                                                  chunk_index=chunk_index, words=out)
                        chunk_index += 1
                        continue
                    self._ended.add(context.request_id)  # a text stream's next words start another run
                    if event.kind == "error" or event.stop_reason == StopReason.CANCELLED:
                        yield dataclasses.replace(event, request_id=self.request_id)
                        return
                    prompt_tokens += event.usage.prompt_tokens
                    generated_tokens += event.usage.generated_tokens
                    if event.stop_reason == StopReason.MAX_TOKENS:
                        stop_reason = StopReason.MAX_TOKENS
                    if read is not None:  # the last word read ends with the audio
                        end = source if stretcher is None else int(round(source / self.stretch))
                        carried.append(dataclasses.replace(read, end_sample=max(read.start_sample, end)))
                    elif context.words is None and not self.text_stream:
                        carried.append(on_stream(segment_timing(text, source - base).shifted(text_offset, base)))
                    elif event.stop_reason == StopReason.END_OF_SPEECH:
                        # Words that start where the audio ends (no frame of their own).
                        carried += [dataclasses.replace(w, end_sample=min(w.end_sample, audio_samples))
                                    for w in words if w.start_sample <= audio_samples]
                    break
            previous = parts[-1][0]
            self._played += 1
            self._progress.set()
            pause = segment.pause
            if self.text_stream:  # after a run: its last segment's punctuation (a <break> it read itself)
                last = self._last_segment.get(previous.request_id, segment)
                pause = 0.0 if last.break_after else last.pause
            item = await self._started.get()
        if stretcher is not None:  # what the stretcher still holds
            rest = stretcher.finish()
            audio_samples += rest.shape[0]
            yield AudioEvent("audio", self.request_id, samples=rest, chunk_index=chunk_index, words=carried)
            carried = []
            chunk_index += 1
        elapsed = time.monotonic() - started_at
        yield AudioEvent("complete", self.request_id, stop_reason=stop_reason, words=carried, usage=Usage(
            prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, audio_samples=audio_samples,
            time_to_first_audio_seconds=first_audio if first_audio is not None else elapsed,
            generation_seconds=elapsed))


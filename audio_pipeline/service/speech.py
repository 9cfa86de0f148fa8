"""The speech service under every front door: admission, validation (once), labels, seeds, limits,
the segmentation driver, and one generator of encoded audio events that runs off the event loop.

A front door maps its protocol's request to a :class:`SpeechRequest`, calls :meth:`SpeechService.open`
(a whole text) or :meth:`SpeechService.open_live` (text that comes later), sends what the stream's
:meth:`SpeechStream.events` yields, and maps the :class:`RequestError` it may raise to its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing


from audio_pipeline.core.stop import StopReason
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.errors import (AlreadyExists, GenerationFailed, RequestError, ResourceExhausted,
                                   ServerCancelled, Unavailable, echo, error_of_kind)
from audio_pipeline.service.live_text import LiveText
from audio_pipeline.service.output import AudioOutput
from audio_pipeline.service.prepare import RequestPreparer, RequestSettings
from audio_pipeline.service.request import SpeechAudio, SpeechDone, SpeechRequest
from audio_pipeline.service.segment_voices import SegmentVoices, segment_voices
from audio_pipeline.service.segmented import SegmentedSynthesis
from audio_pipeline.service.stream_metrics import StreamMetrics
from audio_pipeline.text.ssml import is_ssml
from audio_pipeline.text.timings import WordTiming

logger = logging.getLogger(__name__)

#: Threads for request preparation (text front end, reference audio): off the event loop, and
#: bounded, so a burst of long texts queues there instead of stalling health checks and streams.
FRONTEND_WORKERS = 2
#: Threads that resample and encode the streams' audio (one stream's chunks one at a time, in order).
ENCODER_WORKERS = 4


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool with all its threads running now: a server's thread count is set at start-up,
    not grown by its first bursts (so a leak stands out)."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    barrier = threading.Barrier(workers)  # each task holds its thread until all have one
    for started in [pool.submit(barrier.wait, 10.0) for _ in range(workers)]:
        started.result()
    return pool


def outcome_of(error: RequestError) -> str:
    """The requests metric's outcome of a refusal."""
    if isinstance(error, Unavailable):
        return "unavailable"
    if isinstance(error, (ResourceExhausted, AlreadyExists)):
        return "rejected"
    return "invalid"


def segment_settings(settings: RequestSettings, index: int) -> RequestSettings:
    """Segment ``index``'s settings: with a seed, segment i uses seed + i, so a long text is as
    reproducible as a short one and its segments do not repeat one another's draws."""
    seed = settings.sampling.seed
    if not index or seed is None:
        return settings
    return dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling,
                                                                      seed=(seed + index) % 2 ** 63))


class SpeechService:
    """One engine's requests, for every front door. ``count(outcome)`` records a request's outcome
    (the server's requests metric); ``stream_metrics``, where given, follows every stream's audio as
    its listener would hear it (service/stream_metrics.py)."""

    def __init__(self, engine: TTSEngine, count=None, stream_metrics: StreamMetrics | None = None):
        self.engine = engine
        self.stream_metrics = stream_metrics
        #: Every request is checked and its segments' contexts built here, then handed to the engine.
        self.requests = RequestPreparer(engine)
        self.count = count or (lambda outcome: None)
        #: False while warming up and once shutting down: new requests are refused as UNAVAILABLE.
        self.ready = False
        #: Shutting down: admitted requests run to their end, new ones are refused.
        self.draining = False
        self.frontend = started_pool(FRONTEND_WORKERS, "frontend")
        self.encoders = started_pool(ENCODER_WORKERS, "encoder")
        #: Client labels of the running requests (the engine knows them by the server's own ids).
        self._labels: set[str] = set()
        #: Requests between admission and submission (being prepared off the loop).
        self._preparing = 0

    def close(self) -> None:
        self.frontend.shutdown(wait=False, cancel_futures=True)
        self.encoders.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        """Takes no new request from now on; the requests admitted go on (their later segments
        included) until they end or the engine stops."""
        self.draining = True
        self.ready = False

    @property
    def serving(self) -> bool:
        return self.ready and self.engine.healthy

    # --- admission -------------------------------------------------------------------------------

    def _admit(self, label: str, field: str) -> tuple[str, str]:
        """(the id the engine runs the request under, the client's label), or the RequestError that
        refuses it now.

        The engine runs a request under an id of the server's making; the client's id is a label
        for its own chunks and the logs, so it can never name (or cancel) another client's request.
        A burst is refused before it is prepared, counting the requests already being prepared."""
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica")
        if not self.ready:
            raise Unavailable("the server is warming up; retry shortly")
        request_id = uuid.uuid4().hex
        label = label or request_id
        self.requests.check_request_id(label, field)
        if label in self._labels:
            raise AlreadyExists(f"{echo(label)} names a running request", field=field)
        self.engine.check_room(pending=self._preparing)
        return request_id, label

    @contextlib.contextmanager
    def _refusals(self):
        """Counts a RequestError raised inside as the request's outcome."""
        try:
            yield
        except RequestError as error:
            self.count(outcome_of(error))
            raise

    @contextlib.contextmanager
    def _being_prepared(self):
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def _stream(self, request: SpeechRequest, *, live: bool) -> SpeechStream:
        """Checks what can be checked at once and admits the request; the stream holds its label."""
        engine = self.engine
        output = AudioOutput(engine.sample_rate, request.format, request.sample_rate, streamed=request.streamed)
        try:
            if not live:
                self.requests.check_text(request.text)
            if request.speed is not None:
                self.requests.check_speed(request.speed)
            request_id, label = self._admit(request.label, request.label_field)
        except BaseException:
            output.release()
            raise
        self._labels.add(label)
        return (LiveSpeechStream if live else SpeechStream)(self, request_id, label, output)

    def _settings(self, request: SpeechRequest, reference, *, voice: str | None = None
                  ) -> tuple[RequestSettings, float | None]:
        """The request's settings checked against the model, and the speed to time-stretch the
        stream by (a model that speaks at one speed; None: no stretching). ``voice``: the settings
        of that voice instead of the request's (an SSML <voice>: no reference, no instructions)."""
        speed, stretch = request.speed, None
        if speed is not None and speed != 1.0 and not self.engine.layout.supports_speed:
            speed, stretch = None, speed
        own = voice is None
        settings = self.requests.resolve_settings(voice=request.voice or None if own else voice,
                                                reference=reference if own else None,
                                                normalize_text=request.normalize_text, speed=speed,
                                                instructions=request.instructions if own else None,
                                                language=request.language,
                                                pronunciations=request.pronunciations, **request.sampling)
        return settings, stretch

    def _synthesis(self, stream: SpeechStream, settings: RequestSettings, stretch: float | None) -> SegmentedSynthesis:
        engine, requests = self.engine, self.requests
        stream.voices = SegmentVoices(settings)  # an SSML document's <voice>s: set before it starts

        def prepare(segment, index: int, joins: bool = False):  # runs on the front-end pool
            voices = stream.voices
            before = stream.synthesis.segments[index - 1] if joins else None
            return requests.segment_context(segment.text, segment_settings(voices.settings_of(segment), index),
                                            f"{stream.request_id}-{index}", stream_id=stream.request_id,
                                            normalized=segment.normalized, rate=segment.rate,
                                            phonemes=segment.phonemes, continuation=index > 0,
                                            speaker=voices.speaker(segment),
                                            after=voices.speaker(before) if before is not None else None)

        return SegmentedSynthesis(engine, prepare, executor=self.frontend, request_id=stream.request_id,
                                  max_segment_chars=engine.config.max_segment_chars, stretch=stretch)

    # --- requests --------------------------------------------------------------------------------

    async def open(self, request: SpeechRequest) -> SpeechStream:
        """A whole text's stream: checked, admitted, and its first segment submitted, so that what
        can be refused (bad settings, a full queue) is refused here, before any audio. Raises the
        RequestError that refuses it (counted; nothing of it is left running then)."""
        with self._refusals():
            stream = self._stream(request, live=False)
            with _closed_on_error(stream), self._being_prepared():
                reference = None
                if request.reference_audio is not None:
                    reference = await asyncio.get_running_loop().run_in_executor(
                        self.frontend, self.requests.reference_prompt, request.reference_audio,
                        request.reference_transcript)
                settings, stretch = self._settings(request, reference)
                stream.synthesis = self._synthesis(stream, settings, stretch)
                if request.ssml or (request.ssml is None and is_ssml(request.text)):
                    await stream.synthesis.add_ssml(request.text, normalize_text=settings.normalize_text)
                    self.requests.check_rates(settings, [s.rate for s in stream.synthesis.segments])
                    stream.voices = segment_voices(
                        settings, stream.synthesis.segments, self.engine.layout,
                        lambda name: self._settings(request, None, voice=name)[0])
                else:
                    await stream.synthesis.add_text(request.text)
                stream.synthesis.close()
                await stream.synthesis.start()
        return stream

    def open_live(self, request: SpeechRequest) -> LiveSpeechStream:
        """A stream whose text comes later (:attr:`LiveSpeechStream.text`): checked and admitted;
        :meth:`SpeechStream.start` waits for its first sentence. Raises the refusing RequestError."""
        with self._refusals():
            stream = self._stream(request, live=True)
            with _closed_on_error(stream):
                stream.synthesis = self._synthesis(stream, *self._settings(request, None))
        config = self.engine.config
        stream.text = LiveText(stream.synthesis, max_chars=config.sampling.max_text_chars,
                               max_segment_chars=config.max_segment_chars, executor=self.frontend)
        return stream


@contextlib.contextmanager
def _closed_on_error(stream: "SpeechStream"):
    """Closes ``stream`` when the block raises: a RequestError refused it (its outcome is counted
    as such), anything else means its client left while it was being prepared."""
    try:
        yield
    except RequestError:
        stream.close(finished=True)
        raise
    except BaseException:
        stream.close()
        raise


class SpeechStream:
    """One admitted request: its synthesis, its output, its label until :meth:`close`."""

    def __init__(self, service: SpeechService, request_id: str, label: str, output: AudioOutput):
        self.service = service
        self.request_id = request_id
        self.label = label
        self.output = output
        self.synthesis: SegmentedSynthesis | None = None
        #: What its segments are spoken with (an SSML document's <voice>s).
        self.voices: SegmentVoices | None = None
        #: When the request was admitted (its streaming metrics count from here).
        self.opened = time.monotonic()
        self._finished = False
        self._closed = False
        #: The client stopped it (cancel(): a barge-in, a client that went away).
        self.cancelled_by_client = False

    @property
    def sample_rate(self) -> int:
        return self.output.sample_rate

    @property
    def whole_file(self) -> bool:
        """The audio comes as one complete file at the end (see AudioOutput.whole_file)."""
        return self.output.whole_file

    @property
    def log_label(self) -> str:
        return echo(self.label, self.service.engine.config.limits.max_request_id_chars)

    async def start(self) -> None:
        """Waits until the first segment is submitted; raises (and counts) the RequestError that
        refuses it (a live stream: its first sentence's)."""
        with self.service._refusals(), _closed_on_error(self), self.service._being_prepared():
            await self.synthesis.start()

    def cancel(self) -> None:
        """The client stops the request (idempotent): generation stops at the next step."""
        if not self._finished:
            self.cancelled_by_client = True
        if self.synthesis is not None:
            self.synthesis.cancel()

    def close(self, *, finished: bool = False) -> None:
        """Ends the request (idempotent): nothing of it outlives this call; the label is free. A
        request that ends here before its completion was given up by its client."""
        if self._closed:
            return
        self._closed = True
        self._finished = self._finished or finished
        if self.synthesis is not None:
            self.synthesis.cancel()  # a no-op once it completed
        self.output.release()
        self.service._labels.discard(self.label)
        if not self._finished:
            self.service.count("client_cancelled")
            logger.info("request %s: cancelled by the client", self.log_label)

    async def events(self) -> AsyncIterator[SpeechAudio | SpeechDone]:
        """Encoded audio as it is made (one :class:`SpeechAudio` at the end for a whole-file output),
        then one :class:`SpeechDone`. Raises GenerationFailed (the engine failed), ServerCancelled
        (the server is shutting down) or the RequestError of a later segment that cannot be spoken;
        a stream the client cancelled just ends. Resampling and encoding run on the service's
        encoder threads, never on the event loop. Leaving early closes the stream."""
        service, output = self.service, self.output
        loop = asyncio.get_running_loop()
        engine_rate = service.engine.sample_rate
        words: list[WordTiming] = []  # timings waiting for the next message out
        sent = 0
        metrics = service.stream_metrics
        watch = (metrics.watch(engine_rate, self.opened)
                 if metrics is not None and not output.whole_file else None)

        def encode(samples):  # on an encoder thread
            if watch is not None:
                watch.audio(samples)
            return output.chunk(samples)

        logger.info("request %s (%s): %d segment(s), voice %s", self.log_label, self.request_id,
                    len(self.synthesis.segments), echo(self.synthesis.voice or ""))
        try:
            async with aclosing(self.synthesis.events()) as events:
                async for event in events:
                    words += [w.resampled(engine_rate, output.sample_rate) for w in event.words or ()]
                    if event.kind == "error":
                        error = error_of_kind(event.error_kind, event.error or "generation failed")
                        self._end("failed" if isinstance(error, GenerationFailed) else outcome_of(error))
                        logger.error("request %s failed: %s", self.log_label, event.error)
                        raise error
                    if event.kind == "complete" and event.stop_reason == StopReason.CANCELLED:
                        if self.cancelled_by_client:
                            return
                        self._end("cancelled")
                        raise ServerCancelled("the request was cancelled by the server (shutting down)")
                    if event.kind == "audio":
                        data, count = await loop.run_in_executor(service.encoders, encode, event.samples)
                    else:
                        data, count = await loop.run_in_executor(service.encoders, output.end)
                    sent += count
                    if data or (count and not output.whole_file) or (words and event.kind == "complete"):
                        whole = output.whole_file  # one message of the whole file and its samples
                        if watch is not None:
                            watch.sent(count / output.sample_rate)
                        yield SpeechAudio(data, sent if whole else count, words)
                        words = []
                    if event.kind == "complete":
                        if watch is not None:
                            watch.end()
                        self._end("ok")
                        usage = event.usage
                        logger.info("request %s: %s, %d tokens, %.2f s audio, first audio %.3f s, total %.3f s",
                                    self.log_label, event.stop_reason.value, usage.generated_tokens,
                                    sent / output.sample_rate, usage.time_to_first_audio_seconds,
                                    usage.generation_seconds)
                        yield SpeechDone(event.stop_reason, usage, sent, output.sample_rate)
                        return
        except RequestError as error:  # a later segment that cannot be spoken
            if not self._finished:
                self._end(outcome_of(error))
            raise
        finally:
            self.close()

    def _end(self, outcome: str) -> None:
        self._finished = True
        self.service.count(outcome)


class LiveSpeechStream(SpeechStream):
    """A stream fed with text as it comes: ``text.add(...)``, ``text.flush()``, ``text.end()``
    (service/live_text.py), ``fail(error)`` to end it with an error after the audio under way."""

    text: LiveText

    def fail(self, error: BaseException) -> None:
        self.synthesis.fail(error)

    def end_input(self) -> None:
        """The client half-closed its side without a word: the text so far is all there is."""
        self.synthesis.close()


async def gather(stream: SpeechStream) -> tuple[bytes, SpeechDone]:
    """A stream's bytes, all of them, and its completion (what a whole-file response sends)."""
    parts = []
    async for event in stream.events():
        if isinstance(event, SpeechAudio):
            parts.append(event.data)
        else:
            return b"".join(parts), event
    raise GenerationFailed("the speech ended without its completion")


__all__ = ["SpeechService", "SpeechStream", "LiveSpeechStream", "SpeechRequest", "SpeechAudio", "SpeechDone",
           "outcome_of", "segment_settings", "gather"]

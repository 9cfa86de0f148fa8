"""The TextToSpeech servicer: validates requests, streams engine events as AudioChunk messages."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from contextlib import aclosing
from concurrent.futures import ThreadPoolExecutor

import grpc

from audio_pipeline.context import StopReason
from audio_pipeline.engine import TTSEngine
from audio_pipeline.errors import (AlreadyExists, InvalidArgument, NotFound, RequestError, ResourceExhausted,
                                   Unavailable, echo)
from audio_pipeline.service.live_text import LiveText
from audio_pipeline.service.segmented import SegmentedSynthesis
from audio_pipeline.text.timings import SEGMENT, WORD, WordTiming
from audio_pipeline.service.output import StreamAudioOutput
from audio_pipeline.server.handlers import MalformedRequest
from audio_pipeline.server.metrics import ServerMetrics
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

logger = logging.getLogger(__name__)

STATUS_OF_ERROR = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
}
STOP_REASONS = {StopReason.END_OF_SPEECH: tts_pb2.STOP_REASON_END_OF_SPEECH,
                StopReason.MAX_TOKENS: tts_pb2.STOP_REASON_MAX_TOKENS}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "min_tokens", "seed",
                   "min_p", "frequency_penalty", "presence_penalty")


def sampling_overrides(request: tts_pb2.SynthesizeRequest) -> dict:
    """The sampling fields the client set (proto3 optional presence), by name."""
    overrides = {name: getattr(request.sampling, name) for name in SAMPLING_FIELDS
                 if request.sampling.HasField(name)}
    if request.sampling.stop_token_ids:
        overrides["stop_token_ids"] = list(request.sampling.stop_token_ids)
    return overrides


PRECISIONS = {WORD: tts_pb2.TIMING_PRECISION_WORD, SEGMENT: tts_pb2.TIMING_PRECISION_SEGMENT}


def timing_message(timing: WordTiming, engine_rate: int, output_rate: int) -> tts_pb2.WordTiming:
    """A word timing on the stream's sample clock."""
    timing = timing.resampled(engine_rate, output_rate)
    return tts_pb2.WordTiming(text=timing.text, text_start=timing.text_start, text_end=timing.text_end,
                              start_sample=timing.start_sample, end_sample=timing.end_sample,
                              spoken=timing.spoken, precision=PRECISIONS[timing.precision])


def outcome_of(error: RequestError) -> str:
    """The requests-metric outcome of a refusal."""
    if isinstance(error, Unavailable):
        return "unavailable"
    if isinstance(error, ResourceExhausted):
        return "rejected"
    return "invalid"


@dataclass(frozen=True)
class SpeechSettings:
    """How a request wants its text spoken, whichever front door it came through."""

    voice: str | None = None
    reference: object = None
    normalize_text: bool | None = None
    #: Sampling fields the client set, by name.
    overrides: dict = field(default_factory=dict)
    #: Speaking rate (None: 1.0).
    speed: float | None = None

    @classmethod
    def of(cls, request, reference) -> "SpeechSettings":
        """From a SynthesizeRequest or StreamSettings message."""
        return cls(voice=request.voice or None, reference=reference,
                   normalize_text=request.normalize_text if request.HasField("normalize_text") else None,
                   overrides=sampling_overrides(request),
                   speed=request.speed if request.HasField("speed") else None)


#: Threads for request preparation (text front end, reference audio): off the event loop, and
#: bounded, so a burst of long texts queues there instead of stalling health checks and streams.
FRONTEND_WORKERS = 2


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    def __init__(self, engine: TTSEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.ready = False
        self.frontend = ThreadPoolExecutor(FRONTEND_WORKERS, thread_name_prefix="frontend")
        #: Client labels of the running requests (the engine knows them by the server's own ids).
        self._labels: set[str] = set()
        #: Requests between the capacity check and submission (being prepared off the loop).
        self._preparing = 0

    def close(self) -> None:
        self.frontend.shutdown(wait=False, cancel_futures=True)

    def _segment_context(self, speech: "SpeechSettings", text: str, request_id: str, index: int):
        """One segment's engine context (runs on the front-end pool). Segment i of a request with a
        seed uses seed + i, so a long text is as reproducible as a short one."""
        overrides = dict(speech.overrides)
        if index and overrides.get("seed") is not None:
            overrides["seed"] = (overrides["seed"] + index) % 2 ** 63
        return self.engine.create_context(
            text, voice=speech.voice or None, request_id=f"{request_id}-{index}", reference=speech.reference,
            normalize_text=speech.normalize_text, speed=speech.speed, **overrides)

    def synthesis(self, speech: "SpeechSettings", request_id: str) -> SegmentedSynthesis:
        """A request's segmented synthesis (not started): the same for every front door. A speed
        other than 1 goes to the model where its layout can speak at it (the built-in voice),
        else the stream is time-stretched."""
        stretch = None
        if speech.speed is not None and speech.speed != 1.0:
            self.engine.check_speed(speech.speed)
            if not getattr(self.engine.layout, "supports_speed", False):
                stretch, speech = speech.speed, dataclasses.replace(speech, speed=None)
        return SegmentedSynthesis(
            self.engine, lambda text, index: self._segment_context(speech, text, request_id, index),
            executor=self.frontend, request_id=request_id, max_segment_chars=self.engine.config.max_segment_chars,
            stretch=stretch)

    async def start_text(self, text: str, speech: "SpeechSettings", request_id: str) -> SegmentedSynthesis:
        """Checks ``text``, prepares and submits its first segment; raises the RequestError that
        refuses it (nothing of it is left running then)."""
        self.engine.check_text(text)
        synthesis = self.synthesis(speech, request_id)
        try:
            await synthesis.add_text(text)
            synthesis.close()
            await synthesis.start()
        except BaseException:  # refused, or the client left while it was being prepared
            synthesis.cancel()
            raise
        return synthesis

    async def _start(self, request: tts_pb2.SynthesizeRequest, request_id: str):
        """Validates what can be checked at once, then prepares and submits the first segment."""
        output = StreamAudioOutput(self.engine.sample_rate, request.sample_rate, request.encoding)
        self.engine.check_text(request.text)
        reference = None
        if request.HasField("reference"):
            loop = asyncio.get_running_loop()
            reference = await loop.run_in_executor(self.frontend, self.engine.reference_prompt,
                                                   request.reference.audio, request.reference.transcript)
        return await self.start_text(request.text, SpeechSettings.of(request, reference), request_id), output

    async def _abort(self, context: grpc.aio.ServicerContext, error: RequestError, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        await context.abort(STATUS_OF_ERROR.get(type(error), grpc.StatusCode.INTERNAL), str(error))

    @contextlib.contextmanager
    def preparing(self):
        """Counts a request between admission and submission (what admit() counts as pending)."""
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def admit(self, client_id: str, field: str) -> tuple[str, str]:
        """Checks that the server takes a new request now; returns (the id the engine runs it
        under, the client's label), or raises the RequestError that refuses it.

        The engine runs the request under an id of the server's making; the client's id is a label
        for its own chunks and the logs, so it can never name (or cancel) another client's request.
        A burst is refused before it is prepared, counting the requests already being prepared."""
        if not self.ready:
            raise Unavailable("the server is warming up; retry shortly")
        request_id = uuid.uuid4().hex
        label = client_id or request_id
        limit = self.engine.config.limits.max_request_id_chars
        if len(label) > limit:
            raise InvalidArgument(f"longer than {limit} characters", field=field)
        if label in self._labels:
            raise AlreadyExists(f"{echo(label)} names a running request", field=field)
        generation = self.engine.generation
        if not generation.accepting:
            raise generation.unavailable()
        if not generation.has_room(pending=self._preparing):
            raise ResourceExhausted("the request queue is full; retry later")
        return request_id, label

    async def _admit(self, context: grpc.aio.ServicerContext, client_id: str, field: str) -> tuple[str, str]:
        """admit(), or the call aborted with its error."""
        try:
            return self.admit(client_id, field)
        except RequestError as error:
            await self._abort(context, error, outcome_of(error))

    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._abort(context, InvalidArgument(request.reason), "invalid")
        request_id, label = await self._admit(context, request.request_id, "request_id")
        log_label = echo(label, self.engine.config.limits.max_request_id_chars)
        self._labels.add(label)
        try:
            try:
                with self.preparing():
                    synthesis, output = await self._start(request, request_id)
            except (ResourceExhausted, Unavailable, AlreadyExists) as error:
                await self._abort(context, error, "rejected")
                return
            except RequestError as error:
                await self._abort(context, error, "invalid")
                return
            try:
                # aclosing: when the client goes away, the inner stream's cleanup (cancelling the
                # generation) runs now, not whenever the event loop finalizes it.
                async with aclosing(self._stream(context, synthesis, output, request_id, label,
                                                 log_label)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:
                synthesis.cancel()  # nothing of it may outlive the call (a no-op once it completed)
        finally:
            self._labels.discard(label)

    async def _stream(self, context, synthesis: SegmentedSynthesis, output, request_id: str, label: str,
                      log_label: str):
        logger.info("request %s (%s): %d segment(s), voice %s", log_label, request_id, len(synthesis.segments),
                    echo(synthesis.voice or ""))
        finished = False
        # The format message goes out with the first audio, not before: until a call's first message
        # a client's gRPC retry policy may still send it to another replica (UNAVAILABLE from a
        # replica draining, or gone before it spoke), so nothing is committed before audio exists.
        head = [tts_pb2.AudioChunk(request_id=label, format=tts_pb2.AudioFormat(
            sample_rate=output.sample_rate, encoding=output.encoding, channels=1))]
        try:
            chunk_index = 0
            sent_samples = 0
            words: list = []  # timings waiting for the next message out
            async with aclosing(synthesis.events()) as events:
                async for event in events:
                    words += [timing_message(w, self.engine.sample_rate, output.sample_rate)
                              for w in event.words or ()]
                    if event.kind == "audio":
                        samples = output.convert(event.samples)
                        data = output.encode(samples) if samples.size else b""
                    elif event.kind == "complete":
                        finished = True
                        if event.stop_reason == StopReason.CANCELLED:
                            await self._abort(context, Unavailable("the request was cancelled by the server "
                                                                   "(shutting down)"), "cancelled")
                        samples = output.finish()
                        data = (output.encode(samples) if samples.size else b"") + output.close()
                    else:
                        finished = True
                        self.metrics.requests.labels("failed").inc()
                        await context.abort(grpc.StatusCode.INTERNAL, event.error or "generation failed")
                    # The last timings (and an encoder's last bytes) go out even with no samples left.
                    if head and (samples.size or data or event.kind == "complete"):
                        yield head.pop()
                    if samples.size or data or (words and event.kind == "complete"):
                        yield tts_pb2.AudioChunk(request_id=label, audio=tts_pb2.AudioFrames(
                            data=data, chunk_index=chunk_index, num_samples=samples.size, words=words))
                        words = []
                        chunk_index += 1
                        sent_samples += samples.size
                    if event.kind == "complete":
                        usage = event.usage
                        audio_seconds = sent_samples / output.sample_rate
                        self.metrics.requests.labels("ok").inc()
                        yield tts_pb2.AudioChunk(request_id=label, complete=tts_pb2.SynthesisComplete(
                            stop_reason=STOP_REASONS.get(event.stop_reason, tts_pb2.STOP_REASON_UNSPECIFIED),
                            usage=tts_pb2.Usage(
                                prompt_tokens=usage.prompt_tokens, generated_tokens=usage.generated_tokens,
                                audio_seconds=audio_seconds,
                                time_to_first_audio_seconds=usage.time_to_first_audio_seconds,
                                generation_seconds=usage.generation_seconds)))
                        logger.info("request %s: %s, %d tokens, %.2f s audio, first audio %.3f s, total %.3f s",
                                    log_label, event.stop_reason.value, usage.generated_tokens, audio_seconds,
                                    usage.time_to_first_audio_seconds, usage.generation_seconds)
                        return
        except RequestError as error:  # a later segment that cannot be spoken
            finished = True
            synthesis.cancel()
            await self._abort(context, error, "invalid")
        finally:
            output.release()
            if not finished:
                # The client went away (cancel, deadline, broken stream): stop generating for it.
                synthesis.cancel()
                self.metrics.requests.labels("client_cancelled").inc()
                logger.info("request %s: cancelled by the client", log_label)


    async def SynthesizeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Live text: settings first, then text pieces, flushes and the end of input (see the proto)."""
        first = await anext(aiter(request_iterator), None)
        if first is None:
            await self._abort(context, InvalidArgument("the stream carried no message", field="settings"), "invalid")
        if isinstance(first, MalformedRequest):
            await self._abort(context, InvalidArgument(first.reason), "invalid")
        if first.WhichOneof("content") != "settings":
            await self._abort(context, InvalidArgument("the first message must carry the settings",
                                                       field="settings"), "invalid")
        settings = first.settings
        request_id, label = await self._admit(context, settings.request_id, "settings.request_id")
        try:
            output = StreamAudioOutput(self.engine.sample_rate, settings.sample_rate, settings.encoding)
        except RequestError as error:
            await self._abort(context, error, "invalid")
        synthesis = self.synthesis(SpeechSettings.of(settings, None), request_id)
        self._labels.add(label)
        reader = asyncio.create_task(self._read_live_text(request_iterator, synthesis))
        try:
            try:
                await synthesis.start()  # the first sentence: its errors come before any audio
            except (ResourceExhausted, Unavailable, AlreadyExists) as error:
                await self._abort(context, error, "rejected")
            except RequestError as error:
                await self._abort(context, error, "invalid")
            async with aclosing(self._stream(context, synthesis, output, request_id, label,
                                             echo(label, self.engine.config.limits.max_request_id_chars))) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            reader.cancel()
            synthesis.cancel()
            self._labels.discard(label)

    async def _read_live_text(self, request_iterator, synthesis: SegmentedSynthesis) -> None:
        """Feeds the stream's text to ``synthesis`` (service/live_text.py)."""
        live = LiveText(synthesis, max_chars=self.engine.config.sampling.max_text_chars,
                        max_segment_chars=self.engine.config.max_segment_chars)
        try:
            async for message in request_iterator:
                if isinstance(message, MalformedRequest):
                    raise InvalidArgument(message.reason)
                kind = message.WhichOneof("content")
                if kind == "settings":
                    raise InvalidArgument("sent twice (only the first message carries them)", field="settings")
                if kind is None:
                    raise InvalidArgument("a message with no content", field="content")
                if kind == "text":
                    live.add(message.text)
                elif kind == "flush":
                    live.flush()
                else:  # end_of_input
                    break
            live.end()  # the end of input, or the client half-closed its side
        except RequestError as error:
            synthesis.fail(error)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:  # the call ended (cancelled by the client): nothing left to read
            synthesis.close()

    async def ListVoices(self, request: tts_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._abort(context, InvalidArgument(request.reason), "invalid")
        default = self.engine.manifest.default_voice
        registered = {v.name for v in self.engine.registered_voices()}
        return tts_pb2.ListVoicesResponse(voices=[
            tts_pb2.Voice(name=v.name, description=v.description, language=v.language, is_default=v.name == default,
                          registered=v.name in registered)
            for v in self.engine.voices])

    async def RegisterVoice(self, request: tts_pb2.RegisterVoiceRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._abort(context, InvalidArgument(request.reason), "invalid")
        if not self.ready:
            await self._abort(context, Unavailable("the server is warming up; retry shortly"), "unavailable")
        try:
            voice = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.register_voice, request.name, request.reference.audio,
                request.reference.transcript, request.description)
        except RequestError as error:
            await self._abort(context, error, "invalid")
            return
        logger.info("registered voice %s (%d speech codes)", voice.name, voice.prompt.codes.numel())
        return tts_pb2.Voice(name=voice.name, description=voice.description, language=voice.language,
                             registered=True)

    async def DeleteVoice(self, request: tts_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._abort(context, InvalidArgument(request.reason), "invalid")
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.delete_voice, request.name)
        except RequestError as error:
            await self._abort(context, error, "invalid")
            return
        logger.info("deleted voice %s", request.name)
        return tts_pb2.DeleteVoiceResponse()


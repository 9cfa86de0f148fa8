"""The TextToSpeech servicer: validates requests, streams engine events as AudioChunk messages."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from audio_pipeline.context import StopReason
from audio_pipeline.engine import TTSEngine
from audio_pipeline.errors import (AlreadyExists, InvalidArgument, NotFound, RequestError, ResourceExhausted,
                                   Unavailable)
from audio_pipeline.pipelines.audio_generation import AudioEvent
from audio_pipeline.server.audio_output import StreamAudioOutput
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


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    def __init__(self, engine: TTSEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.ready = False

    async def _abort(self, context: grpc.aio.ServicerContext, error: RequestError, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        await context.abort(STATUS_OF_ERROR.get(type(error), grpc.StatusCode.INTERNAL), str(error))

    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        if not self.ready:
            await self._abort(context, Unavailable("the server is warming up; retry shortly"), "unavailable")
        try:
            reference = None
            if request.HasField("reference"):
                # Encoding the recording runs the decoder's encoder: keep it off the event loop.
                reference = await asyncio.get_running_loop().run_in_executor(
                    None, self.engine.reference_prompt, request.reference.audio, request.reference.transcript)
            tts_context = self.engine.create_context(
                request.text, voice=request.voice or None, request_id=request_id, reference=reference,
                **sampling_overrides(request))
            output = StreamAudioOutput(self.engine.sample_rate, request.sample_rate, request.encoding)
        except RequestError as error:
            await self._abort(context, error, "invalid")
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[AudioEvent] = asyncio.Queue()
        try:
            self.engine.submit(tts_context, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        except (ResourceExhausted, Unavailable) as error:
            await self._abort(context, error, "rejected")
            return
        logger.info("request %s: %d prompt tokens, voice %s", request_id, len(tts_context.prompt_ids),
                    tts_context.voice)
        finished = False
        try:
            yield tts_pb2.AudioChunk(request_id=request_id, format=tts_pb2.AudioFormat(
                sample_rate=output.sample_rate, encoding=output.encoding, channels=1))
            chunk_index = 0
            sent_samples = 0
            while True:
                event = await events.get()
                if event.kind == "audio":
                    samples = output.convert(event.samples)
                elif event.kind == "complete":
                    finished = True
                    if event.stop_reason == StopReason.CANCELLED:
                        await self._abort(context, Unavailable("the request was cancelled by the server "
                                                               "(shutting down)"), "cancelled")
                    samples = output.finish()
                else:
                    finished = True
                    self.metrics.requests.labels("failed").inc()
                    await context.abort(grpc.StatusCode.INTERNAL, event.error or "generation failed")
                if samples.size:
                    yield tts_pb2.AudioChunk(request_id=request_id, audio=tts_pb2.AudioFrames(
                        data=output.encode(samples), chunk_index=chunk_index, num_samples=samples.size))
                    chunk_index += 1
                    sent_samples += samples.size
                if event.kind == "complete":
                    usage = event.usage
                    audio_seconds = sent_samples / output.sample_rate
                    self.metrics.requests.labels("ok").inc()
                    yield tts_pb2.AudioChunk(request_id=request_id, complete=tts_pb2.SynthesisComplete(
                        stop_reason=STOP_REASONS.get(event.stop_reason, tts_pb2.STOP_REASON_UNSPECIFIED),
                        usage=tts_pb2.Usage(
                            prompt_tokens=usage.prompt_tokens, generated_tokens=usage.generated_tokens,
                            audio_seconds=audio_seconds,
                            time_to_first_audio_seconds=usage.time_to_first_audio_seconds,
                            generation_seconds=usage.generation_seconds)))
                    logger.info("request %s: %s, %d tokens, %.2f s audio, first audio %.3f s, total %.3f s",
                                request_id, event.stop_reason.value, usage.generated_tokens, audio_seconds,
                                usage.time_to_first_audio_seconds, usage.generation_seconds)
                    return
        finally:
            if not finished:
                # The client went away (cancel, deadline, broken stream): stop generating for it.
                self.engine.cancel(request_id)
                self.metrics.requests.labels("client_cancelled").inc()
                logger.info("request %s: cancelled by the client", request_id)

    async def ListVoices(self, request: tts_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext):
        default = self.engine.manifest.default_voice
        registered = {v.name for v in self.engine.registered_voices()}
        return tts_pb2.ListVoicesResponse(voices=[
            tts_pb2.Voice(name=v.name, description=v.description, language=v.language, is_default=v.name == default,
                          registered=v.name in registered)
            for v in self.engine.voices])

    async def RegisterVoice(self, request: tts_pb2.RegisterVoiceRequest, context: grpc.aio.ServicerContext):
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
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.delete_voice, request.name)
        except RequestError as error:
            await self._abort(context, error, "invalid")
            return
        logger.info("deleted voice %s", request.name)
        return tts_pb2.DeleteVoiceResponse()


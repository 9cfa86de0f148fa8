"""The gRPC front door: TextToSpeech messages to and from the speech service (service/speech.py)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from audio_pipeline.core.stop import StopReason
from audio_pipeline.errors import (AlreadyExists, GenerationFailed, InvalidArgument, NotFound, RequestError,
                                   ResourceExhausted, Unavailable)
from audio_pipeline.server.handlers import MalformedRequest
from audio_pipeline.service.request import SpeechAudio, SpeechRequest
from audio_pipeline.service.speech import LiveSpeechStream, SpeechService, SpeechStream, outcome_of
from audio_pipeline.text.pronunciations import Lexicon, from_entries
from audio_pipeline.text.timings import SEGMENT, WORD, WordTiming
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

logger = logging.getLogger(__name__)

STATUS_OF_ERROR = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    GenerationFailed: grpc.StatusCode.INTERNAL,
}
STOP_REASONS = {StopReason.END_OF_SPEECH: tts_pb2.STOP_REASON_END_OF_SPEECH,
                StopReason.MAX_TOKENS: tts_pb2.STOP_REASON_MAX_TOKENS}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "min_tokens", "seed",
                   "min_p", "frequency_penalty", "presence_penalty")
#: The proto's encodings by the service's format names (UNSPECIFIED is PCM16).
FORMATS = {tts_pb2.AUDIO_ENCODING_UNSPECIFIED: "pcm", tts_pb2.AUDIO_ENCODING_PCM16: "pcm",
           tts_pb2.AUDIO_ENCODING_FLOAT32: "float32", tts_pb2.AUDIO_ENCODING_WAV: "wav",
           tts_pb2.AUDIO_ENCODING_MP3: "mp3", tts_pb2.AUDIO_ENCODING_OPUS: "opus", tts_pb2.AUDIO_ENCODING_AAC: "aac",
           tts_pb2.AUDIO_ENCODING_FLAC: "flac", tts_pb2.AUDIO_ENCODING_MULAW: "mulaw",
           tts_pb2.AUDIO_ENCODING_ALAW: "alaw"}
ENCODINGS = {name: encoding for encoding, name in FORMATS.items() if encoding != tts_pb2.AUDIO_ENCODING_UNSPECIFIED}
PRECISIONS = {WORD: tts_pb2.TIMING_PRECISION_WORD, SEGMENT: tts_pb2.TIMING_PRECISION_SEGMENT}


def speech_request(message, field_prefix: str = "", reference: tts_pb2.ReferenceAudio | None = None) -> SpeechRequest:
    """The service's request of a SynthesizeRequest or StreamSettings message."""
    sampling = {name: getattr(message.sampling, name) for name in SAMPLING_FIELDS
                if message.sampling.HasField(name)}
    if message.sampling.stop_token_ids:
        sampling["stop_token_ids"] = list(message.sampling.stop_token_ids)
    if message.encoding not in FORMATS:
        raise InvalidArgument(f"unknown encoding {message.encoding}", field=f"{field_prefix}encoding")
    return SpeechRequest(
        text=getattr(message, "text", ""), voice=message.voice or None,
        reference_audio=reference.audio if reference is not None else None,
        reference_transcript=reference.transcript if reference is not None else "",
        normalize_text=message.normalize_text if message.HasField("normalize_text") else None,
        sampling=sampling, speed=message.speed if message.HasField("speed") else None,
        format=FORMATS[message.encoding], sample_rate=message.sample_rate,
        instructions=message.instructions or None, language=message.language or None,
        ssml=message.ssml if "ssml" in message.DESCRIPTOR.fields_by_name and message.HasField("ssml") else None,
        # (StreamSettings has no ssml: a live stream's text is plain text)
        pronunciations=from_entries([{k: v for k, v in (("word", p.word), ("phonemes", p.phonemes or None),
                                                         ("respelling", p.respelling or None)) if v is not None}
                                     for p in message.pronunciations], f"{field_prefix}pronunciations")
        if message.pronunciations else Lexicon(),
        label=message.request_id, label_field=f"{field_prefix}request_id")


def status_of(error: RequestError) -> grpc.StatusCode:
    """The status code of an error's class, or of the nearest class it derives from."""
    return next((STATUS_OF_ERROR[cls] for cls in type(error).__mro__ if cls in STATUS_OF_ERROR),
                grpc.StatusCode.INTERNAL)


def timing_message(timing: WordTiming) -> tts_pb2.WordTiming:
    return tts_pb2.WordTiming(text=timing.text, text_start=timing.text_start, text_end=timing.text_end,
                              start_sample=timing.start_sample, end_sample=timing.end_sample,
                              spoken=timing.spoken, precision=PRECISIONS[timing.precision])


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    def __init__(self, service: SpeechService):
        self.service = service
        self.engine = service.engine

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: RequestError) -> None:
        await context.abort(status_of(error), str(error))

    async def _refuse(self, context: grpc.aio.ServicerContext, error: RequestError) -> None:
        """Aborts the call with a refusal the service has not seen (counted here)."""
        self.service.count(outcome_of(error))
        await self._abort(context, error)

    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._refuse(context, InvalidArgument(request.reason))
        try:
            wanted = speech_request(request, reference=request.reference if request.HasField("reference") else None)
        except RequestError as error:
            await self._refuse(context, error)
        try:
            stream = await self.service.open(wanted)
        except RequestError as error:
            await self._abort(context, error)
            return
        async with aclosing(self._chunks(context, stream)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _chunks(self, context, stream: SpeechStream):
        """The stream's AudioChunk messages. The format message goes out with the first audio, not
        before: until a call's first message a client's gRPC retry policy may still send it to
        another replica (UNAVAILABLE from a replica draining), so nothing is committed before audio."""
        head = [tts_pb2.AudioChunk(request_id=stream.label, format=tts_pb2.AudioFormat(
            sample_rate=stream.sample_rate, encoding=ENCODINGS[stream.output.format], channels=1))]
        chunk_index = 0
        try:
            async with aclosing(stream.events()) as events:
                async for event in events:
                    if head:
                        yield head.pop()
                    if isinstance(event, SpeechAudio):
                        yield tts_pb2.AudioChunk(request_id=stream.label, audio=tts_pb2.AudioFrames(
                            data=event.data, chunk_index=chunk_index, num_samples=event.num_samples,
                            words=[timing_message(w) for w in event.words]))
                        chunk_index += 1
                        continue
                    usage = event.usage
                    yield tts_pb2.AudioChunk(request_id=stream.label, complete=tts_pb2.SynthesisComplete(
                        stop_reason=STOP_REASONS.get(event.stop_reason, tts_pb2.STOP_REASON_UNSPECIFIED),
                        usage=tts_pb2.Usage(
                            prompt_tokens=usage.prompt_tokens, generated_tokens=usage.generated_tokens,
                            audio_seconds=event.audio_seconds,
                            time_to_first_audio_seconds=usage.time_to_first_audio_seconds,
                            generation_seconds=usage.generation_seconds)))
        except RequestError as error:  # the engine failed, the server is stopping, a later segment
            await self._abort(context, error)
        finally:
            stream.close()

    async def SynthesizeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """Live text: settings first, then text pieces, flushes and the end of input (see the proto)."""
        first = await anext(aiter(request_iterator), None)
        if first is None:
            await self._refuse(context, InvalidArgument("the stream carried no message", field="settings"))
        if isinstance(first, MalformedRequest):
            await self._refuse(context, InvalidArgument(first.reason))
        if first.WhichOneof("content") != "settings":
            await self._refuse(context, InvalidArgument("the first message must carry the settings",
                                                        field="settings"))
        try:
            wanted = speech_request(first.settings, "settings.")
        except RequestError as error:
            await self._refuse(context, error)
        try:
            stream = self.service.open_live(wanted)
        except RequestError as error:
            await self._abort(context, error)
            return
        reader = asyncio.create_task(self._read_live_text(request_iterator, stream))
        try:
            try:
                await stream.start()  # the first sentence: its errors come before any audio
            except RequestError as error:
                await self._abort(context, error)
            async with aclosing(self._chunks(context, stream)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            reader.cancel()
            stream.close()

    @staticmethod
    async def _read_live_text(request_iterator, stream: LiveSpeechStream) -> None:
        """Feeds the call's text messages to the stream."""
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
                    await stream.text.add(message.text)
                elif kind == "flush":
                    await stream.text.flush()
                else:  # end_of_input
                    break
            await stream.text.end()  # the end of input, or the client half-closed its side
        except RequestError as error:
            stream.fail(error)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:  # the call ended (cancelled by the client): nothing left to read
            stream.end_input()

    async def ListVoices(self, request: tts_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._refuse(context, InvalidArgument(request.reason))
        default = self.engine.manifest.default_voice
        registered = {v.name for v in self.engine.voice_catalogue.registered()}
        return tts_pb2.ListVoicesResponse(voices=[
            tts_pb2.Voice(name=v.name, description=v.description, language=v.language, is_default=v.name == default,
                          registered=v.name in registered)
            for v in self.engine.voice_catalogue.listed])

    async def RegisterVoice(self, request: tts_pb2.RegisterVoiceRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._refuse(context, InvalidArgument(request.reason))
        if not self.service.ready:
            await self._refuse(context, Unavailable("the server is shutting down; retry on another replica"
                                                    if self.service.draining else "the server is warming up; retry shortly"))
        try:
            voice = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.voice_catalogue.register, request.name, request.reference.audio,
                request.reference.transcript, request.description)
        except RequestError as error:
            await self._refuse(context, error)
            return
        logger.info("registered voice %s (%d speech codes)", voice.name, voice.prompt.codes.numel())
        return tts_pb2.Voice(name=voice.name, description=voice.description, language=voice.language,
                             registered=True)

    async def DeleteVoice(self, request: tts_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await self._refuse(context, InvalidArgument(request.reason))
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.voice_catalogue.delete, request.name)
        except RequestError as error:
            await self._refuse(context, error)
            return
        logger.info("deleted voice %s", request.name)
        return tts_pb2.DeleteVoiceResponse()

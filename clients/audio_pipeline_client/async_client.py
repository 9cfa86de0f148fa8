"""AsyncTTSClient: the asyncio (grpc.aio) client of the audio-pipeline TextToSpeech service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing

import grpc

from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from audio_pipeline_client.protocol import (ReferenceAudio, StreamReader, async_text_inputs, build_request,
                                             build_stream_settings, result_from_chunks,
                                            voice_from_proto, voice_reference)
from audio_pipeline_client.transport import (
    HEALTH_CHECK_METHOD,
    PEMOption,
    RETRY_CODES,
    ReadinessProbe,
    TargetOption,
    TLSOption,
    call_metadata,
    channel_credentials,
    channel_options,
    grpc_target,
)
from audio_pipeline_client.types import AudioStreamChunk, SynthesisResult, TTSError, Voice


class AsyncTTSClient:
    """The asyncio twin of TTSClient: same arguments, same retries and deadlines, coroutines instead of calls.

    Create it inside a running event loop (grpc.aio channels belong to the loop that made them).
    """

    def __init__(self, target: TargetOption = "localhost:50051", *, timeout: float | None = None,
                 retries: int = 3, tls: TLSOption = False, token: str | None = None,
                 options: Mapping[str, object] | Sequence[tuple[str, object]] | None = None,
                 client_cert: PEMOption | None = None, client_key: PEMOption | None = None,
                 load_balancing: str = "round_robin", metadata: Sequence[tuple[str, str]] | None = None,
                 retry_codes: Sequence[str] = RETRY_CODES):
        self.target = grpc_target(target)
        self.timeout = timeout
        self.retries = retries
        credentials = channel_credentials(tls, client_cert, client_key)
        arguments = channel_options(options, retries=retries, load_balancing=load_balancing, retry_codes=retry_codes)
        self._channel = (grpc.aio.secure_channel(self.target, credentials, arguments) if credentials is not None
                         else grpc.aio.insecure_channel(self.target, arguments))
        self._metadata = call_metadata(token, metadata)
        self._stub = tts_pb2_grpc.TextToSpeechStub(self._channel)
        self._health_check = self._channel.unary_unary(HEALTH_CHECK_METHOD)

    async def __aenter__(self) -> AsyncTTSClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def synthesize(self, text: str, *, voice: str | None = None, seed: int | None = None,
                         max_tokens: int | None = None, min_tokens: int | None = None,
                         temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                         repetition_penalty: float | None = None, sample_rate: int | None = None,
                         encoding: str | int | None = None, request_id: str | None = None,
                   reference_audio: ReferenceAudio | None = None, reference_transcript: str | None = None,
                   min_p: float | None = None, frequency_penalty: float | None = None,
                   presence_penalty: float | None = None, stop_token_ids: Sequence[int] | None = None,
                   normalize_text: bool | None = None, speed: float | None = None,
                   language: str | None = None, instructions: str | None = None,
                   ssml: bool | None = None, pronunciations: Sequence[dict] | None = None) -> SynthesisResult:
        """Speaks ``text`` and returns the whole audio. Options left None take the server's defaults."""
        request = build_request(text, voice=voice, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k,
                                repetition_penalty=repetition_penalty, sample_rate=sample_rate,
                                encoding=encoding, request_id=request_id,
                                reference_audio=reference_audio, reference_transcript=reference_transcript,
                                min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                stop_token_ids=stop_token_ids, normalize_text=normalize_text, speed=speed,
                                language=language, instructions=instructions,
                                ssml=ssml, pronunciations=pronunciations)
        return result_from_chunks([chunk async for chunk in self._stream_request(request)], request.encoding)

    def stream(self, text: str, *, voice: str | None = None, seed: int | None = None,
               max_tokens: int | None = None, min_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               repetition_penalty: float | None = None, sample_rate: int | None = None,
               encoding: str | int | None = None, request_id: str | None = None,
                   reference_audio: ReferenceAudio | None = None, reference_transcript: str | None = None,
                   min_p: float | None = None, frequency_penalty: float | None = None,
                   presence_penalty: float | None = None, stop_token_ids: Sequence[int] | None = None,
                   normalize_text: bool | None = None, speed: float | None = None,
                   language: str | None = None, instructions: str | None = None,
                   ssml: bool | None = None, pronunciations: Sequence[dict] | None = None) -> AsyncIterator[AudioStreamChunk]:
        """Speaks ``text``: ``async for`` yields audio chunks as they arrive, then one final chunk with the usage.

        Closing the iterator (``await it.aclose()``, or ``contextlib.aclosing``) cancels the call; a loop
        left with ``break`` cancels it when the event loop finalizes the abandoned generator.
        """
        request = build_request(text, voice=voice, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k,
                                repetition_penalty=repetition_penalty, sample_rate=sample_rate,
                                encoding=encoding, request_id=request_id,
                                reference_audio=reference_audio, reference_transcript=reference_transcript,
                                min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                stop_token_ids=stop_token_ids, normalize_text=normalize_text, speed=speed,
                                language=language, instructions=instructions,
                                ssml=ssml, pronunciations=pronunciations)
        return self._stream_request(request)

    async def list_voices(self) -> list[Voice]:
        """The voices of the server, default first."""
        try:
            response = await self._stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=self.timeout,
                                                   metadata=self._metadata)
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error
        return [voice_from_proto(voice) for voice in response.voices]

    async def register_voice(self, name: str, audio: ReferenceAudio, transcript: str, *,
                       description: str = "") -> Voice:
        """Registers a cloned voice from a recording (an audio file's bytes or path) and its transcript;
        afterwards ``voice=name`` speaks with it, also after a server restart."""
        request = tts_pb2.RegisterVoiceRequest(name=name, reference=voice_reference(audio, transcript),
                                               description=description)
        try:
            return voice_from_proto(await self._stub.RegisterVoice(request, timeout=self.timeout,
                                                              metadata=self._metadata))
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error

    async def delete_voice(self, name: str) -> None:
        """Deletes a registered voice (TTSError NOT_FOUND when there is none of that name)."""
        try:
            await self._stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name=name), timeout=self.timeout,
                                    metadata=self._metadata)
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the server's health service reports SERVING; TTSError once ``timeout`` passes."""
        probe = ReadinessProbe(self.target, timeout)
        while True:
            try:
                reply = await self._health_check(probe.request(), timeout=probe.deadline.remaining(),
                                                 metadata=self._metadata, wait_for_ready=True)
                if probe.ready(reply):
                    return
            except grpc.RpcError as error:
                probe.failed(error)
            await asyncio.sleep(probe.next_wait())

    async def stream_text(self, pieces, **options) -> AsyncIterator[AudioStreamChunk]:
        """Live text (see TTSClient.stream_text); ``pieces`` may be an async or a plain iterable."""
        settings = build_stream_settings(**options)
        call = self._stub.SynthesizeStream(async_text_inputs(settings, pieces), timeout=self.timeout,
                                           metadata=self._metadata)
        async with aclosing(self._read(call)) as chunks:  # leaving early cancels the call now
            async for chunk in chunks:
                yield chunk

    async def _stream_request(self, request: tts_pb2.SynthesizeRequest) -> AsyncIterator[AudioStreamChunk]:
        call = self._stub.Synthesize(request, timeout=self.timeout, metadata=self._metadata)
        async with aclosing(self._read(call)) as chunks:
            async for chunk in chunks:
                yield chunk

    @staticmethod
    async def _read(call) -> AsyncIterator[AudioStreamChunk]:
        """A streaming call's chunks, checked in order; leaving early cancels the call."""
        reader = StreamReader()
        try:
            async for message in call:
                chunk = reader.read(message)
                if chunk is not None:
                    yield chunk
            reader.end()
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error
        finally:
            call.cancel()

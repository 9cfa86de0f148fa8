"""TTSClient: the blocking client of the audio-pipeline TextToSpeech service."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import grpc

from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from audio_pipeline_client.protocol import (ReferenceAudio, StreamReader, build_request,
                                             build_stream_settings, text_inputs, result_from_chunks,
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


class TTSClient:
    """A connection to one audio-pipeline server or a set of replicas.

    ``target`` is ``host:port``, a ``dns:///name:port`` that resolves to every replica (a headless
    Kubernetes service), or a list of ``ip:port`` replicas; calls are spread over the replicas by
    ``load_balancing`` (``round_robin``, or ``pick_first``: one connection). ``timeout`` is the
    deadline in seconds of each call, retries included (None: no deadline). A Synthesize or
    ListVoices call refused with UNAVAILABLE (a replica warming up, draining, gone) is retried up
    to ``retries`` times (at most 4) on the next replica, with exponential backoff from 0.2 s:
    gRPC's own retry policy; the server sends nothing before a stream's first audio, so a call is
    never retried once audio has arrived. ``retry_codes`` widens what is retried (behind Ray
    Serve, ``("UNAVAILABLE", "INTERNAL")``: its proxy reports a replica that died as INTERNAL).
    ``tls`` is False (plaintext), True (system roots), or the root certificates as bytes or a file
    path; ``client_cert`` and ``client_key`` (PEM bytes or paths) add a client certificate for
    servers that require one (mutual TLS). ``token`` is sent as ``authorization: Bearer``;
    ``metadata`` pairs go with every call (``[("application", "tts")]`` for a Ray Serve proxy).
    ``options`` are extra grpc channel arguments. Every failed call raises TTSError.
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
        self._channel = (grpc.secure_channel(self.target, credentials, arguments) if credentials is not None
                         else grpc.insecure_channel(self.target, arguments))
        self._metadata = call_metadata(token, metadata)
        self._stub = tts_pb2_grpc.TextToSpeechStub(self._channel)
        self._health_check = self._channel.unary_unary(HEALTH_CHECK_METHOD)

    def __enter__(self) -> TTSClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def synthesize(self, text: str, *, voice: str | None = None, seed: int | None = None,
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
        return result_from_chunks(list(self._stream_request(request)), request.encoding)

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
                   ssml: bool | None = None, pronunciations: Sequence[dict] | None = None) -> Iterator[AudioStreamChunk]:
        """Speaks ``text``, yielding audio chunks as they arrive and then one final chunk with the usage.

        Leaving the loop early (``break``) or calling ``.close()`` on the iterator cancels the call.
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

    def list_voices(self) -> list[Voice]:
        """The voices of the server, default first."""
        try:
            response = self._stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=self.timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error
        return [voice_from_proto(voice) for voice in response.voices]

    def register_voice(self, name: str, audio: ReferenceAudio, transcript: str, *,
                       description: str = "") -> Voice:
        """Registers a cloned voice from a recording (an audio file's bytes or path) and its transcript;
        afterwards ``voice=name`` speaks with it, also after a server restart."""
        request = tts_pb2.RegisterVoiceRequest(name=name, reference=voice_reference(audio, transcript),
                                               description=description)
        try:
            return voice_from_proto(self._stub.RegisterVoice(request, timeout=self.timeout,
                                                              metadata=self._metadata))
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error

    def delete_voice(self, name: str) -> None:
        """Deletes a registered voice (TTSError NOT_FOUND when there is none of that name)."""
        try:
            self._stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name=name), timeout=self.timeout,
                                    metadata=self._metadata)
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the server's health service reports SERVING; TTSError once ``timeout`` passes."""
        probe = ReadinessProbe(self.target, timeout)
        while True:
            try:
                reply = self._health_check(probe.request(), timeout=probe.deadline.remaining(),
                                           metadata=self._metadata, wait_for_ready=True)
                if probe.ready(reply):
                    return
            except grpc.RpcError as error:
                probe.failed(error)
            time.sleep(probe.next_wait())

    def stream_text(self, pieces, **options) -> Iterator[AudioStreamChunk]:
        """Live text: speaks text as its pieces arrive (an LLM's tokens, lines; ``FLUSH`` from this
        package speaks what has come so far at once), yielding audio chunks as one continuous
        stream, then a final chunk with the usage. ``options`` are those of :meth:`stream` except
        the reference recording. Leaving the loop early cancels the call (barge-in)."""
        settings = build_stream_settings(**options)
        yield from self._read(self._stub.SynthesizeStream(text_inputs(settings, pieces), timeout=self.timeout,
                                                          metadata=self._metadata))

    def _stream_request(self, request: tts_pb2.SynthesizeRequest) -> Iterator[AudioStreamChunk]:
        yield from self._read(self._stub.Synthesize(request, timeout=self.timeout, metadata=self._metadata))

    @staticmethod
    def _read(call) -> Iterator[AudioStreamChunk]:
        """A streaming call's chunks, checked in order; leaving early cancels the call."""
        reader = StreamReader()
        try:
            for message in call:
                chunk = reader.read(message)
                if chunk is not None:
                    yield chunk
            reader.end()
        except grpc.RpcError as error:
            raise TTSError.from_rpc_error(error) from error
        finally:
            call.cancel()

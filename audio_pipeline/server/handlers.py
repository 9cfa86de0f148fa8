"""The TextToSpeech service's method handlers, with request decoding done by the service itself.

grpc's generated registration decodes each request before the handler runs; bytes that do not
parse (a corrupt message, invalid UTF-8 in a string field) then end the call with UNKNOWN and an
exception text. Here a request that does not parse becomes a :class:`MalformedRequest`, which the
handler answers with INVALID_ARGUMENT naming what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from audio_pipeline_client._proto import tts_pb2

SERVICE_NAME = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that are not a valid message of the method's type."""

    reason: str


def _decoder(message_type):
    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:  # noqa: PERF203
            detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            return MalformedRequest(f"the request is not a valid {message_type.DESCRIPTOR.name} ({detail})")
    return decode


def add_text_to_speech(servicer, server: grpc.aio.Server) -> None:
    """Registers ``servicer``'s methods on ``server`` (what the generated add_..._to_server does,
    with decoding that reports malformed requests to the handler)."""
    unary = {"ListVoices": (tts_pb2.ListVoicesRequest, tts_pb2.ListVoicesResponse),
             "RegisterVoice": (tts_pb2.RegisterVoiceRequest, tts_pb2.Voice),
             "DeleteVoice": (tts_pb2.DeleteVoiceRequest, tts_pb2.DeleteVoiceResponse)}
    handlers = {"Synthesize": grpc.unary_stream_rpc_method_handler(
        servicer.Synthesize, request_deserializer=_decoder(tts_pb2.SynthesizeRequest),
        response_serializer=tts_pb2.AudioChunk.SerializeToString)}
    handlers["SynthesizeStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.SynthesizeStream, request_deserializer=_decoder(tts_pb2.TextInput),
        response_serializer=tts_pb2.AudioChunk.SerializeToString)
    for name, (request_type, response_type) in unary.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=_decoder(request_type),
            response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

"""Hostile and malformed requests against a real server: each gets a clear status naming its field,
and none of them harms the well-formed requests running beside it."""

from __future__ import annotations

import threading

import grpc
import pytest

from audio_pipeline_client._proto import tts_pb2_grpc
from helpers import TEST_MAX_TOKENS, grpc_request

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

SYNTHESIZE = "/audio_pipeline.v1.TextToSpeech/Synthesize"


def request(text="Hello world.", **fields):
    return grpc_request(text, **fields)


def status_of(stub, message):
    try:
        list(stub.Synthesize(message, timeout=120))
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture
def channel(idle_server):
    with grpc.insecure_channel(idle_server.target) as channel:
        yield channel


@pytest.mark.parametrize("sampling,field", [
    (dict(repetition_penalty=1e-45), "sampling.repetition_penalty"),
    (dict(repetition_penalty=1e-40), "sampling.repetition_penalty"),
    (dict(repetition_penalty=1e6), "sampling.repetition_penalty"),
    (dict(temperature=float("inf")), "sampling.temperature"),
    (dict(temperature=float("nan")), "sampling.temperature"),
    (dict(stop_token_ids=[999999]), "sampling.stop_token_ids"),
    (dict(stop_token_ids=[4608 * 40]), "sampling.stop_token_ids"),
    (dict(stop_token_ids=list(range(1000))), "sampling.stop_token_ids"),
    (dict(voice="v" * 100_000), "voice"),
])
def test_bad_values_are_refused_by_field_while_neighbours_run(channel, sampling, field):
    """Each bad request ends with INVALID_ARGUMENT naming the field, its message stays short (no
    echo of a huge value), and requests sent at the same moment finish normally."""
    stub = tts_pb2_grpc.TextToSpeechStub(channel)
    innocents = [None] * 4

    def innocent(i):
        innocents[i] = status_of(stub, request(seed=i, max_tokens=TEST_MAX_TOKENS))

    threads = [threading.Thread(target=innocent, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    code, details = status_of(stub, request(**sampling))
    for thread in threads:
        thread.join()
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
    assert details.startswith(field) and len(details) < 300
    assert innocents == [(grpc.StatusCode.OK, "")] * 4


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff\x0f",          # a truncated varint
    b"\x0a\x05abc",                    # a string field longer than the message
    b"\x0a\x02\xff\xfe",               # text that is not UTF-8
    b"\x12\x03\xc3\x28\x41",           # a voice name that is not UTF-8
    b"\x1a\x02\x08",                   # a truncated sampling message
])
def test_undecodable_requests_get_invalid_argument_not_unknown(channel, payload):
    raw = channel.unary_stream(SYNTHESIZE, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(payload, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid SynthesizeRequest" in caught.value.details()
    # The server goes on serving.
    stub = tts_pb2_grpc.TextToSpeechStub(channel)
    assert status_of(stub, request(max_tokens=TEST_MAX_TOKENS)) == (grpc.StatusCode.OK, "")


def test_unary_methods_decode_their_own_requests_too(channel):
    raw = channel.unary_unary("/audio_pipeline.v1.TextToSpeech/DeleteVoice", request_serializer=None,
                              response_deserializer=None)
    with pytest.raises(grpc.RpcError) as caught:
        raw(b"\x0a\x02\xff\xfe", timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_client_request_id_is_a_label_that_cannot_reach_another_clients_request(idle_server):
    """A second request carrying a running request's id is refused (ALREADY_EXISTS) instead of
    sharing it; cancelling the first does not touch any other request; labels come back as sent."""
    with grpc.insecure_channel(idle_server.target) as first_channel, \
            grpc.insecure_channel(idle_server.target) as second_channel:
        first = tts_pb2_grpc.TextToSpeechStub(first_channel)
        second = tts_pb2_grpc.TextToSpeechStub(second_channel)
        running = first.Synthesize(request(max_tokens=4000, min_tokens=4000, request_id="shared"), timeout=120)
        assert next(running).WhichOneof("content") == "format"
        code, details = status_of(second, request(max_tokens=TEST_MAX_TOKENS, request_id="shared"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and details.startswith("request_id")
        other = second.Synthesize(request(max_tokens=TEST_MAX_TOKENS, request_id="other\nforged log line"),
                                  timeout=120)
        assert next(other).request_id == "other\nforged log line"
        running.cancel()
        rest = list(other)
        assert rest[-1].WhichOneof("content") == "complete"
        # Once the first is gone its label is free again.
        assert status_of(second, request(max_tokens=TEST_MAX_TOKENS, request_id="shared")) == \
            (grpc.StatusCode.OK, "")


@pytest.mark.parametrize("audio", [b"garbage" * 10, b"RIFF\x00\x00\x00\x00WAVEfmt ", b"\x00" * 100])
def test_unreadable_reference_audio_is_refused_without_leaking_internals(channel, audio):
    stub = tts_pb2_grpc.TextToSpeechStub(channel)
    message = request(max_tokens=TEST_MAX_TOKENS)
    message.reference.audio = audio
    message.reference.transcript = "Hello world."
    code, details = status_of(stub, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("reference.audio: cannot be read as audio") and "0x" not in details

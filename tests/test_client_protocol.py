"""The client library's pure logic: audio decoding, request building, stream-order checks, errors, retries."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from audio_pipeline_client import TTSError
from audio_pipeline_client._proto import tts_pb2
from audio_pipeline_client.protocol import (
    FLOAT32,
    PCM16,
    StreamReader,
    build_request,
    decode_samples,
    encode_samples,
    float_to_pcm16,
    parse_encoding,
    result_from_chunks,
    voice_from_proto,
)
from audio_pipeline_client.transport import (
    TTS_SERVICE_NAME,
    ReadinessProbe,
    channel_options,
    decode_health_status,
    encode_health_request,
    grpc_target,
    service_config,
)


def pcm16_bytes(values):
    return np.asarray(values, dtype="<i2").tobytes()


def test_pcm16_decodes_to_float32_in_unit_range():
    samples = decode_samples(pcm16_bytes([-32768, -16384, 0, 16384, 32767]), PCM16)
    assert samples.dtype == np.float32
    np.testing.assert_array_equal(samples, np.array([-1.0, -0.5, 0.0, 0.5, 32767 / 32768], dtype=np.float32))


def test_unspecified_encoding_reads_as_pcm16():
    data = pcm16_bytes([100, -200])
    np.testing.assert_array_equal(decode_samples(data, tts_pb2.AUDIO_ENCODING_UNSPECIFIED),
                                  decode_samples(data, PCM16))


def test_float32_decodes_little_endian_and_clips_to_unit_range():
    data = np.array([0.25, -0.75, 1.5, -2.0], dtype="<f4").tobytes()
    samples = decode_samples(data, FLOAT32)
    assert samples.dtype == np.float32
    np.testing.assert_array_equal(samples, np.array([0.25, -0.75, 1.0, -1.0], dtype=np.float32))


@pytest.mark.parametrize("encoding, size", [(PCM16, 3), (FLOAT32, 6)])
def test_partial_sample_is_a_protocol_violation(encoding, size):
    with pytest.raises(TTSError, match="protocol violation") as caught:
        decode_samples(b"\x00" * size, encoding)
    assert caught.value.code == grpc.StatusCode.INTERNAL


def test_pcm16_round_trip_is_exact_for_every_value():
    every_value = np.arange(-32768, 32768, dtype=np.int16)
    samples = decode_samples(every_value.astype("<i2").tobytes(), PCM16)
    np.testing.assert_array_equal(float_to_pcm16(samples), every_value)
    assert encode_samples(samples, PCM16) == every_value.astype("<i2").tobytes()


def test_encode_float32_is_little_endian_wire_layout():
    samples = np.array([0.5, -0.25], dtype=np.float32)
    assert encode_samples(samples, FLOAT32) == samples.astype("<f4").tobytes()
    np.testing.assert_array_equal(decode_samples(encode_samples(samples, FLOAT32), FLOAT32), samples)


@pytest.mark.parametrize("name, expected", [
    ("pcm16", PCM16), ("PCM16", PCM16), ("f32", FLOAT32), ("float32", FLOAT32), (" Float32 ", FLOAT32),
    ("AUDIO_ENCODING_FLOAT32", FLOAT32), (tts_pb2.AUDIO_ENCODING_PCM16, PCM16), (2, FLOAT32), (None, None),
    ("mp3", tts_pb2.AUDIO_ENCODING_MP3), ("MuLaw", tts_pb2.AUDIO_ENCODING_MULAW), (7, tts_pb2.AUDIO_ENCODING_FLAC),
])
def test_parse_encoding(name, expected):
    assert parse_encoding(name) == expected


@pytest.mark.parametrize("name", ["wma", "", 70, True, 1.0])
def test_parse_encoding_rejects_unknown(name):
    with pytest.raises(ValueError, match="encoding"):
        parse_encoding(name)


def test_request_with_only_text_sends_nothing_else():
    request = build_request("Hello.")
    assert not request.HasField("sampling")
    assert request.SerializeToString() == tts_pb2.SynthesizeRequest(text="Hello.").SerializeToString()


def test_request_sends_zero_values_that_were_given():
    request = build_request("Hi", seed=0, temperature=0.0)
    assert request.HasField("sampling")
    assert request.sampling.HasField("seed") and request.sampling.seed == 0
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    for unset in ("top_p", "top_k", "repetition_penalty", "max_tokens", "min_tokens"):
        assert not request.sampling.HasField(unset)


def test_request_carries_every_option():
    request = build_request("Hi", voice="tara", seed=7, max_tokens=100, min_tokens=10, temperature=0.6,
                            top_p=0.9, top_k=40, repetition_penalty=1.1, sample_rate=16000, encoding="f32",
                            request_id="req-1")
    assert (request.text, request.voice, request.sample_rate, request.encoding, request.request_id) == (
        "Hi", "tara", 16000, FLOAT32, "req-1")
    sampling = request.sampling
    assert (sampling.seed, sampling.max_tokens, sampling.min_tokens, sampling.top_k) == (7, 100, 10, 40)
    assert sampling.temperature == pytest.approx(0.6)
    assert sampling.top_p == pytest.approx(0.9)
    assert sampling.repetition_penalty == pytest.approx(1.1)


def test_request_rejects_a_bad_encoding_before_sending():
    with pytest.raises(ValueError, match="encoding"):
        build_request("Hi", encoding="ogg")


def format_message(request_id="r", sample_rate=24000, encoding=PCM16, channels=1):
    return tts_pb2.AudioChunk(request_id=request_id, format=tts_pb2.AudioFormat(
        sample_rate=sample_rate, encoding=encoding, channels=channels))


def audio_message(index, values=(1, 2, 3), request_id="r", num_samples=None):
    return tts_pb2.AudioChunk(request_id=request_id, audio=tts_pb2.AudioFrames(
        data=pcm16_bytes(values), chunk_index=index, num_samples=len(values) if num_samples is None else num_samples))


def complete_message(request_id="r", stop_reason=tts_pb2.STOP_REASON_END_OF_SPEECH):
    return tts_pb2.AudioChunk(request_id=request_id, complete=tts_pb2.SynthesisComplete(
        stop_reason=stop_reason, usage=tts_pb2.Usage(prompt_tokens=5, generated_tokens=28, audio_seconds=0.25,
                                                     time_to_first_audio_seconds=0.1, generation_seconds=0.3)))


def read_all(messages):
    reader = StreamReader()
    chunks = [chunk for chunk in map(reader.read, messages) if chunk is not None]
    reader.end()
    return chunks


def test_well_ordered_stream_yields_audio_then_one_final_chunk():
    chunks = read_all([format_message(), audio_message(0, [0, 16384]), audio_message(1, [-16384]),
                       complete_message(stop_reason=tts_pb2.STOP_REASON_MAX_TOKENS)])
    assert [(chunk.index, chunk.final, chunk.samples.size) for chunk in chunks] == [(0, False, 2), (1, False, 1),
                                                                                   (2, True, 0)]
    assert all(chunk.sample_rate == 24000 and chunk.request_id == "r" for chunk in chunks)
    assert chunks[0].usage is None and chunks[0].stop_reason is None
    final = chunks[-1]
    assert final.stop_reason == "max_tokens"
    assert final.usage.generated_tokens == 28 and final.usage.time_to_first_audio_seconds == pytest.approx(0.1)
    result = result_from_chunks(chunks)
    np.testing.assert_array_equal(result.samples, np.array([0.0, 0.5, -0.5], dtype=np.float32))
    assert (result.sample_rate, result.stop_reason, result.request_id) == (24000, "max_tokens", "r")
    assert result.duration_seconds == pytest.approx(3 / 24000)


def test_stream_without_audio_is_valid_and_gives_empty_samples():
    chunks = read_all([format_message(sample_rate=16000), complete_message()])
    assert len(chunks) == 1 and chunks[0].final and chunks[0].index == 0
    result = result_from_chunks(chunks)
    assert result.samples.dtype == np.float32 and result.samples.size == 0 and result.sample_rate == 16000
    assert result.stop_reason == "end_of_speech"


@pytest.mark.parametrize("messages, complaint", [
    ([audio_message(0), complete_message()], "before the format"),
    ([complete_message()], "before the format"),
    ([format_message(), format_message()], "second format"),
    ([format_message(), audio_message(1)], "chunk 1 arrived where chunk 0"),
    ([format_message(), audio_message(0), audio_message(0)], "chunk 0 arrived where chunk 1"),
    ([format_message(), audio_message(0), audio_message(2)], "chunk 2 arrived where chunk 1"),
    ([format_message(), complete_message(), audio_message(0)], "after the completion"),
    ([format_message(), complete_message(), complete_message()], "after the completion"),
    ([format_message(), audio_message(0, num_samples=5)], "says 5 samples but carries 3"),
    ([format_message(), audio_message(0, request_id="other")], "request id changed"),
    ([format_message(channels=2)], "mono"),
    ([format_message(sample_rate=0)], "no sample rate"),
    ([format_message(encoding=99)], "unknown audio encoding"),
    ([format_message(), tts_pb2.AudioChunk(request_id="r")], "no content"),
    ([format_message(), audio_message(0)], "without a completion"),
    ([], "without a completion"),
])
def test_stream_order_violations_raise_a_clear_error(messages, complaint):
    with pytest.raises(TTSError, match=complaint) as caught:
        read_all(messages)
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert str(caught.value).startswith("INTERNAL: protocol violation: ")


def test_error_message_is_one_line_code_and_details():
    error = TTSError(grpc.StatusCode.INVALID_ARGUMENT, "text: must not be empty")
    assert str(error) == "INVALID_ARGUMENT: text: must not be empty"
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.details == "text: must not be empty"
    assert str(TTSError(grpc.StatusCode.UNAVAILABLE, "failed to connect\n  last error:\tref")) == (
        "UNAVAILABLE: failed to connect last error: ref")
    assert str(TTSError(grpc.StatusCode.CANCELLED, "")) == "CANCELLED"


class FailedCall(grpc.RpcError):
    """A stand-in for the RpcError grpc raises: it has code() and details()."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_error_from_rpc_error():
    error = TTSError.from_rpc_error(FailedCall(grpc.StatusCode.NOT_FOUND, "voice: unknown voice 'x'"))
    assert (error.code, str(error)) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND: voice: unknown voice 'x'")
    assert str(TTSError.from_rpc_error(FailedCall(grpc.StatusCode.INTERNAL, None))) == "INTERNAL"


def test_service_config_retries_only_unavailable_of_the_calls_that_change_nothing():
    config = json.loads(service_config(3))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert {(n["service"], n["method"]) for n in method["name"]} == {
        (TTS_SERVICE_NAME, "Synthesize"), (TTS_SERVICE_NAME, "ListVoices")}
    policy = method["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"] and policy["maxAttempts"] == 4
    assert policy["initialBackoff"] == "0.2s" and policy["backoffMultiplier"] == 2
    assert json.loads(service_config(10))["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5  # gRPC's cap
    assert "methodConfig" not in json.loads(service_config(0, "pick_first"))
    with pytest.raises(ValueError, match="load_balancing"):
        service_config(3, "random")


def test_a_caller_service_config_wins_and_retries_can_be_switched_off():
    mine = '{"loadBalancingConfig": [{"pick_first": {}}]}'
    options = dict(channel_options({"grpc.service_config": mine}))
    assert options["grpc.service_config"] == mine
    assert dict(channel_options(None, retries=0))["grpc.enable_retries"] == 0


@pytest.mark.parametrize("targets, expected", [
    ("localhost:50051", "localhost:50051"),
    ("dns:///tts.default.svc:50051", "dns:///tts.default.svc:50051"),
    (["10.0.0.1:50051"], "10.0.0.1:50051"),
    (["10.0.0.1:50051", "10.0.0.2:50052"], "ipv4:10.0.0.1:50051,10.0.0.2:50052"),
    (["[::1]:50051", "[fe80::2]:50051"], "ipv6:[::1]:50051,[fe80::2]:50051"),
])
def test_targets_become_one_grpc_target(targets, expected):
    assert grpc_target(targets) == expected


@pytest.mark.parametrize("targets, complaint", [
    (["tts-a:50051", "tts-b:50051"], "dns:///"),
    (["10.0.0.1:50051", "[::1]:50051"], "all IPv4 or all IPv6"),
    (["10.0.0.1:x", "10.0.0.2:1"], "no port"),
    ([], "empty"),
    ("", "host:port"),
])
def test_bad_targets_name_the_problem(targets, complaint):
    with pytest.raises(ValueError, match=complaint):
        grpc_target(targets)


@pytest.mark.parametrize("service", ["", TTS_SERVICE_NAME, "x" * 300])
def test_health_request_encoding_matches_protobuf(service):
    assert encode_health_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()


@pytest.mark.parametrize("status", [0, 1, 2, 3])
def test_health_status_decoding_matches_protobuf(status):
    assert decode_health_status(health_pb2.HealthCheckResponse(status=status).SerializeToString()) == status


def test_health_decoding_skips_unknown_fields_and_rejects_truncation():
    unknown_fields = b"\x12\x03abc" + b"\x19" + b"\x00" * 8 + b"\x25" + b"\x00" * 4 + b"\x30\x96\x01"
    assert decode_health_status(unknown_fields + b"\x08\x01") == 1
    for truncated in (b"\x08", b"\x12\x05ab", b"\x08\x80"):
        with pytest.raises(ValueError):
            decode_health_status(truncated)


def test_readiness_probe_falls_back_to_the_whole_server_then_gives_up():
    probe = ReadinessProbe("host:1", timeout=0.0)
    assert probe.request() == encode_health_request(TTS_SERVICE_NAME)
    probe.failed(FailedCall(grpc.StatusCode.NOT_FOUND, "unknown service"))
    assert probe.request() == b""
    assert not probe.ready(health_pb2.HealthCheckResponse(status=2).SerializeToString())
    with pytest.raises(TTSError, match="not ready after 0 s .last answer: NOT_SERVING") as caught:
        probe.next_wait()
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert probe.ready(health_pb2.HealthCheckResponse(status=1).SerializeToString())


def test_readiness_probe_stops_at_once_without_a_health_service():
    probe = ReadinessProbe("host:1", timeout=10.0)
    with pytest.raises(TTSError, match="UNIMPLEMENTED"):
        probe.failed(FailedCall(grpc.StatusCode.UNIMPLEMENTED, "Method not found"))
    probe.failed(FailedCall(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert 0 < probe.next_wait() <= 0.1


def test_voice_from_proto():
    voice = voice_from_proto(tts_pb2.Voice(name="tara", description="d", language="en-US", is_default=True))
    assert (voice.name, voice.description, voice.language, voice.is_default) == ("tara", "d", "en-US", True)


def test_library_imports_without_torch_or_transformers():
    code = ("import sys, audio_pipeline_client, audio_pipeline_client.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'audio_pipeline')))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"

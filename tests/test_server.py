"""The gRPC service end to end: a real server on a free port, driven with the generated stubs."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from audio_pipeline.context import StopReason
from audio_pipeline.engine import TTSEngine
from audio_pipeline.server.background import BackgroundServer
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from conftest import TEST_MAX_TOKENS, make_config, wait_idle

SAMPLES_PER_FRAME = 2048


@pytest.fixture
def stub(idle_server):
    with grpc.insecure_channel(idle_server.target) as channel:
        yield tts_pb2_grpc.TextToSpeechStub(channel)


def request(text="Hello world.", **sampling):
    fields = {k: sampling.pop(k) for k in ("voice", "sample_rate", "encoding", "request_id") if k in sampling}
    return tts_pb2.SynthesizeRequest(text=text, sampling=tts_pb2.SamplingParams(**sampling), **fields)


def pcm16(chunk):
    return np.frombuffer(chunk.audio.data, dtype="<i2")


def test_stream_order_and_framing(stub):
    messages = list(stub.Synthesize(request(seed=1, max_tokens=TEST_MAX_TOKENS, request_id="order-1"), timeout=120))
    kinds = [m.WhichOneof("content") for m in messages]
    assert kinds[0] == "format" and kinds[-1] == "complete" and set(kinds[1:-1]) == {"audio"}
    assert all(m.request_id == "order-1" for m in messages)
    fmt = messages[0].format
    assert (fmt.sample_rate, fmt.encoding, fmt.channels) == (24000, tts_pb2.AUDIO_ENCODING_PCM16, 1)
    audio = messages[1:-1]
    assert [m.audio.chunk_index for m in audio] == list(range(len(audio)))
    # This model has no word alignment: the sentence's timing comes once its audio is out, in a
    # last message of timings only.
    timing = audio.pop()
    assert timing.audio.num_samples == 0 and not timing.audio.data
    assert [(w.text, w.precision) for w in timing.audio.words] == [("Hello world.",
                                                                   tts_pb2.TIMING_PRECISION_SEGMENT)]
    for m in audio:
        assert m.audio.num_samples == len(m.audio.data) // 2 > 0 and not m.audio.words
    # chunk_size=28,56: 4 + 8 frames, then the rest; the random model runs to max_tokens (20 frames).
    assert [m.audio.num_samples // SAMPLES_PER_FRAME for m in audio] == [4, 8, 8]
    complete = messages[-1].complete
    assert complete.stop_reason == tts_pb2.STOP_REASON_MAX_TOKENS
    usage = complete.usage
    assert usage.generated_tokens == TEST_MAX_TOKENS and usage.prompt_tokens > 7
    total = sum(m.audio.num_samples for m in audio)
    assert total == TEST_MAX_TOKENS // 7 * SAMPLES_PER_FRAME
    assert usage.audio_seconds == pytest.approx(total / 24000)
    assert 0 < usage.time_to_first_audio_seconds <= usage.generation_seconds


def test_same_seed_same_audio_and_different_seed_different_audio(stub):
    def audio(seed):
        chunks = stub.Synthesize(request(seed=seed, max_tokens=28), timeout=60)
        return b"".join(m.audio.data for m in chunks if m.HasField("audio"))

    assert audio(5) == audio(5) != audio(6)


def test_resampled_float32_stream(stub):
    messages = list(stub.Synthesize(request(seed=2, max_tokens=70, sample_rate=16000,
                                            encoding=tts_pb2.AUDIO_ENCODING_FLOAT32), timeout=60))
    assert messages[0].format.sample_rate == 16000
    assert messages[0].format.encoding == tts_pb2.AUDIO_ENCODING_FLOAT32
    samples = np.concatenate([np.frombuffer(m.audio.data, dtype="<f4") for m in messages if m.HasField("audio")])
    native = 10 * SAMPLES_PER_FRAME
    assert abs(samples.size - native * 16000 / 24000) <= 2
    assert np.isfinite(samples).all() and np.abs(samples).max() <= 1.0 and np.abs(samples).max() > 0
    assert messages[-1].complete.usage.audio_seconds == pytest.approx(samples.size / 16000)


def test_list_voices(stub):
    voices = stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices
    names = [v.name for v in voices]
    assert "tara" in names and voices[0].is_default and sum(v.is_default for v in voices) == 1


def test_voice_changes_the_prompt(stub):
    def usage(voice):
        return list(stub.Synthesize(request(voice=voice, max_tokens=7, seed=0), timeout=60))[-1].complete.usage

    assert usage("leo").prompt_tokens == usage("tara").prompt_tokens - 1  # "leo" is one byte shorter


BAD_REQUESTS = [
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (dict(text="   \n"), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (dict(text="x" * 100_001), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (dict(voice="nobody"), grpc.StatusCode.NOT_FOUND, "voice"),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    (dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    (dict(top_k=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    (dict(repetition_penalty=0.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty"),
    (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
    (dict(max_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
    (dict(max_tokens=14, min_tokens=21), grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_tokens"),
    (dict(min_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
    (dict(frequency_penalty=3.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.frequency_penalty"),
    (dict(presence_penalty=-3.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty"),
    (dict(sample_rate=1000), grpc.StatusCode.INVALID_ARGUMENT, "sample_rate"),
    (dict(sample_rate=400000), grpc.StatusCode.INVALID_ARGUMENT, "sample_rate"),
    (dict(encoding=99), grpc.StatusCode.INVALID_ARGUMENT, "encoding"),
    (dict(request_id="r" * 200), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
]


@pytest.mark.parametrize("fields, code, field", BAD_REQUESTS, ids=[f"{c.name}-{f}" for _, c, f in BAD_REQUESTS])
def test_bad_requests_are_answered_with_the_field_and_the_server_keeps_serving(stub, fields, code, field):
    text = fields.pop("text", "Hello.")
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Synthesize(request(text, **fields), timeout=30))
    assert caught.value.code() == code
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()
    ok = list(stub.Synthesize(request(max_tokens=7), timeout=60))
    assert ok[-1].HasField("complete")


def test_every_sampling_override_is_accepted(stub):
    messages = list(stub.Synthesize(request(temperature=0.8, top_p=0.9, top_k=100, min_p=0.05, repetition_penalty=1.2,
                                            frequency_penalty=0.5, presence_penalty=0.3, max_tokens=28, min_tokens=7,
                                            seed=3, stop_token_ids=[128009]), timeout=60))
    assert messages[-1].HasField("complete")


def test_client_cancel_mid_stream_ends_generation(idle_server, stub):
    call = stub.Synthesize(request(max_tokens=4000, min_tokens=4000, request_id="cancel-me"), timeout=120)
    seen = 0
    for message in call:
        seen += message.HasField("audio")
        if seen == 2:
            break
    cancelled = idle_server.engine.generation.stop_reasons[StopReason.CANCELLED]
    call.cancel()
    wait_idle(idle_server.engine)  # generation stopped and everything it held is released
    assert idle_server.engine.generation.stop_reasons[StopReason.CANCELLED] == cancelled + 1


def test_deadline_stops_generation(idle_server, stub):
    cancelled = idle_server.engine.generation.stop_reasons[StopReason.CANCELLED]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Synthesize(request(max_tokens=4000, min_tokens=4000), timeout=1.0))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(idle_server.engine)
    assert idle_server.engine.generation.stop_reasons[StopReason.CANCELLED] == cancelled + 1


def test_concurrent_streams_equal_the_same_requests_one_at_a_time(stub):
    def run(seed):
        return np.concatenate([pcm16(m) for m in stub.Synthesize(request(f"Sentence {seed}.", seed=seed, max_tokens=56),
                                                                 timeout=120) if m.HasField("audio")]).astype(int)

    alone = [run(s) for s in range(4)]
    together = [None] * 4
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(i))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Same tokens; batched decoder kernels round differently, so allow one PCM16 step.
    for a, b in zip(alone, together):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1


def test_reflection_lists_the_service(tts_server):
    with grpc.insecure_channel(tts_server.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "audio_pipeline.v1.TextToSpeech" in services and "grpc.health.v1.Health" in services


def health_status(target, service=""):
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_is_not_serving_until_warm_up_is_done(tiny_model_dir):
    engine = TTSEngine(make_config(tiny_model_dir))
    gate = threading.Event()
    real_warmup = engine.warmup

    def gated_warmup():
        gate.wait(60)
        return real_warmup()

    engine.warmup = gated_warmup
    server = BackgroundServer(engine.config, engine=engine).start(wait_ready=False)
    try:
        for service in ("", "audio_pipeline.v1.TextToSpeech"):
            assert health_status(server.target, service) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as caught:
            list(tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(request(), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        server.wait_ready(60)
        assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        server.stop()


def test_a_full_queue_answers_resource_exhausted(tiny_model_dir):
    config = make_config(tiny_model_dir, "max_batch_size=1", "max_queue_size=1")
    with BackgroundServer(config) as server, grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        long = request(max_tokens=4000, min_tokens=4000)
        running = stub.Synthesize(long, timeout=120)
        next(running), next(running)  # format, first audio: this one holds the only batch slot
        queued = stub.Synthesize(long, timeout=120)
        deadline = time.monotonic() + 30
        while server.engine.generation.load != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Synthesize(request(max_tokens=7), timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in caught.value.details()
        running.cancel()
        queued.cancel()
        wait_idle(server.engine)

"""The gRPC service end to end: a real server on a free port, driven with the generated stubs."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from audio_pipeline.core.stop import StopReason
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.testing.background import BackgroundServer
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import (PCM_STEP, TEST_MAX_TOKENS, alone_and_together, grpc_request, make_config, pcm_bytes, pcm_of,
                     speech, wait_idle)

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

SAMPLES_PER_FRAME = 2048


@pytest.fixture
def stub(idle_server):
    with grpc.insecure_channel(idle_server.target) as channel:
        yield tts_pb2_grpc.TextToSpeechStub(channel)


def request(text="Hello world.", **fields):
    return grpc_request(text, **fields)


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
        return pcm_bytes(chunks)

    assert audio(5) == audio(5) != audio(6)


def float32_speech(stub, **fields):
    messages = list(stub.Synthesize(request(encoding=tts_pb2.AUDIO_ENCODING_FLOAT32, **fields), timeout=60))
    samples = np.concatenate([np.frombuffer(m.audio.data, dtype="<f4") for m in messages if m.HasField("audio")])
    return messages, samples.astype(np.float64)


def test_resampled_float32_stream(stub):
    """16 kHz is the native 24 kHz speech resampled: it equals an independent resampler's
    (scipy's polyphase filter) below both filters' transition bands."""
    from scipy import signal

    messages, samples = float32_speech(stub, seed=2, max_tokens=70, sample_rate=16000)
    assert messages[0].format.sample_rate == 16000
    assert messages[0].format.encoding == tts_pb2.AUDIO_ENCODING_FLOAT32
    _, native = float32_speech(stub, seed=2, max_tokens=70)
    assert native.size == 10 * SAMPLES_PER_FRAME
    expected = signal.resample_poly(native, 2, 3)
    assert abs(samples.size - expected.size) <= 2
    assert messages[-1].complete.usage.audio_seconds == pytest.approx(samples.size / 16000)
    size = min(samples.size, expected.size)
    below = signal.butter(8, 6500, fs=16000, output="sos")  # both resamplers pass this band whole
    heard, wanted = (signal.sosfiltfilt(below, x[:size])[100:-100] for x in (samples, expected))
    varying = wanted - wanted.mean()  # the SNR of the speech, not of the DC this model sits on
    snr = 10 * np.log10(np.sum(varying ** 2) / np.sum((heard - wanted) ** 2))
    assert snr > 40  # measured 56 dB; another seed's speech is about 16 dB off


def test_list_voices(stub):
    voices = stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices
    names = [v.name for v in voices]
    assert "tara" in names and voices[0].is_default and sum(v.is_default for v in voices) == 1


def test_the_voice_is_the_prefix_of_the_prompt(idle_server, stub):
    """The voice name prefixes the text in Orpheus's prompt (the layout's build_prompt): the
    server's speech for a voice is the engine's speech of that prompt, and differs by voice."""
    import uuid

    from audio_pipeline.core.request import TTSContext
    from audio_pipeline.layouts import orpheus

    engine, text = idle_server.engine, "Hello world."

    def grpc_speech(voice):
        messages = list(stub.Synthesize(request(text, voice=voice, max_tokens=28, seed=0), timeout=60))
        return pcm_of(messages), messages[-1].complete.usage

    spoken = {}
    for voice in ("tara", "leo"):
        prompt = [orpheus.START_OF_HUMAN, *engine.tokenizer(f"{voice}: {text}").input_ids, orpheus.END_OF_TEXT,
                  orpheus.END_OF_HUMAN, orpheus.START_OF_AI, orpheus.START_OF_SPEECH]
        assert engine.layout.build_prompt(engine.tokenizer, text, voice) == prompt
        spoken[voice], usage = grpc_speech(voice)
        assert usage.prompt_tokens == len(prompt)
        sampling = engine.requests.resolve_settings(voice=voice, seed=0, max_tokens=28).sampling
        expected = speech(engine, TTSContext(request_id=uuid.uuid4().hex, prompt_ids=prompt,
                                                    sampling=sampling, layout=engine.layout, voice=voice))
        np.testing.assert_allclose(spoken[voice] / 32768, expected, rtol=0, atol=PCM_STEP)
    assert not np.array_equal(spoken["tara"], spoken["leo"])


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
    def speak():
        messages = list(stub.Synthesize(request(max_tokens=14, seed=11), timeout=60))
        return pcm_bytes(messages), messages[-1].complete

    before = speak()
    text = fields.pop("text", "Hello.")
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Synthesize(request(text, **fields), timeout=30))
    assert caught.value.code() == code
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()
    after = speak()  # the same speech as before the bad request
    assert after[0] == before[0] and len(after[0]) == 2 * 2 * SAMPLES_PER_FRAME
    assert after[1].usage.generated_tokens == before[1].usage.generated_tokens == 14


def synthesized(stub, **fields):
    """(PCM16 samples, completion) of one request."""
    messages = list(stub.Synthesize(request(**fields), timeout=60))
    return pcm_of(messages), messages[-1].complete


#: Sampling overrides, each one that changes the seeded speech of the tiny model. Its random
#: weights make every code about equally likely (within a factor of a few), so a min_p below
#: about 0.2 cuts nothing (0.5 does), and a small change of the repetition penalty shows only
#: once a code has come twice in its frame slot (70 tokens do that).
OVERRIDES = [dict(temperature=0.8), dict(top_p=0.9), dict(top_k=100), dict(min_p=0.5), dict(repetition_penalty=1.2),
             dict(frequency_penalty=0.5), dict(presence_penalty=0.3), dict(max_tokens=56)]


def test_every_sampling_override_changes_the_seeded_speech(stub):
    base = dict(seed=3, max_tokens=70)
    plain, _ = synthesized(stub, **base)
    assert np.array_equal(synthesized(stub, **base)[0], plain)  # the seed alone fixes the speech
    for override in OVERRIDES:
        changed, complete = synthesized(stub, **{**base, **override})
        assert complete.usage.generated_tokens == override.get("max_tokens", 70)
        assert changed.shape != plain.shape or not np.array_equal(changed, plain), override


def test_a_stop_token_ends_the_speech_once_min_tokens_are_out(idle_server, stub):
    """A stop id ends the speech where it is chosen on a frame boundary, not before min_tokens.
    The stop id is the greedy speech's own token at the second frame's start (the random model
    never picks one stop id by itself)."""
    import uuid

    engine = idle_server.engine
    context = engine.create_context("Hello world.", temperature=0.0, max_tokens=28, request_id=uuid.uuid4().hex)
    greedy = speech(engine, context)
    stop = context.generated[7]
    heard, complete = synthesized(stub, temperature=0.0, max_tokens=28)
    np.testing.assert_allclose(heard / 32768, greedy, rtol=0, atol=PCM_STEP)
    assert complete.stop_reason == tts_pb2.STOP_REASON_MAX_TOKENS
    stopped, complete = synthesized(stub, temperature=0.0, max_tokens=28, stop_token_ids=[stop])
    assert complete.stop_reason == tts_pb2.STOP_REASON_END_OF_SPEECH
    assert complete.usage.generated_tokens == 7 and stopped.size == SAMPLES_PER_FRAME
    held, complete = synthesized(stub, temperature=0.0, max_tokens=28, stop_token_ids=[stop], min_tokens=8)
    assert complete.usage.generated_tokens > 7


def test_client_cancel_mid_stream_ends_generation(idle_server, stub):
    call = stub.Synthesize(request(max_tokens=4000, min_tokens=4000, request_id="cancel-me"), timeout=120)
    seen = 0
    for message in call:
        seen += message.HasField("audio")
        if seen == 2:
            break
    cancelled = idle_server.engine.core.stop_reasons[StopReason.CANCELLED]
    call.cancel()
    wait_idle(idle_server.engine)  # generation stopped and everything it held is released
    assert idle_server.engine.core.stop_reasons[StopReason.CANCELLED] == cancelled + 1


def test_deadline_stops_generation(idle_server, stub):
    cancelled = idle_server.engine.core.stop_reasons[StopReason.CANCELLED]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Synthesize(request(max_tokens=4000, min_tokens=4000), timeout=1.0))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(idle_server.engine)
    assert idle_server.engine.core.stop_reasons[StopReason.CANCELLED] == cancelled + 1


def test_concurrent_streams_equal_the_same_requests_one_at_a_time(stub):
    def speak(seed):
        return pcm_of(stub.Synthesize(request(f"Sentence {seed}.", seed=seed, max_tokens=56), timeout=120)).astype(int)

    alone, together = alone_and_together(speak, 4)
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
        while server.engine.core.load != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Synthesize(request(max_tokens=7), timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in caught.value.details()
        running.cancel()
        queued.cancel()
        wait_idle(server.engine)

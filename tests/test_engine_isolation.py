"""Failures inside the engine stay with the request they belong to, and a loop that keeps failing
stops visibly (unhealthy, new work refused) instead of dying silently.

The failures are injected (a decoder that fails on one request's audio, a scheduler that raises):
every other part is the real engine on the tiny model.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from audio_pipeline.core.stop import StopReason
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.errors import Unavailable
from audio_pipeline.core import engine_core as audio_generation
from helpers import make_config, wait_idle

TEXTS = ["Hello there.", "A longer sentence for the model to speak.", "Hi!", "Short."]
GREEDY = dict(temperature=0.0, max_tokens=70)


@pytest.fixture(params=[False, True], ids=["in-loop", "decoder-thread"])
def engine(tiny_model_dir, request):
    """The engine, its audio decoded in the loop (the CPU's default) or on the decoder thread (CUDA's)."""
    engine = TTSEngine(make_config(tiny_model_dir, "enable_overlap_scheduler=true",
                                   f"audio_decoder_thread={str(request.param).lower()}"))
    engine.start()
    yield engine
    engine.stop(5.0)


def submit_all(engine, texts):
    events: queue.Queue = queue.Queue()
    contexts = [engine.create_context(t, **GREEDY) for t in texts]
    for context in contexts:
        engine.submit(context, events.put)
    return contexts, events


def outcomes(events, count):
    """request id -> last event kind (complete / error), with the error texts."""
    ended, errors = {}, {}
    while len(ended) < count:
        event = events.get(timeout=120)
        if event.kind in ("complete", "error"):
            ended[event.request_id] = event.kind
            errors[event.request_id] = event.error
    return ended, errors


def test_a_decoder_failure_fails_only_its_own_request(engine, monkeypatch):
    real = audio_generation.decode_windows
    bad_streams = set()
    batched_with_bad = []

    def failing_for_one(decoder, jobs):
        if any(id(stream) in bad_streams for stream, _window, _codes in jobs):
            if len(jobs) > 1:
                batched_with_bad.append(len(jobs))
            raise ValueError("codes must be a non-empty whole number of frames")
        return real(decoder, jobs)

    monkeypatch.setattr(audio_generation, "decode_windows", failing_for_one)
    contexts, events = submit_all(engine, TEXTS)
    bad_streams.add(id(engine.core._requests[contexts[1].request_id].stream))
    ended, errors = outcomes(events, len(contexts))
    assert batched_with_bad, "the failing request never shared a decode batch"
    assert ended[contexts[1].request_id] == "error" and "audio decoding failed" in errors[contexts[1].request_id]
    assert [ended[c.request_id] for c in contexts if c is not contexts[1]] == ["complete"] * 3
    wait_idle(engine)  # its KV blocks and state are released too
    assert engine.core.healthy
    # The others spoke exactly what they speak when nothing fails beside them.
    monkeypatch.undo()
    again, events = submit_all(engine, TEXTS)
    assert set(outcomes(events, len(again))[0].values()) == {"complete"}
    assert [c.generated for i, c in enumerate(contexts) if i != 1] == [c.generated for i, c in enumerate(again) if i != 1]


def test_a_request_cancelled_while_its_audio_is_decoded_ends_cancelled_and_frees_everything(engine, monkeypatch):
    real = audio_generation.decode_windows
    decoding = threading.Event()
    release = threading.Event()
    target = {}

    def slow_for_one(decoder, jobs):
        if any(id(stream) == target.get("stream") for stream, _window, _codes in jobs):
            decoding.set()
            release.wait(5)  # in the loop this holds the loop; on the decoder thread only the decoder
        return real(decoder, jobs)

    monkeypatch.setattr(audio_generation, "decode_windows", slow_for_one)
    contexts, events = submit_all(engine, TEXTS[:2])
    target["stream"] = id(engine.core._requests[contexts[0].request_id].stream)
    assert decoding.wait(60), "the request's audio was never decoded"
    engine.cancel(contexts[0].request_id)
    release.set()
    last = {}
    while len(last) < 2:
        event = events.get(timeout=120)
        if event.kind in ("complete", "error"):
            last[event.request_id] = event
    assert last[contexts[0].request_id].stop_reason is StopReason.CANCELLED
    assert last[contexts[1].request_id].kind == "complete"
    assert last[contexts[1].request_id].usage.audio_samples > 0
    wait_idle(engine)
    assert not engine.core._decoding and not engine.core._requests
    # Nothing of it reaches its sink after its last event.
    time.sleep(0.2)
    assert events.empty()


def test_one_loop_failure_fails_the_requests_held_and_the_loop_goes_on(engine, monkeypatch):
    real = engine.scheduler.schedule
    failures = iter([True])

    def schedule_once_failing():
        # Once both requests are held: the loop may wake between the two submissions.
        held = engine.scheduler.num_waiting + engine.scheduler.num_running
        if held == 2 and next(failures, False):
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_once_failing)
    contexts, events = submit_all(engine, TEXTS[:2])
    ended, errors = outcomes(events, 2)
    assert set(ended.values()) == {"error"} and all("internal error" in e for e in errors.values())
    wait_idle(engine)
    # The loop is alive: the next request runs normally.
    contexts, events = submit_all(engine, TEXTS[2:3])
    assert outcomes(events, 1)[0] == {contexts[0].request_id: "complete"}
    assert engine.core.healthy


def test_a_loop_that_keeps_failing_stops_and_says_so(engine, monkeypatch):
    def broken():
        raise RuntimeError("scheduler bug")

    told = []
    engine.core.on_unhealthy = lambda: told.append(True)
    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    for _ in range(audio_generation.MAX_LOOP_FAILURES):
        contexts, events = submit_all(engine, TEXTS[:1])
        assert outcomes(events, 1)[0] == {contexts[0].request_id: "error"}
    engine.core._thread.join(timeout=30)
    assert not engine.core.healthy and told == [True]
    with pytest.raises(Unavailable, match="restart"):
        engine.submit(engine.create_context(TEXTS[0], **GREEDY), lambda event: None)


@pytest.mark.slow
def test_a_server_whose_engine_stopped_reports_not_serving(tiny_model_dir, monkeypatch):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

    server = BackgroundServer(make_config(tiny_model_dir)).start()
    try:
        def broken():
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(server.engine.scheduler, "schedule", broken)
        with grpc.insecure_channel(server.target) as channel:
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(audio_generation.MAX_LOOP_FAILURES):
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Synthesize(tts_pb2.SynthesizeRequest(text="Hello."), timeout=60))
                assert caught.value.code() == grpc.StatusCode.INTERNAL
            server.engine.core._thread.join(timeout=30)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            for _ in range(100):  # set from the engine thread through the event loop
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.05)
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Synthesize(tts_pb2.SynthesizeRequest(text="Hello."), timeout=60))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()

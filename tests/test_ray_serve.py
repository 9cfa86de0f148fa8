"""The engine on Ray Serve (server/ray_app.py): a real local Ray instance, two replicas of the tiny
model, gRPC through Serve's gRPC proxy and HTTP through its HTTP proxy."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from ray import serve  # noqa: E402
from ray.serve.config import HTTPOptions, gRPCOptions  # noqa: E402

from audio_pipeline.server.ray_app import (APP_NAME, GRPC_SERVICER_FUNCTION, SERVED_BY, ReplicaOptions,  # noqa: E402
                                          app_builder, build_app, config_sources, max_ongoing_requests)
from audio_pipeline_client import TTSClient, TTSError  # noqa: E402
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc  # noqa: E402
from helpers import PCM_STEP, free_port, make_config, pcm16, pcm_of  # noqa: E402

ROUTE = [("application", APP_NAME)]
TEXT = "Two replicas share the streams."
#: Serve's proxy reports a replica that died as INTERNAL: the client retries it before first audio.
RETRY_CODES = ("UNAVAILABLE", "INTERNAL")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    grpc_port, http_port = free_port(), free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
        sources = config_sources(audio_flags=["chunk_size=28,56", "sampling.max_tokens=560", "grace_period_s=60"],
                                 env={}, model={"model_path": str(tiny_model_dir), "device": "cpu"})
        serve.run(build_app(sources, ReplicaOptions(replicas=2, num_cpus=1)), name=APP_NAME, route_prefix="/")
        yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}", "sources": sources}
    finally:
        serve.shutdown()
        ray.shutdown()


def synthesize_raw(target: str, seed: int) -> tuple[list, str]:
    """One Synthesize call through the proxy: its messages and the replica that served it."""
    with grpc.insecure_channel(target) as channel:
        call = tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(
            # top_k: over the tiny random model's nearly flat 4096 codes, a seeded draw may land on
            # a near-tie that another batch's last-bit differences flip; from 50 that is rare.
            tts_pb2.SynthesizeRequest(text=TEXT, sampling=tts_pb2.SamplingParams(seed=seed, max_tokens=84, top_k=50)),
            metadata=ROUTE, timeout=120)
        messages = list(call)
        return messages, dict(call.trailing_metadata())[SERVED_BY]


def test_concurrent_streams_are_spread_over_both_replicas_with_full_audio(cluster):
    """Rounds of 8 concurrent streams until both replicas have served (Serve's router picks the
    less loaded of two replicas per request; one round nearly always reaches both)."""
    replicas, audio = set(), []
    for _ in range(3):
        results: dict[int, tuple] = {}

        def run(i):
            results[i] = synthesize_raw(cluster["grpc"], seed=1)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results) == 8
        for messages, replica in results.values():
            kinds = [m.WhichOneof("content") for m in messages]
            assert kinds[0] == "format" and kinds[-1] == "complete" and set(kinds[1:-1]) == {"audio"}
            audio.append(pcm_of(messages).astype(int))
            replicas.add(replica)
        if len(replicas) == 2:
            break
    assert len(replicas) == 2
    # Same text and seed: the same audio on either replica (up to one PCM16 step: streams share batches).
    assert audio[0].size == 84 // 7 * 2048
    for other in audio[1:]:
        assert other.shape == audio[0].shape and np.abs(other - audio[0]).max() <= 1


def test_voices_errors_live_text_and_http_go_through_serve(cluster):
    import httpx
    import io

    import soundfile

    with TTSClient(cluster["grpc"], metadata=ROUTE, timeout=120) as client:
        voices = [v.name for v in client.list_voices()]
        assert "tara" in voices
        with pytest.raises(TTSError) as caught:
            client.synthesize("", seed=1)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details.startswith("text:")
        live = list(client.stream_text(["Live text ", "through the proxy. ", "Second one."], temperature=0.0,
                                       max_tokens=84))
        whole = client.synthesize("Live text through the proxy. Second one.", temperature=0.0, max_tokens=84)
        spoken = client.synthesize(TEXT, voice="tara", seed=1)
    # Live text speaks the sentences as the whole text would (greedy), in one stream.
    assert live[-1].final
    np.testing.assert_allclose(np.concatenate([c.samples for c in live]), whole.samples, rtol=0, atol=2 / 32768)
    response = httpx.post(f"{cluster['http']}/v1/audio/speech", timeout=120,
                          json={"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "wav", "seed": 1})
    assert response.status_code == 200
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24000  # the speech gRPC gives for the same text, voice and seed
    np.testing.assert_allclose(audio, spoken.samples, rtol=0, atol=PCM_STEP)
    assert httpx.get(f"{cluster['http']}/health", timeout=30).json() == {"status": "serving"}


def test_the_websocket_speaks_through_serves_http_proxy(cluster):
    import json

    from websockets.sync.client import connect

    url = cluster["http"].replace("http://", "ws://") + "/v1/audio/stream"
    events, audio = [], b""
    with connect(url, open_timeout=60) as socket:
        for message in ({"type": "start", "context_id": "a", "seed": 1},
                        {"type": "text", "context_id": "a", "text": "Live text over the socket."},
                        {"type": "end", "context_id": "a"}):
            socket.send(json.dumps(message))
        while not events or events[-1]["type"] not in ("done", "interrupted", "error"):
            frame = socket.recv(timeout=120)
            if isinstance(frame, bytes):
                audio += frame
            else:
                events.append(json.loads(frame))
    assert [e["type"] for e in events if e["type"] != "words"] == ["started", "done"]
    import httpx

    alone = httpx.post(f"{cluster['http']}/v1/audio/speech", timeout=120, json={
        "model": "tts-1", "input": "Live text over the socket.", "response_format": "pcm", "seed": 1}).content
    # The socket's PCM16 is the speech of the same text and seed as one HTTP request.
    np.testing.assert_allclose(pcm16(audio).astype(int), pcm16(alone).astype(int), atol=2)


def test_stopping_a_replica_mid_run_loses_no_request_that_had_not_started_streaming(cluster):
    """A replica killed while eight long streams play and six more requests have just been sent:
    a request cut off is one whose audio had started (gRPC cannot retry it then); every other one
    is retried on the other replica and ends whole. The six are sent a moment before the kill, so
    that some are in flight with no audio yet (checked: the claim is not vacuous)."""
    before, victim = synthesize_raw(cluster["grpc"], seed=1)
    outcomes: dict[int, tuple[str, float | None]] = {}  # outcome, when its first audio came
    playing = threading.Semaphore(0)

    def run(i, text, max_tokens):
        first = None
        try:
            with TTSClient(cluster["grpc"], metadata=ROUTE, timeout=180, retries=4,
                           retry_codes=RETRY_CODES) as client:
                for chunk in client.stream(text, seed=i, max_tokens=max_tokens):
                    if first is None and chunk.samples.size > 0:
                        first = time.monotonic()
                        playing.release()
            outcomes[i] = ("ok", first)
        except TTSError as error:
            outcomes[i] = (error.code.name, first)

    long_ones = [threading.Thread(target=run, args=(i, TEXT * 3, 560)) for i in range(8)]
    for thread in long_ones:
        thread.start()
        time.sleep(0.2)
    for _ in long_ones:  # all eight play (on both replicas)
        assert playing.acquire(timeout=120)
    new_ones = [threading.Thread(target=run, args=(i, TEXT, 140)) for i in range(8, 14)]
    for thread in new_ones:
        thread.start()
    time.sleep(0.05)
    killed = time.monotonic()
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(victim)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for thread in long_ones + new_ones:
        thread.join()
    print("outcomes (code, first audio after the kill in s):",
          {i: (code, None if first is None else round(first - killed, 3)) for i, (code, first) in sorted(outcomes.items())})
    assert len(outcomes) == 14
    cut = {i: outcome for i, outcome in outcomes.items() if outcome[0] != "ok"}
    assert all(first is not None for _, first in cut.values()), outcomes  # only streams already playing were cut
    assert any(first is None or first > killed for _, first in outcomes.values()), outcomes  # some had not started
    assert cut, outcomes  # the kill did stop a replica mid-run (its playing streams were cut)
    # The survivor (and the replica Serve starts in the killed one's place) keep serving.
    from audio_pipeline_client.protocol import float_to_pcm16

    with TTSClient(cluster["grpc"], metadata=ROUTE, timeout=120, retry_codes=RETRY_CODES) as client:
        for _ in range(3):  # the same speech as before the kill
            after = float_to_pcm16(client.synthesize(TEXT, seed=1, max_tokens=84, top_k=50).samples).astype(int)
            np.testing.assert_array_equal(after, pcm_of(before).astype(int))


def test_scaling_down_drains_the_stopped_replica_streams_to_the_end(cluster, tiny_model_dir):
    """A downscale (2 -> 1) while streams run: Serve stops routing to the replica it removes and
    lets its streams finish (graceful_shutdown_timeout_s = grace_period_s); no stream fails, even
    with retries off."""
    outcomes: dict[int, str] = {}

    def run(i):
        try:
            with TTSClient(cluster["grpc"], metadata=ROUTE, timeout=180, retries=0) as client:
                result = client.synthesize(TEXT * 2, seed=i, max_tokens=420)
            # Drained to its end: the audio of every token it generated.
            whole = result.stop_reason in ("end_of_speech", "max_tokens") and \
                result.samples.size == result.usage.generated_tokens // 7 * 2048 > 0
            outcomes[i] = "ok" if whole else f"cut: {result.stop_reason}, {result.samples.size} samples"
        except TTSError as error:
            outcomes[i] = str(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    serve.run(build_app(cluster["sources"], ReplicaOptions(replicas=1, num_cpus=1)), name=APP_NAME,
              route_prefix="/")
    for thread in threads:
        thread.join()
    assert outcomes == {i: "ok" for i in range(6)}
    deadline = time.monotonic() + 60  # the drained replica stops once its streams are done
    while sum("SERVE_REPLICA" in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)) > 1:
        assert time.monotonic() < deadline, "the removed replica did not stop"
        time.sleep(0.5)


def test_deployment_options_follow_the_engine_configuration(tiny_model_dir):
    config = make_config(tiny_model_dir, "max_batch_size=4", "max_queue_size=12")
    assert max_ongoing_requests(config) == 16
    sources = config_sources(audio_flags=["max_batch_size=4", "max_queue_size=12", "grace_period_s=7"], env={},
                             model={"model_path": str(tiny_model_dir), "device": "cpu"})
    app = build_app(sources, ReplicaOptions(replicas=1, max_replicas=3, capacity=6))
    deployment = app._bound_deployment
    assert deployment._deployment_config.max_ongoing_requests == 16
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 7
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 3, 6)
    with pytest.raises(ValueError, match="--max-replicas"):
        build_app(sources, ReplicaOptions(replicas=3, max_replicas=2))
    with pytest.raises(ValueError, match="unknown application argument"):
        app_builder({"model": str(tiny_model_dir), "replica": 2})


def test_the_shipped_serve_config_is_valid_and_builds_the_application():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    document = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "ray" / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(document)
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_FUNCTION]
    (application,) = schema.applications
    assert application.name == APP_NAME
    module, _, function = application.import_path.partition(":")
    assert (module, function) == ("audio_pipeline.server.ray_app", "app_builder")
    config = app_builder(application.args)._bound_deployment._deployment_config
    assert config.autoscaling_config.max_replicas == application.args["max_replicas"]


def test_serve_ray_refuses_bad_replica_bounds(tiny_model_dir, capsys):
    from audio_pipeline.cli import main

    assert main(["serve-ray", "--model", str(tiny_model_dir), "--replicas", "3", "--max-replicas", "2"]) == 1
    assert "--max-replicas (2) is below --replicas (3)" in capsys.readouterr().err

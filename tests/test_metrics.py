"""Prometheus metrics over HTTP from a real `audio-pipeline serve` process, in both server modes."""

from __future__ import annotations

import re
import subprocess
import time
import sys
import urllib.request

import grpc
import pytest

from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import free_port, listening_port, start_engine, synthesize, wait_serving

EXPECTED = ["tts_requests_queued", "tts_requests_running", "tts_batch_size_bucket", "tts_kv_cache_blocks_used",
            "tts_kv_cache_blocks_total", "tts_prefix_cache_hit_rate", "tts_input_tokens_total",
            "tts_output_tokens_total", "tts_time_to_first_token_seconds_count",
            "tts_time_to_first_audio_seconds_count", "tts_audio_seconds_total", "tts_preemptions_total"]


def value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["launch_server", "launch_multiproc_server"])
def test_metrics_endpoint_reports_the_engine(tiny_model_dir, tmp_path, mode):
    metrics_port = free_port()
    env = None
    if mode == "launch_multiproc_server":
        import os

        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    server = subprocess.Popen([sys.executable, "-m", "audio_pipeline.cli", "serve", "--host", "127.0.0.1",
                               "--port", "0", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--metrics-port", str(metrics_port), "--task-arg", f"prometheus_metrics_mode={mode}",
                               "--task-arg", "chunk_size=28", "--task-arg", "model.kv_cache.kv_cache_page_size=16"],
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = listening_port(server)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_serving(channel)
            # What the warm-up left, so the requests' own figures can be told apart.
            before = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            usages = []
            for _ in range(2):  # the same prompt twice: the second reuses the first's prompt blocks
                chunks = list(stub.Synthesize(tts_pb2.SynthesizeRequest(
                    text="Metrics, please, with a prompt that fills a few KV blocks.",
                    sampling=tts_pb2.SamplingParams(max_tokens=70, min_tokens=70)), timeout=120))
                assert chunks[-1].HasField("complete")
                usages.append(chunks[-1].complete.usage)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
        for name in EXPECTED:
            value(text, name)

        def grew(name):
            return value(text, name) - value(before, name)

        # Each figure grew by exactly what the two requests reported to their client.
        assert sum(u.generated_tokens for u in usages) == 140
        assert grew("tts_output_tokens_total") == 140
        # Both prompts were looked up in the prefix cache; prefill computed what it did not hold.
        assert grew("tts_prefix_cache_queried_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert grew("tts_prefix_cache_hit_tokens_total") >= 16  # the second prompt's first page at least
        assert grew("tts_input_tokens_total") == (grew("tts_prefix_cache_queried_tokens_total")
                                                  - grew("tts_prefix_cache_hit_tokens_total"))
        assert grew("tts_time_to_first_audio_seconds_count") == grew("tts_time_to_first_token_seconds_count") == 2
        assert grew("tts_audio_seconds_total") == pytest.approx(sum(u.audio_seconds for u in usages))
        assert sum(u.audio_seconds for u in usages) == pytest.approx(2 * 70 // 7 * 2048 / 24000)
        assert value(text, "tts_kv_cache_blocks_total") == value(before, "tts_kv_cache_blocks_total") > 0
        assert value(text, "tts_kv_cache_blocks_used") == 0
        assert 0 < value(text, "tts_prefix_cache_hit_rate") < 1
        assert 'tts_rpc_requests_total{outcome="ok"} 2.0' in text
        if mode == "launch_multiproc_server":
            assert list((tmp_path / "prom").glob("*.db")), "multiprocess values are kept in PROMETHEUS_MULTIPROC_DIR"
    finally:
        server.terminate()
        server.wait(timeout=60)
        server.stderr.close()


def test_output_tokens_count_the_tokens_each_request_generated(tiny_model_dir):
    engine = start_engine(tiny_model_dir)
    try:
        registry = engine.metrics.registry
        counted = []
        for max_tokens in (14, 70):
            before = registry.get_sample_value("tts_output_tokens_total")
            result = engine.synthesize("Count my tokens, please.", max_tokens=max_tokens, min_tokens=max_tokens, seed=1)
            counted.append((registry.get_sample_value("tts_output_tokens_total") - before,
                            result.usage.generated_tokens))
        assert counted == [(14, 14), (70, 70)]
    finally:
        engine.stop()


@pytest.mark.slow
def test_a_long_text_counts_as_one_running_request_not_one_per_piece(idle_server):
    """A text of several pieces is prepared a piece ahead (two contexts in the engine at once):
    tts_requests_running still counts the one client request, and nothing is counted as queued
    for it while it runs."""
    import threading

    text = " ".join(f"This is sentence number {i} of a text long enough to be several pieces." for i in range(6))
    metrics, seen = idle_server.engine.metrics, []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append((metrics.requests_running._value.get(), metrics.requests_queued._value.get(),
                         len(idle_server.engine.scheduler.running) + idle_server.engine.scheduler.num_waiting))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        chunks = synthesize(idle_server.target, text, seed=1, max_tokens=56)
    finally:
        done.set()
        watcher.join()
    assert chunks[-1].HasField("complete")
    assert max(contexts for _, _, contexts in seen) >= 2  # a piece was prepared while another ran
    # Its first piece may wait a moment for admission (queued, rightly); once it runs, nothing of it
    # is counted as queued, not even a later piece that waits after the one before it ended.
    assert max(running for running, _, _ in seen) == 1
    started = next(i for i, (running, _, _) in enumerate(seen) if running)
    assert max(queued for _, queued, _ in seen[started:]) == 0

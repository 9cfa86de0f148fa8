"""Prometheus metrics over HTTP from a real `audio-pipeline serve` process, in both server modes."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

EXPECTED = ["tts_requests_queued", "tts_requests_running", "tts_batch_size_bucket", "tts_kv_cache_blocks_used",
            "tts_kv_cache_blocks_total", "tts_prefix_cache_hit_rate", "tts_input_tokens_total",
            "tts_output_tokens_total", "tts_time_to_first_token_seconds_count",
            "tts_time_to_first_audio_seconds_count", "tts_audio_seconds_total", "tts_preemptions_total"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


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
        port = None
        for line in server.stderr:
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port, "the server never printed its port"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 120
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "never became SERVING"
                time.sleep(0.1)
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            for _ in range(2):  # the same prompt twice: the second reuses the first's prompt blocks
                chunks = list(stub.Synthesize(tts_pb2.SynthesizeRequest(
                    text="Metrics, please, with a prompt that fills a few KV blocks.",
                    sampling=tts_pb2.SamplingParams(max_tokens=70, min_tokens=70)), timeout=120))
                assert chunks[-1].HasField("complete")
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
        for name in EXPECTED:
            value(text, name)
        assert value(text, "tts_output_tokens_total") >= 140
        assert value(text, "tts_time_to_first_audio_seconds_count") >= 2  # warm-up included
        assert value(text, "tts_audio_seconds_total") > 0
        assert value(text, "tts_kv_cache_blocks_total") > 0
        assert value(text, "tts_kv_cache_blocks_used") == 0
        assert 0 < value(text, "tts_prefix_cache_hit_rate") < 1
        assert 'tts_rpc_requests_total{outcome="ok"} 2.0' in text
        if mode == "launch_multiproc_server":
            assert list((tmp_path / "prom").glob("*.db")), "multiprocess values are kept in PROMETHEUS_MULTIPROC_DIR"
    finally:
        server.terminate()
        server.wait(timeout=60)
        server.stderr.close()

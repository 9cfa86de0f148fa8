"""Prometheus metrics of the engine and server, honouring ``prometheus_metrics_mode``.

- ``instrument_only``: metrics are kept (scrape them from your own exporter via ``registry``).
- ``launch_server``: ``serve_http(port)`` serves ``/metrics`` from this process.
- ``launch_multiproc_server``: values live in ``PROMETHEUS_MULTIPROC_DIR`` (created when unset), so
  several worker processes aggregate; ``/metrics`` serves the aggregate of all of them.

Each engine has a registry of its own, so several engines can share a process (tests do).
"""

from __future__ import annotations

import os
import tempfile

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import values as prometheus_values

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def enable_multiprocess(directory: str | None = None) -> str:
    """Switches metric storage to the multiprocess files (call before any metric is created)."""
    directory = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="tts-metrics-")
    os.makedirs(directory, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    prometheus_values.ValueClass = prometheus_values.get_value_class()
    return directory


class MetricsRegistry:
    """A registry of metrics and how it is exposed (``prometheus_metrics_mode``)."""

    def __init__(self, mode: str = "instrument_only") -> None:
        self.mode = str(mode)
        self.multiprocess = self.mode == "launch_multiproc_server"
        if self.multiprocess:
            enable_multiprocess()
        self.registry = CollectorRegistry()

    def exposition_registry(self) -> CollectorRegistry:
        """The registry /metrics serves: this one, or the multiprocess aggregate."""
        if not self.multiprocess:
            return self.registry
        from prometheus_client import multiprocess

        aggregate = CollectorRegistry()
        multiprocess.MultiProcessCollector(aggregate)
        return aggregate

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Serves /metrics on ``port``; returns the HTTP server."""
        server, _thread = start_http_server(port, addr=host, registry=self.exposition_registry())
        return server

    def render(self) -> bytes:
        """The text exposition of what /metrics would serve."""
        return prometheus_client.generate_latest(self.exposition_registry())


class EngineMetrics(MetricsRegistry):
    """What the generation engine reports: load, batches, KV cache, tokens, latency, audio."""

    def __init__(self, mode: str = "instrument_only") -> None:
        super().__init__(mode)
        r = self.registry
        gauge_mode = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.requests_queued = Gauge("tts_requests_queued", "Requests waiting for admission", registry=r,
                                     **gauge_mode)
        self.requests_running = Gauge("tts_requests_running", "Client requests with a piece admitted (holding KV "
                                      "blocks); a long text's pieces count once", registry=r, **gauge_mode)
        self.batch_size = Histogram("tts_batch_size", "Requests per model step, by step kind", ["kind"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.kv_blocks_used = Gauge("tts_kv_cache_blocks_used", "KV cache blocks held by requests", registry=r,
                                    **gauge_mode)
        self.kv_blocks_total = Gauge("tts_kv_cache_blocks_total", "KV cache blocks in all", registry=r,
                                     **gauge_mode)
        self.last_step_age = Gauge(
            "tts_engine_last_step_age_seconds", "Seconds since the engine loop last came round while it holds "
            "requests (0 when idle): a watchdog for a stuck engine", registry=r,
            **({"multiprocess_mode": "max"} if self.multiprocess else {}))
        self.prefix_cache_queried_tokens = Counter(
            "tts_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "tts_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r)
        self.prefix_cache_hit_rate = Gauge("tts_prefix_cache_hit_rate",
                                           "Prefix-cache hit tokens / queried tokens since start", registry=r,
                                           **({"multiprocess_mode": "max"} if self.multiprocess else {}))
        self.preemptions = Counter("tts_preemptions", "Requests preempted for KV memory (recomputed later)",
                                   registry=r)
        self.input_tokens = Counter("tts_input_tokens", "Tokens computed in prefill (prompt and recompute)",
                                    registry=r)
        self.output_tokens = Counter("tts_output_tokens", "Speech tokens generated, counted when each request ends",
                                     registry=r)
        self.time_to_first_token = Histogram("tts_time_to_first_token_seconds", "Arrival to first speech token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_audio = Histogram("tts_time_to_first_audio_seconds", "Arrival to first audio chunk",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("tts_audio_seconds", "Seconds of audio produced", registry=r)
        self.steps = Counter("tts_steps", "Engine steps with model work, by step kind", ["kind"], registry=r)
        self.step_phase_seconds = Counter(
            "tts_step_phase_seconds", "Engine step time by phase (schedule, inputs, model, sample, update, "
            "decode, deliver)", ["phase"], registry=r)
        self.decode_step_seconds = Counter("tts_decode_step_seconds", "Time of decode (tg) steps, all phases",
                                           registry=r)
        self.forward_passes = Counter("tts_forward_passes", "Model forward passes, by step kind", ["kind"],
                                      registry=r)
        self.requests = Counter("tts_engine_requests_finished", "Finished requests by stop reason", ["reason"],
                                registry=r)

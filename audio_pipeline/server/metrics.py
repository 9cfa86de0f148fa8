"""Prometheus metrics of the server, in a registry of its own (several servers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tts_requests", "Synthesize calls by outcome", ["outcome"], registry=r)
        self.requests_queued = Gauge("tts_requests_queued", "Requests waiting for a batch slot", registry=r)
        self.requests_running = Gauge("tts_requests_running", "Requests generating", registry=r)
        self.kv_tokens_reserved = Gauge("tts_kv_cache_tokens_reserved", "KV cache tokens reserved", registry=r)
        self.kv_tokens_total = Gauge("tts_kv_cache_tokens_total", "KV cache capacity in tokens", registry=r)
        self.prompt_tokens = Counter("tts_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("tts_generated_tokens", "Speech tokens generated", registry=r)
        self.audio_seconds = Counter("tts_audio_seconds", "Seconds of audio streamed", registry=r)
        self.time_to_first_audio = Histogram("tts_time_to_first_audio_seconds", "Arrival to first audio chunk",
                                             buckets=_LATENCY_BUCKETS, registry=r)

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Serves /metrics on ``port``; returns the HTTP server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server

"""The server's own metrics (RPC outcomes, streaming as listeners hear it), kept in the engine's registry beside the engine's metrics."""

from __future__ import annotations

from prometheus_client import Counter

from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.service.stream_metrics import StreamMetrics


class ServerMetrics:
    def __init__(self, engine_metrics: EngineMetrics) -> None:
        self.engine = engine_metrics
        self.registry = engine_metrics.registry
        self.requests = Counter("tts_rpc_requests", "Synthesize calls by outcome", ["outcome"], registry=self.registry)
        #: Every stream as its listener would hear it (service/stream_metrics.py).
        self.streams = StreamMetrics(self.registry)

    def count(self, outcome: str) -> None:
        """One request ended with ``outcome`` (ok, invalid, rejected, unavailable, failed, cancelled,
        client_cancelled)."""
        self.requests.labels(outcome).inc()

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Serves /metrics on ``port``; returns the HTTP server."""
        return self.engine.serve_http(port, host)

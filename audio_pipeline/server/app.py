"""Server start-up and shutdown: listen, report NOT_SERVING until warm, serve, drain on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from audio_pipeline.config import AudioGenerationConfig, PrometheusMetricsMode
from audio_pipeline.engine import TTSEngine
from audio_pipeline.server.metrics import ServerMetrics
from audio_pipeline.server.servicer import TextToSpeechServicer
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


#: Where /metrics is served when prometheus_metrics_mode launches a server and no --metrics-port is given.
DEFAULT_METRICS_PORT = 8001


@dataclass
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = None
    #: Called with the bound port once the server listens (before warm-up).
    on_listening: object = None
    #: Set to stop the server (in addition to SIGINT/SIGTERM when installed).
    stop_event: asyncio.Event | None = None
    install_signal_handlers: bool = True
    ready: threading.Event = field(default_factory=threading.Event)


class RunningServer:
    """What serve() builds: the grpc server, the engine, health and metrics."""

    def __init__(self, config: AudioGenerationConfig, engine: TTSEngine, options: ServerOptions):
        self.config = config
        self.engine = engine
        self.options = options
        self.metrics = ServerMetrics(engine.metrics)
        self.servicer = TextToSpeechServicer(engine, self.metrics)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        tts_pb2_grpc.add_TextToSpeechServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        address = f"{options.host}:{options.port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self.metrics_http = None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

async def serve(config: AudioGenerationConfig, options: ServerOptions, engine: TTSEngine | None = None) -> None:
    """Runs the server until SIGINT/SIGTERM (or ``options.stop_event``), then drains and stops."""
    if engine is None:
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(None, TTSEngine, config)
    running = RunningServer(config, engine, options)
    await running.set_serving(False)
    await running.server.start()
    logger.info("listening on %s:%d (warming up)", options.host, running.port)
    if options.on_listening is not None:
        options.on_listening(running.port)
    metrics_port = options.metrics_port
    if metrics_port is None and config.prometheus_metrics_mode != PrometheusMetricsMode.INSTRUMENT_ONLY:
        metrics_port = DEFAULT_METRICS_PORT
    if metrics_port is not None:  # --metrics-port alone also serves /metrics
        running.metrics_http = running.metrics.serve_http(metrics_port)
        logger.info("metrics on http://%s:%d/metrics", options.host, metrics_port)
    stop = options.stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    if options.install_signal_handlers:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        engine.start()
        seconds = await loop.run_in_executor(None, engine.warmup)
        running.servicer.ready = True
        await running.set_serving(True)
        options.ready.set()
        logger.info("serving %s on port %d (warm-up %.2f s)", config.model.model_path, running.port, seconds)
        await stop.wait()
    finally:
        logger.info("shutting down: draining in-flight streams for up to %.1f s", config.grace_period_s)
        running.servicer.ready = False
        engine.generation.stop_accepting()
        await running.set_serving(False)
        await running.server.stop(config.grace_period_s)
        await loop.run_in_executor(None, engine.stop, 0.0)
        if running.metrics_http is not None:
            running.metrics_http.shutdown()
        if options.install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        logger.info("stopped")

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

from audio_pipeline.audio import resample
from audio_pipeline.config import AudioGenerationConfig, PrometheusMetricsMode
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.server.auth import BearerTokenInterceptor
from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.server.handlers import SERVICE_NAME, add_text_to_speech
from audio_pipeline.server.metrics import ServerMetrics
from audio_pipeline.server.servicer import TextToSpeechServicer
from audio_pipeline.service.speech import SpeechService
from audio_pipeline.server.tls import TLSFiles, server_credentials

logger = logging.getLogger(__name__)

#: Largest message sent (an audio chunk is far smaller); what is received is bounded by limits.max_message_bytes.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


#: Where /metrics is served when prometheus_metrics_mode launches a server and no --metrics-port is given.
DEFAULT_METRICS_PORT = 8001


@dataclass
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = None
    #: Address /metrics listens on; None = the same as ``host``.
    metrics_host: str | None = None
    #: Server certificate, key and client CA (mutual TLS); None or no files = plaintext.
    tls: TLSFiles | None = None
    #: Bearer tokens required of callers; None or empty = no authentication.
    auth: AuthTokens | None = None
    #: Called with the bound port once the server listens (before warm-up).
    on_listening: object = None
    #: Set to stop the server (in addition to SIGINT/SIGTERM when installed).
    stop_event: asyncio.Event | None = None
    install_signal_handlers: bool = True
    ready: threading.Event = field(default_factory=threading.Event)
    #: Port of the HTTP front door (OpenAI-compatible speech); None = off, 0 picks a free one.
    http_port: int | None = None
    #: Called with the HTTP port once it listens.
    on_http_listening: object = None

    @property
    def http_bind_host(self) -> str:
        return self.host[1:-1] if self.host.startswith("[") and self.host.endswith("]") else self.host

    @property
    def metrics_bind_host(self) -> str:
        host = self.metrics_host if self.metrics_host is not None else self.host
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[::]" is gRPC's spelling


def grpc_server_options(config: AudioGenerationConfig) -> list[tuple[str, int]]:
    """Channel arguments that bound what one client connection may send or hold open."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_concurrent_streams", config.limits.max_concurrent_streams)]


class RunningServer:
    """What serve() builds: the grpc server, the engine, health and metrics."""

    def __init__(self, config: AudioGenerationConfig, engine: TTSEngine, options: ServerOptions,
                 credentials: grpc.ServerCredentials | None = None):
        self.config = config
        self.engine = engine
        self.options = options
        self.metrics = ServerMetrics(engine.metrics)
        self.service = SpeechService(engine, count=self.metrics.count, stream_metrics=self.metrics.streams)
        self.servicer = TextToSpeechServicer(self.service)
        self.health = health.aio.HealthServicer()
        auth = options.auth
        interceptors = [BearerTokenInterceptor(auth)] if auth is not None and auth.enabled else []
        self.server = grpc.aio.server(options=grpc_server_options(config), interceptors=interceptors)
        add_text_to_speech(self.servicer, self.server)  # decodes requests itself: malformed -> INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        address = f"{options.host}:{options.port}"
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self.metrics_http = None
        #: The HTTP front door's port, once it listens.
        self.http_port: int | None = None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

async def start_http(running: RunningServer, options: ServerOptions):
    """Starts the HTTP front door on the server's event loop; (uvicorn server, its task)."""
    import contextlib

    import uvicorn

    from audio_pipeline.http.app import create_app
    from audio_pipeline.server.tls import http_ssl_options

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the server's own loop handles SIGINT/SIGTERM
            yield

    config = uvicorn.Config(create_app(running), host=options.http_bind_host, port=options.http_port,
                            log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=max(1, int(running.config.grace_period_s)),
                            **http_ssl_options(options.tls))
    server = EmbeddedServer(config)

    async def run() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits when it cannot start (after logging why)
            pass

    task = asyncio.create_task(run())
    while not server.started:
        if task.done():  # uvicorn logs why (a port in use...) and exits its task
            raise OSError(f"--http-port: cannot serve HTTP on {options.http_bind_host}:{options.http_port} "
                          "(see the error above)")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    logger.info("HTTP (OpenAI-compatible speech) on %s:%d", options.http_bind_host, port)
    if options.on_http_listening is not None:
        options.on_http_listening(port)
    running.http_port = port
    return server, task


async def serve(config: AudioGenerationConfig, options: ServerOptions, engine: TTSEngine | None = None) -> None:
    """Runs the server until SIGINT/SIGTERM (or ``options.stop_event``), then drains and stops."""
    # TLS files are read before the model loads: a wrong path fails at once, naming the flag.
    credentials = server_credentials(options.tls)
    if options.auth is not None and options.auth.enabled and credentials is None:
        logger.warning("bearer tokens are required but TLS is off: tokens cross the network in clear text "
                       "(give --tls-cert-file and --tls-key-file)")
    if engine is None:
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(None, lambda: TTSEngine(config, engine_process=config.engine_process.value))
    running = RunningServer(config, engine, options, credentials)
    await running.set_serving(False)
    await running.server.start()
    logger.info("listening on %s:%d (%s%s; warming up)", options.host, running.port,
                "mutual TLS" if options.tls and options.tls.client_ca_file else "TLS" if credentials else "plaintext",
                ", bearer tokens required" if options.auth is not None and options.auth.enabled else "")
    if options.on_listening is not None:
        options.on_listening(running.port)
    metrics_port = options.metrics_port
    if metrics_port is None and config.prometheus_metrics_mode != PrometheusMetricsMode.INSTRUMENT_ONLY:
        metrics_port = DEFAULT_METRICS_PORT
    if metrics_port is not None:  # --metrics-port alone also serves /metrics
        running.metrics_http = running.metrics.serve_http(metrics_port, options.metrics_bind_host)
        logger.info("metrics on http://%s:%d/metrics", options.metrics_bind_host,
                    running.metrics_http.server_address[1])
    http = None
    if options.http_port is not None:
        try:
            http = await start_http(running, options)
        except BaseException:
            await running.server.stop(0)
            raise
    stop = options.stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    if options.install_signal_handlers:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        # An engine whose loop has stopped for good takes the server out of rotation (NOT_SERVING).
        # A core in its own process that dies is replaced; once the new one is ready it serves again.
        # Called from an engine thread; each waits (briefly) until health says so, so that a stream
        # ended because the engine stopped is never seen before NOT_SERVING is.
        def health(serving: bool) -> None:
            try:
                asyncio.run_coroutine_threadsafe(running.set_serving(serving), loop).result(timeout=2.0)
            except Exception:  # noqa: BLE001 - the server is stopping (its loop is gone)
                logger.warning("could not set health to %s", "SERVING" if serving else "NOT_SERVING")

        engine.on_health(lambda: health(False), lambda: health(True))
        engine.start()
        seconds, _ = await asyncio.gather(loop.run_in_executor(None, engine.warmup),
                                          loop.run_in_executor(None, resample.preload))
        running.service.ready = True
        await running.set_serving(True)
        options.ready.set()
        logger.info("serving %s on port %d (warm-up %.2f s)", config.model.model_path, running.port, seconds)
        await stop.wait()
    finally:
        logger.info("shutting down: draining in-flight streams for up to %.1f s", config.grace_period_s)
        # New requests are refused from here; the engine still takes the later segments of the
        # streams already admitted, so each of them is spoken to its end within the grace period.
        running.service.drain()
        await running.set_serving(False)
        if http is not None:
            http_server, http_task = http
            http_server.should_exit = True
        await running.server.stop(config.grace_period_s)
        if http is not None:
            await http_task
        running.service.close()
        await loop.run_in_executor(None, engine.stop, 0.0)
        if running.metrics_http is not None:
            running.metrics_http.shutdown()
        if options.install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        logger.info("stopped")

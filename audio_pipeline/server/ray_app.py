"""The engine on Ray Serve: one engine per replica, behind Serve's gRPC and HTTP proxies.

Serve does the cluster's work (placing replicas, routing, autoscaling, health, draining); this
module only adapts the server's own servicer and HTTP app to a Serve deployment:

- gRPC: Serve's gRPC proxy calls the replica's method of the RPC's name with the decoded request
  (and a stream of them for SynthesizeStream), and sends what it returns or yields. Clients add the
  metadata ``application: <app name>`` (``TTSClient(..., metadata=[("application", "tts")])``).
- HTTP: the replica is an ASGI ingress serving the HTTP front door (``/v1/audio/speech``...).
- Autoscaling: ``target_ongoing_requests`` is the streams one replica serves in real time (the
  serving benchmark's capacity), ``max_ongoing_requests`` what the engine queues before it refuses.
- Health: a replica whose engine loop has stopped fails Serve's health check and is replaced.
- Draining: on downscale or redeploy Serve stops routing to a replica and waits up to
  ``grace_period_s`` for its streams before it stops the engine.

Start it with ``audio-pipeline serve-ray`` (ray_cli.py) or build it with :func:`build_app`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ray import serve

from audio_pipeline.config import AudioGenerationConfig

logger = logging.getLogger(__name__)

#: The application name clients put in the ``application`` metadata.
APP_NAME = "tts"
#: What Serve's gRPC proxy registers: the TextToSpeech service's generated servicer function.
GRPC_SERVICER_FUNCTION = "audio_pipeline_client._proto.tts_pb2_grpc.add_TextToSpeechServicer_to_server"


def config_sources(config_file: str | None = None, section_name: str | None = None,
                   audio_flags: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
                   **overrides: Any) -> dict:
    """What each replica builds its configuration from: the same sources as ``serve`` (the file is
    read on the replica's node; the caller's ``AUDIO_PIPELINE_*`` variables travel along)."""
    env = dict(os.environ if env is None else env)
    return {"config_file": config_file, "section_name": section_name, "audio_flags": list(audio_flags),
            "env": {k: v for k, v in env.items() if k.startswith("AUDIO_PIPELINE_")}, "overrides": overrides}


def load_config(sources: dict) -> AudioGenerationConfig:
    """The configuration from ``sources``, checked (the audio decoder's streaming settings too)."""
    from audio_pipeline.decoders.settings_check import check_decoder_settings

    return check_decoder_settings(AudioGenerationConfig.load(
        config_file=sources["config_file"], section_name=sources["section_name"], env=sources["env"],
        audio_flags=sources["audio_flags"], **sources["overrides"]))


def max_ongoing_requests(config: AudioGenerationConfig, device_type: str = "cpu") -> int:
    """Requests one replica takes before its engine refuses (admitted to decode plus queued), with
    the configuration's values on the replica's device: Serve holds the rest back, so a replica is
    never sent a request its queue would turn away."""
    config = config.for_device(device_type)
    return (config.max_queue_size_tg or config.max_batch_size) + config.max_queue_size


class CallAborted(Exception):
    """Ends a call aborted by the servicer; Serve's proxy answers with the code set on the context."""


#: Trailing metadata naming the replica that served a call (for operators following a stream).
SERVED_BY = "served-by"


class ServeCallContext:
    """The part of grpc.aio.ServicerContext the servicer uses (abort), on Serve's gRPC context; it
    also names the serving replica in the call's trailing metadata (``served-by``)."""

    def __init__(self, grpc_context, replica: str) -> None:
        self.grpc_context = grpc_context
        if grpc_context is not None:
            grpc_context.set_trailing_metadata([(SERVED_BY, replica)])

    async def abort(self, code, details: str):
        if self.grpc_context is not None:
            self.grpc_context.set_code(code)
            self.grpc_context.set_details(details)
        raise CallAborted(f"{code.name}: {details}")


@dataclass
class ReplicaServer:
    """What the HTTP app needs of a running server (server/app.py's RunningServer)."""

    engine: Any
    service: Any
    metrics: Any
    #: No bearer tokens of the replica's own: a Serve cluster authenticates at its edge.
    options: Any = None


@serve.ingress()
class TextToSpeechReplica:
    """One engine, warmed up before the replica reports ready, serving gRPC and HTTP."""

    def __init__(self, sources: dict) -> None:
        from audio_pipeline.service.engine import TTSEngine
        from audio_pipeline.server.metrics import ServerMetrics
        from audio_pipeline.server.servicer import TextToSpeechServicer
        from audio_pipeline.service.speech import SpeechService

        self.config = load_config(sources)
        self.config.log_basic_config()
        self.engine = TTSEngine(self.config)
        self.engine.start()
        seconds = self.engine.warmup()
        self.metrics = ServerMetrics(self.engine.metrics)
        self.service = SpeechService(self.engine, count=self.metrics.count, stream_metrics=self.metrics.streams)
        self.servicer = TextToSpeechServicer(self.service)
        self.service.ready = True
        self.replica = serve.get_replica_context().replica_id.unique_id
        logger.info("replica serving %s (warm-up %.2f s)", self.config.model.model_path, seconds)

    def _context(self, grpc_context) -> ServeCallContext:
        return ServeCallContext(grpc_context, self.replica)

    def __serve_build_asgi_app__(self):
        from audio_pipeline.http.app import create_app

        return create_app(ReplicaServer(self.engine, self.service, self.metrics, options=None))

    async def Synthesize(self, request, grpc_context=None):
        async for chunk in self.servicer.Synthesize(request, self._context(grpc_context)):
            yield chunk

    async def SynthesizeStream(self, request_stream, grpc_context=None):
        async for chunk in self.servicer.SynthesizeStream(request_stream, self._context(grpc_context)):
            yield chunk

    async def ListVoices(self, request, grpc_context=None):
        return await self.servicer.ListVoices(request, self._context(grpc_context))

    def check_health(self) -> None:
        """Serve's health check: an engine whose loop stopped for good takes the replica out."""
        if not self.engine.healthy:
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        # Serve calls this after draining (graceful_shutdown_timeout_s): nothing runs any more.
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.service.drain()
            self.service.close()
            engine.stop(0.0)


@dataclass
class ReplicaOptions:
    """How many replicas, and when Serve adds or removes them."""

    #: Fixed replica count; with ``max_replicas`` set, the autoscaler's lower bound.
    replicas: int = 1
    #: Upper bound of autoscaling (None: a fixed ``replicas`` count).
    max_replicas: int | None = None
    #: Streams one replica serves in real time (``python -m audio_pipeline.bench.serve``'s capacity):
    #: the autoscaler's target of ongoing requests per replica.
    capacity: int = 8
    #: CPUs and GPUs each replica reserves in the Ray cluster.
    num_cpus: float = 1.0
    num_gpus: float = 0.0


def build_app(sources: dict, options: ReplicaOptions | None = None):
    """The Serve application (bind it with ``serve.run(app, name=APP_NAME)``)."""
    options = options or ReplicaOptions()
    config = load_config(sources)
    settings: dict[str, Any] = {
        "name": "TextToSpeech",
        "max_ongoing_requests": max_ongoing_requests(config, "cuda" if options.num_gpus > 0 else "cpu"),
        "graceful_shutdown_timeout_s": max(1.0, config.grace_period_s),
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 10.0,
        "ray_actor_options": {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus},
    }
    if options.max_replicas is not None:
        if options.max_replicas < options.replicas:
            raise ValueError(f"--max-replicas ({options.max_replicas}) is below --replicas ({options.replicas})")
        settings["autoscaling_config"] = {"min_replicas": options.replicas, "max_replicas": options.max_replicas,
                                          "initial_replicas": options.replicas,
                                          "target_ongoing_requests": options.capacity}
    else:
        settings["num_replicas"] = options.replicas
    return serve.deployment(TextToSpeechReplica).options(**settings).bind(sources)


def app_builder(args: dict):
    """For ``serve run`` and Serve config files (``import_path: audio_pipeline.server.ray_app:app_builder``):
    ``args`` are ``config_file``, ``section_name``, ``task_args`` (NAME=VALUE list), ``model``,
    ``replicas``, ``max_replicas``, ``capacity``, ``num_cpus``, ``num_gpus``."""
    args = dict(args or {})
    model = args.pop("model", None)
    overrides = {"model": {"model_path": model}} if model else {}
    sources = config_sources(args.pop("config_file", None), args.pop("section_name", None),
                             args.pop("task_args", ()), **overrides)
    known = {"replicas", "max_replicas", "capacity", "num_cpus", "num_gpus"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown application argument(s): {', '.join(sorted(unknown))} (known: config_file, "
                         f"section_name, task_args, model, {', '.join(sorted(known))})")
    return build_app(sources, ReplicaOptions(**args))

"""``audio-pipeline serve-ray``: the engine's replicas on Ray Serve (server/ray_app.py), until a signal."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

RAY_MISSING = "serve-ray needs Ray Serve: pip install 'audio-pipeline[ray]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve")
    group.add_argument("--replicas", type=int, default=1, help="replicas (with --max-replicas: the fewest; default 1)")
    group.add_argument("--max-replicas", type=int, metavar="N",
                       help="autoscale between --replicas and N on the ongoing streams per replica")
    group.add_argument("--capacity", type=int, default=8, metavar="STREAMS",
                       help="streams one replica serves in real time, the autoscaler's target per replica "
                            "(measure it: python -m audio_pipeline.bench.serve; default 8)")
    group.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each replica reserves (default 1)")
    group.add_argument("--num-gpus", type=float, default=0.0, help="GPUs each replica reserves (default 0)")
    group.add_argument("--address", metavar="ADDRESS",
                       help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray instance is started)")
    group.add_argument("--host", default="0.0.0.0", help="address Serve's proxies listen on (default: 0.0.0.0)")
    group.add_argument("--port", type=int, default=50051, help="Serve's gRPC proxy port (default: 50051)")
    group.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port (default: 8000)")


def run(args: argparse.Namespace, overrides: dict, stop: threading.Event | None = None) -> None:
    """``overrides``: the configuration the command line sets (cli.config_overrides)."""
    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions, gRPCOptions
    except ImportError:
        raise OSError(RAY_MISSING) from None
    from audio_pipeline.server.ray_app import (APP_NAME, GRPC_SERVICER_FUNCTION, ReplicaOptions, build_app,
                                              config_sources)

    sources = config_sources(args.config_file, args.section_name, args.task_arg, **overrides)
    options = ReplicaOptions(replicas=args.replicas, max_replicas=args.max_replicas, capacity=args.capacity,
                             num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    application = build_app(sources, options)  # checks the configuration before Ray starts
    ray.init(address=args.address, include_dashboard=False)
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=args.host, port=args.http_port),
                    grpc_options=gRPCOptions(port=args.port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
        serve.run(application, name=APP_NAME, route_prefix="/")
        print(f"audio-pipeline: serving on Ray Serve: gRPC {args.host}:{args.port} (metadata application={APP_NAME}), "
              f"HTTP {args.host}:{args.http_port}; {args.replicas}"
              f"{f'-{args.max_replicas}' if args.max_replicas else ''} replica(s)", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        # Serve drains each replica (graceful_shutdown_timeout_s = grace_period_s) before stopping it.
        serve.shutdown()
        ray.shutdown()

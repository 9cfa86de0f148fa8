"""Throughput of one against several Ray Serve replicas, through Serve's gRPC proxy.

    python -m audio_pipeline.bench.ray_replicas [--replicas 1,2] [--streams 8] [--rounds 2]
                                                [--model builtin:slt-en-v5] [--num-cpus 1]

It starts a local Ray instance and Serve (server/ray_app.py), deploys the model with each replica
count in turn, and runs rounds of N concurrent streams (the serving benchmark's texts and
measurements: TTFA, RTF, streams holding real time, aggregate x real time) through the proxy,
with the client's metadata ``application: tts``. On a machine with fewer cores than replicas
need, more replicas cannot add throughput: they share the same cores (and each has its own
engine, so batches are smaller); the figure shows what the mechanism costs there.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from audio_pipeline.bench.serve import TEXTS, one_stream
from audio_pipeline.bench.server_process import free_port
from audio_pipeline.bench.stats import percentile


async def run_round(target: str, count: int, offset: int):
    from audio_pipeline.server.ray_app import APP_NAME
    from audio_pipeline_client import AsyncTTSClient

    async with AsyncTTSClient(target, retries=0, metadata=[("application", APP_NAME)]) as client:
        await client.list_voices()  # connect before the clock starts
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, TEXTS[(offset + i) % len(TEXTS)])
                                         for i in range(count)))
        return list(results), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,2", help="replica counts to compare (default 1,2)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per round (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per replica count (default 2)")
    parser.add_argument("--model", default=None, help="model (default: the built-in default voice)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each replica reserves (default 1)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from audio_pipeline.server.ray_app import (APP_NAME, GRPC_SERVICER_FUNCTION, ReplicaOptions, build_app,
                                              config_sources)

    counts = [int(n) for n in args.replicas.split(",")]
    overrides = {"model": {"model_path": args.model}} if args.model else {}
    sources = config_sources(audio_flags=args.task_arg, env={}, **overrides)
    grpc_port = free_port()
    ray.init(num_cpus=max(counts) * args.num_cpus + 1, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    rows = []
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
        target = f"127.0.0.1:{grpc_port}"
        for count in counts:
            started = time.perf_counter()
            serve.run(build_app(sources, ReplicaOptions(replicas=count, num_cpus=args.num_cpus)),
                      name=APP_NAME, route_prefix="/")
            print(f"{count} replica(s) ready in {time.perf_counter() - started:.1f} s", flush=True)
            asyncio.run(run_round(target, 1, 0))  # warm the proxy path
            for round_index in range(args.rounds):
                results, wall = asyncio.run(run_round(target, args.streams, round_index * args.streams))
                audio = sum(r.audio_seconds for r in results)
                row = (count, round_index, percentile([r.ttfa for r in results], 50) * 1000,
                       percentile([r.ttfa for r in results], 99) * 1000, statistics.median(r.rtf for r in results),
                       sum(r.stall <= 0.1 for r in results), audio / wall)
                rows.append(row)
                print(f"replicas {count} round {round_index}: {args.streams} streams, TTFA p50 {row[2]:.0f} ms "
                      f"p99 {row[3]:.0f} ms, RTF median {row[4]:.3f}, {row[5]}/{args.streams} hold real time, "
                      f"aggregate {row[6]:.2f}x real time", flush=True)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\nreplicas | aggregate x real time (mean of rounds) | TTFA p50 ms | RTF median")
    for count in counts:
        mine = [r for r in rows if r[0] == count]
        print(f"{count:8d} | {statistics.mean(r[6] for r in mine):39.2f} | {statistics.mean(r[2] for r in mine):11.0f} "
              f"| {statistics.mean(r[4] for r in mine):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

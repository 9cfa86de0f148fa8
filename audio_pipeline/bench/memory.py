"""Memory benchmark through the real server: what `audio-pipeline serve` holds idle, and after rounds
of streams (the CPU's KV cache grows on demand, and keeps what it grew to).

    python -m audio_pipeline.bench.memory [--model builtin:slt-en-v5] [--streams 32,64]
                                          [--long-text-chars 20000] [--task-arg NAME=VALUE ...]

It starts the server in a subprocess, waits for SERVING and a moment of quiet, and prints its
resident memory (VmRSS, and RssAnon: the heap, the KV cache and the weights), the KV cache's pages
(from /metrics), then the same after each round of N streams started at once, and after one
streamed text of ``--long-text-chars`` characters (0: none).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path

from audio_pipeline.bench.serve import TEXTS, run_round
from audio_pipeline.bench.server_process import Server


def resident_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of process ``pid`` in MiB (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    values = [int(re.search(rf"{name}:\s+(\d+) kB", status).group(1)) / 1024 for name in ("VmRSS", "RssAnon")]
    return values[0], values[1]


def kv_pages(server: Server) -> tuple[int, int]:
    """(pages in the KV cache, pages held by requests) from the server's /metrics."""
    metrics = server.metrics()
    total = next((v for k, v in metrics.items() if k.startswith("tts_kv_cache_blocks_total")), 0.0)
    used = next((v for k, v in metrics.items() if k.startswith("tts_kv_cache_blocks_used")), 0.0)
    return int(total), int(used)


def report(server: Server, what: str) -> None:
    time.sleep(2.0)  # let the last round's buffers go
    rss, anon = resident_mib(server.process.pid)
    total, used = kv_pages(server)
    print(f"{what:<34} RSS {rss:7.1f} MiB  (anonymous {anon:7.1f} MiB)  KV pages {total} ({used} held)", flush=True)


async def long_text(target: str, chars: int) -> float:
    """One streamed text of about ``chars`` characters; the seconds of audio it gave."""
    from audio_pipeline_client import AsyncTTSClient

    text = " ".join(TEXTS[i % len(TEXTS)] for i in range(chars // 40 + 1))[:chars]
    seconds = 0.0
    async with AsyncTTSClient(target, retries=0) as client:
        async for chunk in client.stream(text):
            if chunk.samples.shape[0]:
                seconds += chunk.samples.shape[0] / chunk.sample_rate
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="--model for the server (default: the server's, the built-in voice)")
    parser.add_argument("--streams", default="32,64", help="rounds of N streams at once after the idle reading")
    parser.add_argument("--long-text-chars", type=int, default=20000,
                        help="then one streamed text of this many characters (0: none; default 20000)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting (repeatable), as audio-pipeline serve --task-arg")
    args = parser.parse_args(argv)
    server = Server(args.model, ["limits.max_concurrent_streams=1024", *args.task_arg])
    try:
        server.wait_ready()
        report(server, "idle after start-up")
        for count in [int(n) for n in args.streams.split(",") if n]:
            asyncio.run(run_round(server.target, count, 0))
            report(server, f"after {count} streams")
        if args.long_text_chars:
            seconds = asyncio.run(long_text(server.target, args.long_text_chars))
            report(server, f"after {args.long_text_chars} chars ({seconds:.0f} s)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

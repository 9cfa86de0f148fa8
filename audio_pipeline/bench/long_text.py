"""A long text through the real server: time to first audio, RTF, and the longest playback stall.

    python -m audio_pipeline.bench.long_text [--file tests/data/long_text.txt] [--model M] [--streams 1]

It starts `audio-pipeline serve` (default settings unless ``--task-arg`` says otherwise), sends the
whole file as one Synthesize request (``--streams`` of them at once) and reports, per stream: time
to first audio, the seconds of audio and the wall time (RTF), and the longest stall a player that
starts at the first chunk and plays continuously would see; and how the word timings cover the
text (written words inside exactly one timing, in order).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import re
import time
from pathlib import Path

from audio_pipeline.bench.serve import one_stream
from audio_pipeline.bench.server_process import Server
from audio_pipeline.bench.stats import percentile

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "tests" / "data" / "long_text.txt"


async def run(target: str, text: str, streams: int):
    from audio_pipeline_client import AsyncTTSClient

    async with AsyncTTSClient(target, retries=0, timeout=3600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, text) for _ in range(streams)))
        return results, time.perf_counter() - started


def timing_coverage(text: str, words) -> str:
    """How the stream's word timings cover ``text``'s written words (letters and digits)."""
    spans = [(w.text_start, w.text_end) for w in words]
    ordered = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    written = [m.span() for m in re.finditer(r"[^\W_]+", text)]
    starts = [s for s, _ in spans]

    covered = 0
    for start, end in written:
        k = bisect.bisect_right(starts, start) - 1
        covered += k >= 0 and spans[k][0] <= start and end <= spans[k][1]
    precision = ",".join(sorted({w.precision for w in words})) or "none"
    return (f"{len(words)} timings ({precision}), {covered} of {len(written)} written words covered, "
            f"{'in order' if ordered else 'OUT OF ORDER'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.long_text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help="the text (default: %(default)s)")
    parser.add_argument("--model", help="--model for the server (default: the server's default model)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="server settings, as for `audio-pipeline serve` (repeatable)")
    parser.add_argument("--streams", type=int, default=1, help="copies of the request sent at once")
    args = parser.parse_args(argv)
    text = args.file.read_text()
    server = Server(args.model, args.task_arg)
    try:
        server.wait_ready()
        print(f"server: {' '.join(server.command[3:])}", flush=True)
        print(f"text: {args.file.name}, {len(text)} characters, {len(text.split())} words; {args.streams} stream(s)",
              flush=True)
        results, wall = asyncio.run(run(server.target, text, args.streams))
    finally:
        server.stop()
        os.unlink(server.log.name)
    for index, result in enumerate(results):
        print(f"stream {index}: first audio {1000 * result.ttfa:.0f} ms, {result.audio_seconds:.1f} s of audio in "
              f"{result.rtf * result.audio_seconds:.1f} s (RTF {result.rtf:.3f}), longest playback stall "
              f"{1000 * result.stall:.0f} ms")
        print(f"stream {index}: word timings: {timing_coverage(text, result.words)}")
    if len(results) > 1:
        print(f"TTFA p50 {1000 * percentile([r.ttfa for r in results], 50):.0f} ms, worst stall "
              f"{1000 * max(r.stall for r in results):.0f} ms, wall {wall:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

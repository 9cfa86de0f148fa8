"""Open-loop serving benchmark: requests arrive as a Poisson process, as voice apps send them, and
each stream is judged as its listener hears it.

    python -m audio_pipeline.bench.open_loop --rps 1,2,4,8 [--duration 30] [--door http|grpc] [--search]
    python -m audio_pipeline.bench.serve --arrival poisson --rps 4 --rps 8      (the same)
    python -m audio_pipeline.bench.open_loop --device cuda --random-model qwen3-tts-0.6b --door grpc --rps 20

It starts `audio-pipeline serve` (default settings unless ``--model`` or ``--task-arg`` say
otherwise; gRPC and HTTP), sends a warm-up, then for each rate R sends requests at exponentially
distributed intervals (mean 1/R s, drawn from ``--seed``: the same schedule every run), whatever
the server's progress (open loop), for ``--warmup`` + ``--duration`` seconds; only the requests
sent after the warm-up count, each followed to its end. Texts come from a fixed pool of everyday
sentences (bench/texts.py). The door: the OpenAI speech route streaming raw PCM at 24 kHz
(``--door http``, the default) or gRPC's Synthesize (``--door grpc``; with ``--random-model`` every
stream is exactly ``--utterance-tokens`` long, which only gRPC can ask for).

Per stream (the definitions of docs in ../shared/design/streaming.md, as published servers report):
- the playback model (audio/playback.py): the client plays from the first sample it receives; a
  piece arriving after the audio in hand ran out is an underrun, and the request *stalled*;
- audible first audio: request sent to the audible onset (audio/audibility.py: the first two
  consecutive 20 ms frames at -45 dBFS or more) on the player's clock; first byte beside it;
- leading silence: the received audio before the audible onset; RTF: request to completion over
  the audio's length.

Per rate it prints the requests measured (and refused, and failed), the stalled-request %, the
underruns, the largest and total stall, audible first audio and first byte p50/p95/p99, leading
silence p50/p95, RTF p50/p95, the load in x real time (the audio asked for per second of wall
time) and the server's own view from /metrics (its underrun count, service/stream_metrics.py).
With ``--search`` it then looks for the highest rate with no stalled request and audible first
audio p95 within ``--audible-limit-ms``: doubling past the best rate measured, then bisecting to
``--search-precision``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from audio_pipeline.audio.audibility import audible_onset
from audio_pipeline.audio.playback import Playback
from audio_pipeline.bench.server_process import Server
from audio_pipeline.bench.stats import percentile
from audio_pipeline.bench.texts import EVERYDAY

#: The OpenAI route's raw PCM: 16-bit little-endian mono at 24 kHz.
PCM_RATE = 24000


@dataclass
class Outcome:
    """One request as its listener heard it."""

    sent: float
    text: str
    #: "ok", "refused" (the server turned it away: 429/503, RESOURCE_EXHAUSTED, UNAVAILABLE) or "failed".
    status: str = "ok"
    error: str = ""
    first_byte: float = math.nan
    #: Request sent to the audible onset on the player's clock (nan: nothing audible).
    audible: float = math.nan
    leading_silence: float = math.nan
    audio_seconds: float = 0.0
    done: float = math.nan
    playback: Playback = field(default_factory=Playback)

    @property
    def rtf(self) -> float:
        return (self.done - self.sent) / self.audio_seconds if self.audio_seconds else math.inf

    @property
    def stalled(self) -> bool:
        return self.playback.underruns > 0


class Listener:
    """What one client receives: pieces of audio with their arrival times, played as they come."""

    def __init__(self, outcome: Outcome, sample_rate: int):
        self.outcome = outcome
        self.sample_rate = sample_rate
        self._pieces: list[np.ndarray] = []

    def receive(self, samples: np.ndarray) -> None:
        now = time.perf_counter()
        if not samples.size:
            return
        if math.isnan(self.outcome.first_byte):
            self.outcome.first_byte = now - self.outcome.sent
        self._pieces.append(samples)
        self.outcome.playback.arrive(now, samples.size / self.sample_rate)

    def end(self) -> None:
        outcome = self.outcome
        outcome.done = time.perf_counter()
        outcome.audio_seconds = outcome.playback.received
        audio = np.concatenate(self._pieces) if self._pieces else np.zeros(0, np.float32)
        onset = audible_onset(audio, self.sample_rate)
        if onset is not None:
            outcome.leading_silence = onset / self.sample_rate
            outcome.audible = outcome.playback.plays_at(onset / self.sample_rate) - outcome.sent


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


async def http_speech(host: str, port: int, body: dict):
    """POST /v1/audio/speech and yield the body's pieces as they arrive (one per HTTP chunk, as the
    server writes them). A plain HTTP/1.1 client, so the timing is the socket's, not a library's."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise HttpError(status, await reader.read())
        if headers.get("transfer-encoding", "").lower() != "chunked":
            yield await reader.read()
            return
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    finally:
        writer.close()


async def speak_http(host: str, port: int, outcome: Outcome) -> None:
    listener = Listener(outcome, PCM_RATE)
    body = {"model": "tts", "input": outcome.text, "response_format": "pcm", "stream": True}
    carry = b""  # an odd byte held for the next piece (16-bit samples)
    try:
        async for data in http_speech(host, port, body):
            data = carry + data
            whole = len(data) - len(data) % 2
            carry = data[whole:]
            listener.receive(np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0)
    except HttpError as error:
        outcome.status = "refused" if error.status in (429, 503) else "failed"
        outcome.error = str(error)
        return
    except (OSError, asyncio.IncompleteReadError, ValueError) as error:
        outcome.status, outcome.error = "failed", f"{type(error).__name__}: {error}"
        return
    listener.end()


async def speak_grpc(client, outcome: Outcome, tokens: int | None) -> None:
    from audio_pipeline_client import TTSError

    listener = None
    try:
        async for chunk in client.stream(outcome.text, min_tokens=tokens, max_tokens=tokens, sample_rate=PCM_RATE):
            if chunk.final:
                break
            listener = listener or Listener(outcome, chunk.sample_rate)
            listener.receive(np.asarray(chunk.samples, dtype=np.float32).reshape(-1))
    except TTSError as error:
        code = getattr(error, "code", None)
        outcome.status = "refused" if str(code).endswith(("RESOURCE_EXHAUSTED", "UNAVAILABLE")) else "failed"
        outcome.error = str(error)
        return
    (listener or Listener(outcome, PCM_RATE)).end()


def arrival_times(rate: float, seconds: float, seed: int) -> list[float]:
    """Send times in [0, seconds) of a Poisson process of ``rate`` per second (its own random stream)."""
    rng = random.Random(f"{seed}:{rate}")
    times, now = [], rng.expovariate(rate)
    while now < seconds:
        times.append(now)
        now += rng.expovariate(rate)
    return times


@dataclass
class RateRun:
    rate: float
    duration: float
    outcomes: list[Outcome]
    #: The server's own count of underruns it caused (its playback model on what it sent), over the run.
    server_underruns: float = math.nan
    server_stalled: float = math.nan

    @property
    def served(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "ok"]

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def stalled_fraction(self) -> float:
        served = self.served
        return sum(o.stalled for o in served) / len(served) if served else math.nan

    def audible_p95(self) -> float:
        values = [o.audible for o in self.served]
        if not values:
            return math.inf
        return percentile([math.inf if math.isnan(v) else v for v in values], 95)

    def passes(self, audible_limit: float) -> bool:
        """No stalled request, nothing refused or failed, audible first audio p95 within the limit."""
        return (bool(self.served) and len(self.served) == len(self.outcomes) and self.stalled_fraction == 0
                and self.audible_p95() <= audible_limit)

    def row(self) -> str:
        served = self.served
        if not served:
            return f"{self.rate:>6.2f} {len(self.outcomes):>5} {0:>5} {self.count('refused'):>5} {self.count('failed'):>4}"

        def ms(values: list[float], q: float) -> str:
            values = [v for v in values if not math.isnan(v)]
            return f"{1000 * percentile(values, q):>6.0f}" if values else f"{'-':>6}"

        audible = [math.inf if math.isnan(o.audible) else o.audible for o in served]
        first = [o.first_byte for o in served]
        lead = [o.leading_silence for o in served]
        rtf = [o.rtf for o in served]
        stalls = [o.playback.largest_stall for o in served]
        load = sum(o.audio_seconds for o in served) / self.duration
        return (f"{self.rate:>6.2f} {len(self.outcomes):>5} {len(served):>5} {self.count('refused'):>5} "
                f"{self.count('failed'):>4} {100 * self.stalled_fraction:>7.1f} "
                f"{sum(o.playback.underruns for o in served):>5} {1000 * max(stalls):>6.0f} "
                f"{1000 * sum(o.playback.stalled for o in served):>7.0f} "
                f"{ms(audible, 50)} {ms(audible, 95)} {ms(audible, 99)} {ms(first, 50)} {ms(first, 95)} "
                f"{ms(first, 99)} {ms(lead, 50)} {ms(lead, 95)} {statistics.median(rtf):>6.3f} "
                f"{percentile(rtf, 95):>6.3f} {load:>6.1f}x {self.server_underruns:>6.0f}")


HEADER = (f"{'req/s':>6} {'sent':>5} {'done':>5} {'refus':>5} {'fail':>4} {'stall%':>7} {'under':>5} "
          f"{'max ms':>6} {'tot ms':>7} {'aud50':>6} {'aud95':>6} {'aud99':>6} {'fb50':>6} {'fb95':>6} "
          f"{'fb99':>6} {'lead50':>6} {'lead95':>6} {'RTF50':>6} {'RTF95':>6} {'load':>7} {'srv un':>6}")
NOTE = ("sent: requests sent after the warm-up (each followed to its end); done: served; stall%: served requests "
        "with an underrun; under: underruns; max/tot ms: largest and total stall; aud: audible first audio "
        "(request to audible onset, player's clock), fb: first byte, lead: leading silence (ms, percentiles); "
        "RTF: request to completion / audio; load: audio asked for per wall second (x real time); srv un: the "
        "server's own underrun count (/metrics)")


async def run_rate(target, rate: float, duration: float, warmup: float, seed: int, door: str,
                   tokens: int | None = None) -> list[Outcome]:
    """Sends the rate's requests on schedule, whatever the server's progress; returns those sent
    after ``warmup`` seconds once all have ended."""
    from audio_pipeline_client import AsyncTTSClient

    times = arrival_times(rate, warmup + duration, seed)
    text_rng = random.Random(f"{seed}:{rate}:texts")
    outcomes = [Outcome(sent=math.nan, text=text_rng.choice(EVERYDAY)) for _ in times]
    client = AsyncTTSClient(target.grpc, retries=0) if door == "grpc" else None

    async def one(outcome: Outcome, at: float, start: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        outcome.sent = time.perf_counter()
        if door == "grpc":
            await speak_grpc(client, outcome, tokens)
        else:
            await speak_http(target.host, target.http_port, outcome)

    try:
        if client is not None:
            await client.__aenter__()
        start = time.perf_counter()
        await asyncio.gather(*(one(o, t, start) for o, t in zip(outcomes, times)))
    finally:
        if client is not None:
            await client.__aexit__(None, None, None)
    return [o for o, t in zip(outcomes, times) if t >= warmup]


@dataclass
class Target:
    host: str
    grpc_port: int
    http_port: int | None

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def measure(server: Server, target: Target, rate: float, args) -> RateRun:
    before = server.metrics()
    outcomes = asyncio.run(run_rate(target, rate, args.duration, args.warmup, args.seed, args.door, args.tokens))
    after = server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return RateRun(rate, args.duration, outcomes, server_underruns=delta("tts_stream_underruns_total"),
                   server_stalled=delta("tts_streams_stalled_total"))


def search(measured: dict[float, RateRun], probe, limit: float, precision: float, ceiling: float) -> float:
    """The highest rate that passes: doubling past the best passing rate measured, then bisecting
    until the bracket is within ``precision`` (a fraction of the rate)."""
    low = max((r for r, run in measured.items() if run.passes(limit)), default=0.0)
    high = min((r for r, run in measured.items() if r > low and not run.passes(limit)), default=None)
    while high is None:
        candidate = low * 2 if low else 0.5
        if candidate > ceiling:
            return low
        if probe(candidate).passes(limit):
            low = candidate
        else:
            high = candidate
    while high - low > precision * max(low, 0.25):
        middle = round((low + high) / 2, 2)
        if probe(middle).passes(limit):
            low = middle
        else:
            high = middle
    return low


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.open_loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser, *, shared: bool = True) -> None:
    """The open-loop options (``shared``: also the server options bench.serve has already)."""
    parser.add_argument("--rps", action="append", default=[], metavar="R",
                        help="arrival rate in requests per second (repeatable, or comma-separated; default 1,2,4,8)")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of arrivals measured at each rate (default 30)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds of arrivals at each rate before the measured ones (default 5; not counted)")
    parser.add_argument("--door", choices=("http", "grpc"), default="http",
                        help="the OpenAI speech route streaming PCM at 24 kHz (http, default) or gRPC Synthesize")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times and texts (default 0)")
    parser.add_argument("--audible-limit-ms", type=float, default=150.0,
                        help="the search's goal: audible first audio p95 within this (default 150)")
    parser.add_argument("--search-precision", type=float, default=0.1,
                        help="the search stops when its bracket is within this fraction of the rate (default 0.1)")
    parser.add_argument("--search-ceiling", type=float, default=256.0,
                        help="the search does not try rates above this (default 256 req/s)")
    if shared:
        parser.add_argument("--search", action="store_true",
                            help="find the highest rate with no stalled request and audible p95 within the limit")
        parser.add_argument("--model", help="--model for the server (default: the server's default model)")
        parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                            help="server settings, as for `audio-pipeline serve` (repeatable)")
        parser.add_argument("--device", help="--device for the server")
        parser.add_argument("--random-model", metavar="SHAPE",
                            help="serve a randomly initialised model of this shape (bench.serve's shapes); "
                                 "needs --door grpc")
        parser.add_argument("--utterance-tokens", type=int, default=490,
                            help="with --random-model, speech tokens per stream (default 490)")
        parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
        parser.add_argument("--server-log", metavar="PATH", help="keep the server's log here")


def rates_of(values: list[str]) -> list[float]:
    rates = [float(v) for value in values for v in value.split(",") if v.strip()]
    if any(r <= 0 for r in rates):
        raise SystemExit("--rps: rates must be above 0")
    return rates or [1.0, 2.0, 4.0, 8.0]


def run(args) -> int:
    rates = rates_of(args.rps)
    if args.random_model and args.door != "grpc":
        raise SystemExit("--random-model needs --door grpc (a random model's streams are given their length, "
                         "which the OpenAI route cannot ask for)")
    args.tokens = args.utterance_tokens if args.random_model else None
    task_args = list(args.task_arg)
    if not any(arg.startswith("limits.max_concurrent_streams=") for arg in task_args):
        task_args.append("limits.max_concurrent_streams=4096")  # gRPC streams share one connection
    model, model_dir = args.model, None
    if args.random_model:
        from audio_pipeline.testing.random_models import write_random_model

        model_dir = tempfile.mkdtemp(prefix=f"random-{args.random_model}-")
        model = str(write_random_model(model_dir, args.random_model))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server(model, task_args, device=args.device, log_path=args.server_log,
                    start_timeout=args.start_timeout, http=args.door == "http")  # only the door measured
    succeeded = False
    try:
        server.wait_ready()
        target = Target("127.0.0.1", server.port, server.http_port)
        print(f"server: {' '.join(server.command[3:])}", flush=True)
        print(f"open loop: Poisson arrivals, {args.warmup:.0f} s warm-up + {args.duration:.0f} s measured per rate, "
              f"door {args.door}, seed {args.seed}", flush=True)
        asyncio.run(run_rate(target, 2.0, 2.0, 0.0, args.seed + 1, args.door, args.tokens))  # warm-up
        print(HEADER, flush=True)
        measured: dict[float, RateRun] = {}

        def probe(rate: float) -> RateRun:
            if rate not in measured:
                measured[rate] = measure(server, target, rate, args)
                print(measured[rate].row(), flush=True)
                failures = [o for o in measured[rate].outcomes if o.status == "failed"]
                if failures:
                    print(f"  {len(failures)} failed, e.g. {failures[0].error}", flush=True)
            return measured[rate]

        for rate in rates:
            probe(rate)
        if args.search:
            limit = args.audible_limit_ms / 1000
            best = search(measured, probe, limit, args.search_precision, args.search_ceiling)
            print(f"highest rate with no stalled request and audible first audio p95 <= {args.audible_limit_ms:.0f} "
                  f"ms: {best:g} req/s", flush=True)
        print(NOTE, flush=True)
        succeeded = True
        return 0
    finally:
        server.finish(succeeded, keep_log=bool(args.server_log), model_dir=model_dir)


if __name__ == "__main__":
    raise SystemExit(main())

"""Reliability suite: hostile input, cancels, overload, a slow reader and SIGTERM against a real server.

    python -m audio_pipeline.bench.reliability [--model builtin:slt-en-v5] [--fuzz 2000] [--cancels 500]
                                                [--overload-factor 4] [--seed 0]

It starts `audio-pipeline serve` in a subprocess on loopback (free ports, /metrics on), with a small
admission capacity (``--max-batch-size``, ``--max-queue-size``) so that overload is reached quickly,
and runs, in order:

1. fuzz: ``--fuzz`` hostile requests (random and extreme field values, corrupt bytes, invalid UTF-8,
   huge and odd texts, bad sample rates, encodings and references), several at a time, with a plain
   request (an *innocent*) sent alongside every few of them; health is probed every 100 ms;
2. cancels: ``--cancels`` streams cancelled by their client after 0 to 2 messages;
3. overload: ``--overload-factor`` times the server's capacity (running plus queued requests) at once;
4. a slow reader: one client reads a long stream slowly while another request runs;
5. SIGTERM: a second server is stopped while streams run; they must finish or end UNAVAILABLE and
   the process must exit 0.

It prints counts by status code per phase and these checks (exit status 1 if any fails): no UNKNOWN
or INTERNAL answer and no hang for client input; no innocent harmed; overload refused only with
RESOURCE_EXHAUSTED and at least the capacity admitted; no request or KV block left held; threads
and memory flat (after the first fuzz requests, against the end); health SERVING afterwards; the
SIGTERM drain. The test suite runs a quick version (tests/test_reliability.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from audio_pipeline.bench.fuzz import SENTENCES, fuzz_cases
from audio_pipeline.bench.server_process import Server
from audio_pipeline.bench.stats import percentile
from audio_pipeline_client._proto import tts_pb2

SYNTHESIZE = "/audio_pipeline.v1.TextToSpeech/Synthesize"
#: Answers client input must never get.
FORBIDDEN = {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"}
CALL_TIMEOUT_S = 180.0
LONG_TEXT = " ".join(SENTENCES[:3])


@dataclass
class Outcome:
    code: str
    audio_messages: int = 0
    seconds: float = 0.0
    details: str = ""


@dataclass
class Report:
    counts: dict[str, Counter] = field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def count(self, phase: str, outcome: Outcome, kind: str = "") -> None:
        self.counts.setdefault(phase, Counter())[outcome.code] += 1
        if outcome.code in FORBIDDEN:
            self.examples.setdefault(f"{phase}/{kind}", []).append(f"{outcome.code}: {outcome.details[:200]}")

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


async def call(channel: grpc.aio.Channel, payload: bytes, *, read_delay: float = 0.0,
               cancel_after: int | None = None) -> Outcome:
    """One Synthesize call with raw request bytes; reads every message (or cancels after some)."""
    started = time.monotonic()
    rpc = channel.unary_stream(SYNTHESIZE, request_serializer=None, response_deserializer=None)
    stream = rpc(payload, timeout=CALL_TIMEOUT_S)
    audio = 0
    messages = 0
    if cancel_after == 0:  # gone right after sending
        await asyncio.sleep(0.01)
        stream.cancel()
        return Outcome("CANCELLED_BY_CLIENT", 0, time.monotonic() - started)
    try:
        async for message in stream:
            messages += 1
            if tts_pb2.AudioChunk.FromString(message).WhichOneof("content") == "audio":
                audio += 1
            if cancel_after is not None and messages >= cancel_after:
                stream.cancel()
                return Outcome("CANCELLED_BY_CLIENT", audio, time.monotonic() - started)
            if read_delay:
                await asyncio.sleep(read_delay)
    except grpc.aio.AioRpcError as error:
        return Outcome(error.code().name, audio, time.monotonic() - started, error.details() or "")
    except asyncio.CancelledError:
        stream.cancel()
        raise
    return Outcome("OK", audio, time.monotonic() - started)


def innocent_request(index: int) -> bytes:
    return tts_pb2.SynthesizeRequest(text=SENTENCES[index % len(SENTENCES)],
                                     sampling=tts_pb2.SamplingParams(seed=index)).SerializeToString()


def process_state(pid: int) -> tuple[int, int]:
    """(threads, resident kB) of a process, from /proc."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        values[key] = value.split()
    return int(values["Threads"][0]), int(values["VmRSS"][0])


async def probe_health(channel: grpc.aio.Channel, latencies: list[float], stop: asyncio.Event) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    while not stop.is_set():
        started = time.monotonic()
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            latencies.append(time.monotonic() - started)
        except grpc.aio.AioRpcError:
            latencies.append(float("inf"))
        await asyncio.sleep(0.1)


async def fuzz_phase(server: Server, count: int, concurrency: int, innocent_every: int, seed: int,
                     report: Report) -> tuple[tuple[int, int], list[float]]:
    """Returns the server's (threads, kB) once the first tenth of the cases ran, and health latencies."""
    cases = fuzz_cases(count, seed)
    baseline: tuple[int, int] | None = None
    latencies: list[float] = []
    innocents: list[Outcome] = []
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(server.target) as channel, \
            grpc.aio.insecure_channel(server.target) as health_channel:
        stop = asyncio.Event()
        prober = asyncio.create_task(probe_health(health_channel, latencies, stop))

        async def one(index: int) -> None:
            nonlocal baseline
            async with gate:
                case = cases[index]
                outcome = await call(channel, case.payload)
                report.count("fuzz", outcome, case.kind)
                if index % innocent_every == 0:
                    innocent = await call(channel, innocent_request(index))
                    innocents.append(innocent)
                if index == len(cases) // 10:
                    baseline = process_state(server.process.pid)

        await asyncio.gather(*(one(i) for i in range(len(cases))))
        stop.set()
        await prober
    harmed = [o for o in innocents if o.code != "OK" or o.audio_messages == 0]
    report.counts["innocents"] = Counter(o.code for o in innocents)
    report.check("fuzz: no UNKNOWN, INTERNAL or hang", not (set(report.counts["fuzz"]) & FORBIDDEN),
                 ", ".join(f"{k} {v}" for k, v in sorted(report.counts["fuzz"].items())))
    report.check("fuzz: innocents unharmed", not harmed,
                 f"{len(innocents) - len(harmed)}/{len(innocents)} plain requests ran alongside and finished "
                 f"with audio" + (f"; harmed: {Counter(o.code for o in harmed)}" if harmed else ""))
    finite = [x for x in latencies if x != float("inf")]
    report.check("fuzz: health answered throughout", len(finite) == len(latencies) and bool(finite),
                 f"{len(latencies)} checks, p50 {1000 * percentile(finite, 50):.1f} ms, "
                 f"p99 {1000 * percentile(finite, 99):.1f} ms" if finite else "no answer")
    return baseline or process_state(server.process.pid), latencies


async def cancel_phase(server: Server, count: int, concurrency: int, report: Report) -> None:
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(server.target) as channel:
        async def one(index: int) -> Outcome:
            async with gate:
                return await call(channel, innocent_request(index), cancel_after=rng.randrange(3))
        outcomes = await asyncio.gather(*(one(i) for i in range(count)))
    for outcome in outcomes:
        report.count("cancels", outcome)
    report.check("cancels: no UNKNOWN or INTERNAL", not (set(report.counts["cancels"]) & FORBIDDEN),
                 ", ".join(f"{k} {v}" for k, v in sorted(report.counts["cancels"].items())))


async def overload_phase(server: Server, capacity: int, factor: int, report: Report) -> None:
    count = capacity * factor
    async with grpc.aio.insecure_channel(server.target) as channel:
        outcomes = await asyncio.gather(*(call(channel, innocent_request(i)) for i in range(count)))
    for outcome in outcomes:
        report.count("overload", outcome)
    codes = report.counts["overload"]
    refused = [o.seconds for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    report.check("overload: refused only with RESOURCE_EXHAUSTED", set(codes) <= {"OK", "RESOURCE_EXHAUSTED"},
                 f"{count} requests at once: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    report.check("overload: the whole capacity admitted", codes["OK"] >= capacity,
                 f"{codes['OK']} admitted, capacity {capacity}; refusals took p50 "
                 f"{1000 * percentile(refused, 50):.1f} ms, p99 {1000 * percentile(refused, 99):.1f} ms"
                 if refused else f"{codes['OK']} admitted, capacity {capacity}, none refused")


async def slow_reader_phase(server: Server, report: Report) -> None:
    slow_request = tts_pb2.SynthesizeRequest(text=LONG_TEXT, sampling=tts_pb2.SamplingParams(seed=3))
    async with grpc.aio.insecure_channel(server.target) as slow_channel, \
            grpc.aio.insecure_channel(server.target) as channel:
        slow = asyncio.create_task(call(slow_channel, slow_request.SerializeToString(), read_delay=0.3))
        await asyncio.sleep(0.5)
        other = await call(channel, innocent_request(7))
        slow_outcome = await slow
    report.count("slow reader", slow_outcome)
    report.count("slow reader", other)
    report.check("slow reader: it and a request beside it finish", slow_outcome.code == other.code == "OK",
                 f"slow reader {slow_outcome.code} after {slow_outcome.seconds:.1f} s, other {other.code} "
                 f"in {other.seconds:.2f} s")


async def wait_drained(server: Server, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if metrics.get("tts_requests_running", 0) == 0 and metrics.get("tts_requests_queued", 0) == 0 and \
                metrics.get("tts_kv_cache_blocks_used", 0) == 0:
            return metrics
        if time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.2)


async def health_status(target: str) -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                   timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def sigterm_phase(model: str | None, task_args: list[str], grace: float, report: Report) -> None:
    from audio_pipeline.bench.server_process import wait_ready

    server = Server(model, task_args + [f"grace_period_s={grace}"])
    try:
        await wait_ready(server.target, timeout=600)
        async with grpc.aio.insecure_channel(server.target) as channel:
            streams = [asyncio.create_task(call(channel, tts_pb2.SynthesizeRequest(
                text=LONG_TEXT, sampling=tts_pb2.SamplingParams(seed=i)).SerializeToString())) for i in range(4)]
            await asyncio.sleep(1.0)
            server.process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            outcomes = await asyncio.gather(*streams)
        exit_code = await asyncio.get_running_loop().run_in_executor(
            None, lambda: server.process.wait(timeout=grace + 60))
        seconds = time.monotonic() - started
    finally:
        server.stop()
        os.unlink(server.log.name)
    for outcome in outcomes:
        report.count("sigterm", outcome)
    codes = report.counts["sigterm"]
    report.check("SIGTERM: streams finish or end UNAVAILABLE, the process exits 0",
                 set(codes) <= {"OK", "UNAVAILABLE"} and exit_code == 0,
                 ", ".join(f"{k} {v}" for k, v in sorted(codes.items())) + f"; exit {exit_code} after {seconds:.1f} s "
                 f"(grace period {grace:g} s)")


def server_args(args: argparse.Namespace) -> list[str]:
    return [f"max_batch_size={args.max_batch_size}", f"max_queue_size={args.max_queue_size}",
            f"sampling.max_text_chars={args.max_text_chars}", *args.task_arg]


async def run(args: argparse.Namespace) -> Report:
    from audio_pipeline.bench.server_process import wait_ready

    report = Report()
    task_args = server_args(args)
    server = Server(args.model, task_args)
    try:
        await wait_ready(server.target, timeout=600)
        print(f"server: {' '.join(server.command[3:])}", flush=True)
        print(f"fuzz: {args.fuzz} hostile requests, {args.concurrency} at a time, an innocent beside every "
              f"{args.innocent_every}", flush=True)
        baseline, _ = await fuzz_phase(server, args.fuzz, args.concurrency, args.innocent_every, args.seed, report)
        print(f"cancels: {args.cancels}", flush=True)
        await cancel_phase(server, args.cancels, args.concurrency, report)
        await wait_drained(server)  # cancelled streams leave the engine at its next step
        capacity = args.max_batch_size + args.max_queue_size
        print(f"overload: {args.overload_factor} x capacity {capacity}", flush=True)
        await overload_phase(server, capacity, args.overload_factor, report)
        await wait_drained(server)
        print("slow reader", flush=True)
        await slow_reader_phase(server, report)
        metrics = await wait_drained(server)
        report.check("nothing left held", metrics.get("tts_requests_running", 0) == 0 and
                     metrics.get("tts_requests_queued", 0) == 0 and metrics.get("tts_kv_cache_blocks_used", 0) == 0,
                     f"running {metrics.get('tts_requests_running', 0):g}, queued "
                     f"{metrics.get('tts_requests_queued', 0):g}, KV blocks used "
                     f"{metrics.get('tts_kv_cache_blocks_used', 0):g}")
        threads, kilobytes = process_state(server.process.pid)
        grown = (kilobytes - baseline[1]) / 1024
        report.check("threads and memory flat", threads <= baseline[0] + 2 and grown <= max(100.0, baseline[1] / 4096),
                     f"threads {baseline[0]} -> {threads}, resident {baseline[1] / 1024:.0f} -> "
                     f"{kilobytes / 1024:.0f} MB")
        status = await health_status(server.target)
        report.check("health SERVING afterwards", status == "SERVING" and server.process.poll() is None, status)
    finally:
        server.stop()
        os.unlink(server.log.name)
    print("SIGTERM", flush=True)
    await sigterm_phase(args.model, task_args, args.grace, report)
    print("\nstatus codes by phase:")
    for phase, counts in report.counts.items():
        print(f"  {phase:<12} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for where, examples in report.examples.items():
        print(f"  {where}: {examples[:3]}")
    print("PASS" if report.passed else "FAIL", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.reliability", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="--model for the server (default: the server's default model)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="more server settings, as for `audio-pipeline serve` (repeatable)")
    parser.add_argument("--fuzz", type=int, default=2000, help="hostile requests (default 2000)")
    parser.add_argument("--cancels", type=int, default=500, help="streams cancelled mid-way (default 500)")
    parser.add_argument("--overload-factor", type=int, default=4,
                        help="burst size as a multiple of the server's capacity (default 4)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--innocent-every", type=int, default=10,
                        help="a plain request beside every N-th hostile one (default 10)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the server's max_batch_size (default 8)")
    parser.add_argument("--max-queue-size", type=int, default=16, help="the server's max_queue_size (default 16)")
    parser.add_argument("--max-text-chars", type=int, default=2000,
                        help="the server's sampling.max_text_chars: longer hostile texts are refused, shorter ones "
                             "spoken, which bounds the run's time (default 2000)")
    parser.add_argument("--grace", type=float, default=10.0, help="grace period of the SIGTERM server (default 10 s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hostile requests")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

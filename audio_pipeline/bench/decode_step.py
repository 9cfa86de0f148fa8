"""Decode-step benchmark: the engine's own step (scheduler, model runner, sampling, the update) at
fixed batch sizes and context, in this process, against the memory floor; and one step profiled.

    python -m audio_pipeline.bench.decode_step --random-model orpheus-3b --device cuda \\
        [--batches 1,64,128,256] [--context 300] [--steps 40] [--variants graphs,eager,fp8] [--profile 128] \\
        [--engine-loop]

For each variant it builds the engine once (``TTSEngine``, not started: its model, KV cache,
runner and CUDA graphs, with decode buckets equal to ``--batches``) and, per batch size B, starts B
requests, decodes until each one's context is ``--context`` tokens, then times ``--steps`` decode
steps two ways:

- ``sync``: schedule, launch, read the result, update, one step after the other (no overlap);
- ``ahead``: step n + 1 is scheduled and launched before step n's result is read (the engine's
  overlap pipeline on CUDA), so the host's work hides behind the device's.

With ``--engine-loop`` each batch then runs through the engine's own loop as a server runs it
(``EngineCore`` on its thread, with its settings: multi-step rounds, deadlines, the audio decoder):
the same requests submitted to it and timed over ``--steps`` forward passes once they hold the
context, from the engine's own step metrics. It prints the wall time a pass, the step's share
(scheduling, inputs, model, sampling, update), the audio decoder's, and the host time beyond them
(first-token notes, deadlines and load metrics, finding the due decoder windows, delivery).

Variants: ``graphs`` (bf16 cache, CUDA graphs, fused layers: the CUDA defaults), ``eager`` (the same
without graphs), ``unfused`` (graphs, model.fuse_layers=false), ``page64`` (pages of 64 tokens), ``page16``
(eager, pages of 16 tokens: on the CPU, the host's share of a step with CUDA's page tables), ``fp8``
(an fp8_e4m3 cache), ``fa2`` (the FA2 prefill kernel).

The floor of a step is its bytes (the layers' linear weights once, plus B x context x the KV bytes
per token) over the device's read bandwidth, measured first (bench.serve's read_bandwidth).

``--profile B`` records a few ``ahead`` steps of every variant at batch B with the torch
profiler and prints, for the middle step: its wall time, the device's busy time (kernels and
copies, overlaps merged), the idle gaps between them (count, total, largest), and the kernels
that took the most time. ``--trace PATH`` also writes the Chrome trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

#: What each variant sets (model settings over the benchmark's own).
VARIANTS = {
    "graphs": {"cuda_graphs": True},
    "eager": {"cuda_graphs": False},
    "unfused": {"cuda_graphs": True, "fuse_layers": False},
    "page64": {"cuda_graphs": True, "kv_cache": {"kv_cache_page_size": 64}},
    "page16": {"cuda_graphs": False, "kv_cache": {"kv_cache_page_size": 16}},
    "fp8": {"cuda_graphs": True, "kv_cache": {"cache_dtype": "fp8_e4m3"}},
    "fa2": {"cuda_graphs": True, "kv_cache": {"prefill_backend": "fa2"}},
}


@dataclass
class StepTimes:
    batch: int
    sync_ms: float
    ahead_ms: float
    #: The host's ms per step of the ahead run: the scheduler, staging the inputs, the update.
    host_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)


def build_engine(model_dir: str, device: str, batches: list[int], context: int, steps: int, variant: dict):
    """The engine's parts for ``model_dir`` sized for the largest batch (not started)."""
    import json
    from pathlib import Path

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    largest = max(batches)
    limit = context + 4 * steps + 64  # every request's context and the steps timed after it, with room
    # A cache that holds them all, at 4 bytes an element: no cache dtype is wider (float32 on the CPU).
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4
    kv = {"kv_cache_memory_bytes": largest * limit * per_token, **variant.get("kv_cache", {})}
    model = {"model_path": model_dir, "device": device, "decode_buckets": batches,
             **{k: v for k, v in variant.items() if k != "kv_cache"}, "kv_cache": kv}
    return TTSEngine(AudioGenerationConfig.load(
        env={}, audio_flags=[f"max_batch_size={largest}", f"sampling.max_tokens={limit}",
                             f"sampling.max_tokens_limit={limit}"], model=model))


def bench_contexts(engine, count: int, length: int, name: str) -> list:
    """``count`` seeded sampling requests that never stop before ``length`` speech tokens."""
    return [engine.create_context("The benchmark speaks this sentence to fill its context.",
                                  request_id=f"{name}-{count}-{i}", temperature=0.8, top_p=0.95, seed=i,
                                  min_tokens=length, max_tokens=length) for i in range(count)]


def start_requests(engine, count: int, length: int):
    """A scheduler of ``count`` requests that never stop before ``length`` speech tokens, each
    prefilled; it runs beside the engine's own (not started) scheduler on the same KV blocks."""
    from audio_pipeline.core.scheduler import AudioGenerationScheduler

    scheduler = AudioGenerationScheduler(
        dataclasses.replace(engine.scheduler.config, max_batch_size=count, max_queue_size=count,
                            enable_in_flight_batching=False, max_num_steps=1),
        engine.scheduler.block_manager)
    contexts = bench_contexts(engine, count, length, "bench")
    for context in contexts:
        scheduler.add(context)
    return scheduler, contexts


def run_steps(scheduler, runner, count: int, *, ahead: bool, host: dict | None = None) -> float:
    """Runs ``count`` steps; seconds from the first schedule to the last result applied. ``host``
    gathers the seconds of the scheduler (``schedule``) and of the updates (``update``; reading a
    result, which waits for the device, is not in it)."""
    host = {} if host is None else host
    clock = time.perf_counter
    started = clock()
    pending = []

    def apply() -> None:
        done, launched = pending.pop(0)
        result = launched.result()
        t = clock()
        scheduler.update(done, result)
        host["update"] = host.get("update", 0.0) + clock() - t

    for _ in range(count):
        t = clock()
        output = scheduler.schedule()
        host["schedule"] = host.get("schedule", 0.0) + clock() - t
        pending.append((output, runner.launch(output.items)))
        if not ahead or len(pending) > 1:
            apply()
    while pending:
        apply()
    return clock() - started


def decode_to(scheduler, runner, contexts, context: int) -> None:
    """Steps (ahead) until every request's prompt is in and its context holds ``context`` tokens
    (prompt and speech)."""
    run_steps(scheduler, runner, 4, ahead=True)
    while min(c.total_length for c in contexts) < context or not all(c.generated for c in contexts):
        run_steps(scheduler, runner, 8, ahead=True)


def time_batch(engine, batch: int, context: int, steps: int, profile=None) -> StepTimes:
    runner = engine.core.runner
    scheduler, contexts = start_requests(engine, batch, context + 4 * steps + 32)
    try:
        decode_to(scheduler, runner, contexts, context)
        sync = run_steps(scheduler, runner, steps, ahead=False) / steps
        host: dict[str, float] = {}
        runner.timer.flush()
        ahead = run_steps(scheduler, runner, steps, ahead=True, host=host) / steps
        inputs = runner.timer.flush()["inputs"]
        if profile is not None:
            profile(lambda: run_steps(scheduler, runner, 5, ahead=True))
        return StepTimes(batch, 1000 * sync, 1000 * ahead,
                         tuple(1000 * seconds / steps for seconds in (host["schedule"], inputs, host["update"])))
    finally:
        for c in contexts:
            scheduler.remove(c.request_id)
            runner.release(c.request_id)


@dataclass
class LoopTimes:
    batch: int
    #: Wall ms a forward pass of the engine's own loop (its rounds over their passes).
    wall_ms: float
    #: Each phase's ms a pass (PHASES), from the engine's own metrics.
    phases: dict[str, float]

    @property
    def step_ms(self) -> float:
        """The step's share: scheduling, inputs, model, sampling and the update."""
        return sum(self.phases[name] for name in ("schedule", "inputs", "model", "sample", "update"))

    @property
    def beyond_ms(self) -> float:
        """The round's host time beyond the step and the audio's decoding (first-token notes, the
        deadlines and load metrics, finding due decoder windows, delivery, collecting results)."""
        return self.wall_ms - self.step_ms - self.phases["decode"]


def time_loop(engine, batch: int, context: int, steps: int) -> LoopTimes:
    """``batch`` requests through the engine's own loop (EngineCore's rounds on its thread, as a
    server runs them), timed over ``steps`` forward passes once every request holds ``context`` tokens."""
    import threading

    from audio_pipeline.bench.serve import PHASES

    core = engine.core
    registry = core.metrics.registry
    passes = threading.Semaphore(0)
    core.on_step = lambda _core: passes.release()
    length = context + 4 * steps + 32
    contexts = bench_contexts(engine, batch, length, "loop")

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    def totals() -> tuple[float, float, dict[str, float]]:  # (now, forward passes, phase seconds)
        forwards = sum(value("tts_forward_passes_total", kind=kind) for kind in ("ce", "tg", "mixed"))
        return time.perf_counter(), forwards, {p: value("tts_step_phase_seconds_total", phase=p) for p in PHASES}

    core.start()  # once per engine: it runs until the variant's engine stops
    try:
        for request in contexts:
            core.submit(request, lambda event: None)
        while min(c.total_length for c in contexts) < context or not all(c.generated for c in contexts):
            passes.acquire(timeout=60)
        before = totals()
        while totals()[1] - before[1] < steps:
            passes.acquire(timeout=60)
        after = totals()
    finally:
        for request in contexts:
            core.cancel(request.request_id)
        while not core.idle:
            passes.acquire(timeout=0.05)
        core.on_step = None
    forwards = after[1] - before[1]
    return LoopTimes(batch, 1000 * (after[0] - before[0]) / forwards,
                     {p: 1000 * (after[2][p] - before[2][p]) / forwards for p in PHASES})


def profile_steps(run, trace: str | None) -> list[str]:
    """Profiles ``run`` (5 decode steps) and describes the middle step's device timeline."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("steps"):
            run()
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and e.time_range.elapsed_us() > 0
              and (cuda or e.name.startswith("aten::"))]
    if not events:
        return ["profile: no device events recorded"]
    events.sort(key=lambda e: e.time_range.start)
    start, end = events[0].time_range.start, max(e.time_range.end for e in events)
    # The middle fifth of the span: about one step of five.
    span = end - start
    lo, hi = start + 2 * span / 5, start + 3 * span / 5
    window = [e for e in events if lo <= e.time_range.start < hi]
    busy, gaps, cursor = 0.0, [], None
    for e in window:
        s, t = e.time_range.start, e.time_range.end
        if cursor is None or s > cursor:
            if cursor is not None:
                gaps.append(s - cursor)
            busy += t - s
            cursor = t
        elif t > cursor:
            busy += t - cursor
            cursor = t
    totals: dict[str, list[float]] = {}
    for e in window:
        totals.setdefault(e.name, []).append(e.time_range.elapsed_us())
    top = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:12]
    lines = [f"profile (middle fifth of 5 steps, {span / 5 / 1000:.3f} ms): device busy {busy / 1000:.3f} ms, "
             f"{len(gaps)} gaps totalling {sum(gaps) / 1000:.3f} ms (largest {max(gaps, default=0) / 1000:.3f} ms), "
             f"{len(window)} device events",
             f"{'kernel':<80} {'calls':>6} {'total ms':>9} {'share':>6}"]
    for name, times in top:
        lines.append(f"{name[:80]:<80} {len(times):>6} {sum(times) / 1000:>9.3f} {sum(times) / max(busy, 1e-9):>6.1%}")
    return lines


def host_share_line(variant: str, totals: dict[int, float]) -> str:
    """The host's share of a step (scheduler + inputs + update) at the largest batch, and what each
    row beyond the smallest batch adds."""
    largest = max(totals)
    line = f"# {variant}: host share {totals[largest]:.2f} ms a step at {largest} rows"
    smallest = min(totals)
    if largest > smallest:
        extra = 1000 * (totals[largest] - totals[smallest]) / (largest - smallest)
        line += f", {extra:.1f} us an extra row ({smallest} -> {largest})"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.decode_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-model", metavar="SHAPE", default="orpheus-3b",
                        help="a randomly initialised model of this shape (orpheus-3b, orpheus-tiny)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,64,128,256", help="comma-separated batch sizes (the decode buckets)")
    parser.add_argument("--context", type=int, default=300, help="KV tokens each request holds when timing starts")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch and mode")
    parser.add_argument("--variants", default="graphs,eager,fp8", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--engine-loop", action="store_true",
                        help="also run each batch through the engine's own loop (EngineCore's rounds, as served) "
                             "and print its wall time a pass, the step's share and the host time beyond it")
    parser.add_argument("--profile", type=int, metavar="B", help="profile decode steps at batch B (every variant)")
    parser.add_argument("--trace", metavar="PATH", help="with --profile, write the first variant's Chrome trace here")
    args = parser.parse_args(argv)
    batches = sorted({int(b) for b in args.batches.split(",")})
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")

    from audio_pipeline.bench.serve import PassCost, read_bandwidth
    from audio_pipeline.testing.random_models import RANDOM_SHAPES, write_random_model

    model_dir = tempfile.mkdtemp(prefix=f"random-{args.random_model}-")
    try:
        write_random_model(model_dir, args.random_model)
        bandwidth = read_bandwidth(args.device)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        print(f"device {name}; read bandwidth {bandwidth / 1e9:.0f} GB/s (float32 sum over 512 MiB, best of 5); "
              f"context {args.context} tokens; {args.steps} steps per measurement", flush=True)
        config = RANDOM_SHAPES[args.random_model]
        print(f"{'variant':<8} {'B':>5} {'sync ms':>8} {'ahead ms':>9} {'floor ms':>9} {'x floor':>8} "
              f"{'GB/s':>7} {'tok/s':>8}  host: {'sched':>6} {'inputs':>6} {'update':>6}", flush=True)
        loops: list[tuple[str, LoopTimes]] = []
        for index, variant in enumerate(variants):
            started = time.perf_counter()
            engine = build_engine(model_dir, args.device, batches, args.context, args.steps, VARIANTS[variant])
            print(f"# {variant}: engine built in {time.perf_counter() - started:.1f} s (KV cache "
                  f"{str(engine.model.cache_dtype).removeprefix('torch.')}, attention {engine.kv_cache.backend.name}, "
                  f"graphs {'on' if engine.core.runner.graphs is not None else 'off'})", flush=True)
            cost = PassCost.of(config, str(engine.model.dtype).removeprefix("torch."),
                               str(engine.model.cache_dtype).removeprefix("torch."))
            host_totals: dict[int, float] = {}
            try:
                for batch in batches:
                    profile = None
                    if args.profile == batch:
                        trace = args.trace if index == 0 else None
                        profile = lambda run: print(f"# {variant}: " + "\n".join(profile_steps(run, trace)),  # noqa: E731
                                                    flush=True)
                    t = time_batch(engine, batch, args.context, args.steps, profile)
                    floor = cost.floor_ms(batch, args.context, bandwidth)
                    best = min(t.sync_ms, t.ahead_ms)
                    print(f"{variant:<8} {batch:>5} {t.sync_ms:>8.2f} {t.ahead_ms:>9.2f} {floor:>9.3f} "
                          f"{best / floor:>7.2f}x {cost.bytes(batch, args.context) / best / 1e6:>7.0f} "
                          f"{1000 * batch / best:>8.0f}        {t.host_ms[0]:>6.2f} {t.host_ms[1]:>6.2f} "
                          f"{t.host_ms[2]:>6.2f}", flush=True)
                    host_totals[batch] = sum(t.host_ms)
                    if args.engine_loop:
                        loops.append((variant, time_loop(engine, batch, args.context, args.steps)))
                print(host_share_line(variant, host_totals), flush=True)
            finally:
                engine.stop()
                del engine
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        if loops:
            from audio_pipeline.bench.serve import PHASES

            print(f"engine loop: {'variant':<8} {'B':>5} {'wall ms':>8} {'step ms':>8} {'beyond':>7}  "
                  + " ".join(f"{phase[:6]:>6}" for phase in PHASES), flush=True)
            for variant, loop in loops:
                print(f"engine loop: {variant:<8} {loop.batch:>5} {loop.wall_ms:>8.2f} {loop.step_ms:>8.2f} "
                      f"{loop.beyond_ms:>7.2f}  " + " ".join(f"{loop.phases[p]:>6.2f}" for p in PHASES), flush=True)
            print("engine loop: ms a forward pass of the engine's own rounds (its thread, its settings: multi-step "
                  "decoding, deadlines, the audio decoder); step = schedule + inputs + model + sample + update; "
                  "beyond = wall - step - decode (first-token notes, deadlines and load metrics, finding due "
                  "decoder windows, delivery)", flush=True)
        print("sync: one step after the other (schedule, launch, read, update); ahead: the next step launched "
              "before this one is read (the engine's overlap); floor = (linear weights + B x context x KV bytes "
              "per token) / read bandwidth; GB/s and tok/s at the better of the two; host: ms per step of the ahead run "
              "in the scheduler, staging the inputs (the runner's inputs phase) and the update", flush=True)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Paged attention by backend and page size, or by cache dtype against the memory's read bandwidth.

    python -m audio_pipeline.bench.attention [--device cpu|cuda] [--shape slt-en|orpheus-3b]
                                             [--batches 1,16,64] [--context 500] [--page-sizes 16,32,64,128]
    python -m audio_pipeline.bench.attention --cache-dtypes float32,bfloat16,float16 [--batches 1,16,32]
                                             [--context 400] [--page-sizes 128] [--rounds 5]

For each attention backend that runs on the device, each page size and each batch, it times a
decode step's attention (the step's metadata built on the host and planned, then every layer's
attention over its own cache, whose pages are scattered), and prints milliseconds per step: what
model.kv_cache.kv_cache_page_size should be on a device. Shapes: the built-in voice's (4 layers, 4
heads of 48) and Orpheus-3B's (28 layers, 24 query and 8 kv heads of 128).

With ``--cache-dtypes`` it instead times the backend ``auto`` picks for each cache dtype (on CPU the
native kernel, which widens a 16-bit cache to float32 as it loads it) at the first page size, the
dtypes alternating over ``--rounds`` rounds, and prints per dtype and batch the median
milliseconds per step (and the fastest and slowest round), the keys and values the step reads, the
rate it reads them at, and that time over a read-bandwidth floor: the same bytes at the rate one
read-only pass over a buffer larger than the caches (a sum, on one thread on CPU) achieves, measured
in each round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from audio_pipeline_kernels import BACKENDS, StepMetadata, allocate_paged_cache, select_attention_backend

#: (layers, query heads, kv heads, head size) of the shapes it knows.
SHAPES = {"slt-en": (4, 4, 4, 48), "orpheus-3b": (28, 24, 8, 128)}

#: --cache-dtypes names.
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step(backend_name: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
                batch: int, context: int, page_size: int, cache_dtype: torch.dtype | None = None
                ) -> tuple[str, Callable[[], None]] | None:
    """The backend's name and one decode step's attention (plan + every layer, each over its own
    cache), or None where the backend cannot run here."""
    layers, heads, kv_heads, head_dim = shape
    cache_dtype = cache_dtype or dtype
    try:
        backend = select_attention_backend(backend_name, device, dtype, num_heads=heads, num_kv_heads=kv_heads,
                                           head_dim=head_dim, page_size=page_size, cache_dtype=cache_dtype)
    except ValueError:
        return None
    pages_each = -(-context // page_size)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * pages_each, generator=generator).tolist()  # scattered pages
    tables = [order[b * pages_each:(b + 1) * pages_each] for b in range(batch)]
    # A cache per layer, as in the model: together they outgrow the CPU's last-level cache as a
    # real batch's do, where one layer's alone may not.
    keys, values = allocate_paged_cache(layers, batch * pages_each, page_size, kv_heads, head_dim, cache_dtype,
                                        device)
    for cache in keys + values:
        cache.copy_(torch.randn(cache.shape, device=device))
    query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)

    def run() -> None:
        plan = backend.plan(StepMetadata.build(tables, [context - 1] * batch, [1] * batch, page_size))
        for layer in range(layers):
            plan.attend(query, keys[layer], values[layer])

    return backend.name, run


def _clock(device: torch.device) -> Callable[[], float]:
    """On CPU this thread's CPU time (the benchmark runs on one thread; on a shared machine the time
    it waits for a core is not the kernel's, while its waits for memory are counted); on CUDA the
    wall clock around synchronized work."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


def time_ms(run: Callable[[], None], device: torch.device, repeats: int = 20) -> float:
    """Milliseconds per call of ``run``, after three warm-up calls."""
    clock = _clock(device)
    for _ in range(3):
        run()
    _sync(device)
    started = clock()
    for _ in range(repeats):
        run()
    _sync(device)
    return 1000 * (clock() - started) / repeats


def step_ms(backend_name: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
            batch: int, context: int, page_size: int, repeats: int = 20) -> float | None:
    """Milliseconds of one decode step's attention, or None where the backend cannot run here."""
    step = decode_step(backend_name, device, dtype, shape, batch, context, page_size)
    return None if step is None else time_ms(step[1], device, repeats)


def read_bandwidth(device: torch.device, size: int, repeats: int = 5) -> float:
    """Bytes per second a read-only pass (a sum) over a ``size``-byte float32 buffer reads."""
    buffer = torch.ones(size // 4, device=device)
    clock = _clock(device)
    buffer.sum()
    _sync(device)
    started = clock()
    for _ in range(repeats):
        buffer.sum()
    _sync(device)
    return size * repeats / (clock() - started)


def compare_cache_dtypes(names: list[str], device: torch.device, dtype: torch.dtype,
                         shape: tuple[int, int, int, int], batches: list[int], context: int, page_size: int,
                         rounds: int) -> None:
    """Prints each cache dtype's decode attention per batch against the read-bandwidth floor."""
    layers, _, kv_heads, head_dim = shape
    steps, kv_bytes = {}, {}
    for name in names:
        cache_dtype = CACHE_DTYPES[name]
        for batch in batches:
            step = decode_step("auto", device, dtype, shape, batch, context, page_size, cache_dtype)
            if step is not None:
                steps[name, batch] = step
                kv_bytes[name, batch] = 2 * layers * batch * context * kv_heads * head_dim * cache_dtype.itemsize
    floor_size = max(1 << 28, 4 * max(kv_bytes.values()))
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    bandwidths = []
    for _ in range(rounds):  # every dtype and batch once per round, so the machine's drift hits all alike
        bandwidths.append(read_bandwidth(device, floor_size))
        for key, (_, run) in steps.items():
            times[key].append(time_ms(run, device))
    bandwidth = statistics.median(bandwidths)
    print(f"decode attention per step by cache dtype ({device}, {dtype} queries, layers/heads/kv heads/head size "
          f"{shape}, context {context}, page {page_size}; medians of {rounds} rounds, dtypes alternating)")
    print(f"read-bandwidth floor: {bandwidth / 1e9:.1f} GB/s (a sum over {floor_size >> 20} MB; rounds "
          f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f})")
    print(f"{'cache':>9} {'backend':>8} {'batch':>5} {'KV MB':>7} {'ms/step':>8} {'(min-max)':>13} {'GB/s':>6} "
          f"{'x floor':>7}")
    for (name, batch), (backend, _) in steps.items():
        ms = statistics.median(times[name, batch])
        moved = kv_bytes[name, batch]
        floor_ms = 1000 * moved / bandwidth
        spread = f"({min(times[name, batch]):.3f}-{max(times[name, batch]):.3f})"
        print(f"{name:>9} {backend:>8} {batch:>5} {moved / 1e6:>7.2f} {ms:>8.3f} {spread:>13} "
              f"{moved / ms / 1e6:>6.1f} {ms / floor_ms:>7.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: orpheus-3b on CUDA, slt-en on CPU)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default: 1,16,64; CUDA 1,64,256)")
    parser.add_argument("--context", type=int, default=500, help="tokens each sequence holds (default 500)")
    parser.add_argument("--page-sizes", default="16,32,64,128")
    parser.add_argument("--cache-dtypes", default=None,
                        help=f"compare these cache dtypes ({', '.join(CACHE_DTYPES)}) at the first page size")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the cache dtype comparison (default 5)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = SHAPES[args.shape or ("orpheus-3b" if cuda else "slt-en")]
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in (args.batches or ("1,64,256" if cuda else "1,16,64")).split(",")]
    pages = [int(p) for p in args.page_sizes.split(",")]
    if not cuda:
        torch.set_num_threads(1)  # as the engine runs on CPU (model.num_threads)
    if args.cache_dtypes:
        names = args.cache_dtypes.split(",")
        unknown = set(names) - set(CACHE_DTYPES)
        if unknown:
            parser.error(f"--cache-dtypes: {', '.join(sorted(unknown))} not among {', '.join(CACHE_DTYPES)}")
        compare_cache_dtypes(names, device, dtype, shape, batches, args.context, pages[0], args.rounds)
        return 0
    print(f"decode attention per step, ms ({args.device}, {dtype}, layers/heads/kv heads/head size {shape}, "
          f"context {args.context})")
    print(f"{'backend':>10} {'page':>5} " + " ".join(f"{'batch ' + str(b):>10}" for b in batches))
    for name in BACKENDS[1:]:
        for page in pages:
            times = [step_ms(name, device, dtype, shape, b, args.context, page) for b in batches]
            if times[0] is None:
                break
            print(f"{name:>10} {page:>5} " + " ".join(f"{t:>10.3f}" for t in times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Paged attention by backend and page size: what model.kv_cache.kv_cache_page_size should be on a device.

    python -m audio_pipeline.bench.attention [--device cpu|cuda] [--shape slt-en|orpheus-3b]
                                             [--batches 1,16,64] [--context 500] [--page-sizes 16,32,64,128]

For each attention backend that runs on the device, each page size and each batch, it times a
decode step's attention (the step's metadata built on the host and planned, then every layer's
attention over a cache whose pages are scattered), and prints milliseconds per step. Shapes:
the built-in voice's (4 layers, 4 heads of 48) and Orpheus-3B's (28 layers, 24 query and 8 kv
heads of 128).
"""

from __future__ import annotations

import argparse
import time

import torch

from audio_pipeline_kernels import BACKENDS, StepMetadata, allocate_paged_cache, select_attention_backend

#: (layers, query heads, kv heads, head size) of the shapes it knows.
SHAPES = {"slt-en": (4, 4, 4, 48), "orpheus-3b": (28, 24, 8, 128)}


def step_ms(backend_name: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
            batch: int, context: int, page_size: int, repeats: int = 20) -> float | None:
    """Milliseconds of one decode step's attention (plan + every layer), or None where the backend
    cannot run here."""
    layers, heads, kv_heads, head_dim = shape
    try:
        backend = select_attention_backend(backend_name, device, dtype, num_heads=heads, num_kv_heads=kv_heads,
                                           head_dim=head_dim, page_size=page_size)
    except ValueError:
        return None
    pages_each = -(-context // page_size)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * pages_each, generator=generator).tolist()  # scattered pages
    tables = [order[b * pages_each:(b + 1) * pages_each] for b in range(batch)]
    keys, values = allocate_paged_cache(1, batch * pages_each, page_size, kv_heads, head_dim, dtype, device)
    keys[0].normal_()
    values[0].normal_()
    query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)

    def run() -> None:
        plan = backend.plan(StepMetadata.build(tables, [context - 1] * batch, [1] * batch, page_size))
        for _ in range(layers):
            plan.attend(query, keys[0], values[0])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        run()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    sync()
    return 1000 * (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: orpheus-3b on CUDA, slt-en on CPU)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default: 1,16,64; CUDA 1,64,256)")
    parser.add_argument("--context", type=int, default=500, help="tokens each sequence holds (default 500)")
    parser.add_argument("--page-sizes", default="16,32,64,128")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = SHAPES[args.shape or ("orpheus-3b" if cuda else "slt-en")]
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in (args.batches or ("1,64,256" if cuda else "1,16,64")).split(",")]
    pages = [int(p) for p in args.page_sizes.split(",")]
    if not cuda:
        torch.set_num_threads(1)  # as the engine runs on CPU (model.num_threads)
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

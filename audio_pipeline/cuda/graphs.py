"""A function over fixed input buffers captured as a CUDA graph, and the batch buckets such calls
come in: what the engine's four captured calls share (the decode forward, core/decode_graphs.py;
the depth decoder's frame, core/depth_graphs.py; the token sampling, core/sample_graphs.py;
SNAC's decode, decoders/snac_graphs.py).

A graph replays the kernels it recorded on the memory it recorded them on, so a captured call owns
fixed inputs: a step copies its values into the first rows of the smallest bucket that holds them,
replays, and reads the first rows of the output the capture returned (valid until the next replay;
the padding rows keep what an earlier step left there, valid numbers the rows never mix with).

Before each capture the function runs on a side stream (``warmups`` times): lazy initialisation,
cuBLAS workspaces and kernel choices never happen inside a capture, as torch asks. A capture's
errors are checked per thread (``thread_local``): work another thread queues meanwhile (the decoder
thread's kernels, a voice being encoded) is no capture error. The calls of one owner share one
memory pool; their replays never overlap (one thread replays them, or a lock orders them).

``capture=False`` runs the same function on the same buffers at every call: on a CPU nothing can be
captured, and the tests check each owner's plumbing there.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

Output = TypeVar("Output")


class Buckets:
    """The batch sizes a call is captured at, smallest first; a call of n rows takes the smallest
    that holds n."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = sorted({int(size) for size in sizes})
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"batch buckets must be positive, got {list(sizes)}")

    def fit(self, count: int) -> int | None:
        """The smallest bucket of at least ``count`` rows; None past the largest."""
        index = bisect.bisect_left(self.sizes, count)
        return self.sizes[index] if index < len(self.sizes) else None

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __str__(self) -> str:
        return ",".join(map(str, self.sizes))


class CapturedCall(Generic[Output]):
    """``fn`` (no arguments: it reads its owner's fixed buffers) as one CUDA graph, or run as it is
    where ``graph`` is None. Calling it replays and returns the output."""

    __slots__ = ("fn", "graph", "output", "pool")

    def __init__(self, pool: "GraphPool", fn: Callable[[], Output], graph: Any, output: Output | None):
        self.pool, self.fn, self.graph, self.output = pool, fn, graph, output

    def __call__(self) -> Output:
        self.pool.replays += 1
        if self.graph is None:
            with torch.inference_mode():
                return self.fn()
        self.graph.replay()
        return self.output


class GraphPool:
    """Captures calls on ``device`` into one memory pool (or, with ``capture`` false, keeps them
    eager); counts their replays (the tests check the graphs are used) and the seconds spent
    capturing."""

    def __init__(self, device: torch.device | str, *, capture: bool = True):
        self.device = torch.device(device)
        self.capture = capture
        self.handle = torch.cuda.graph_pool_handle() if capture else None
        #: Replays (or, without capture, calls) of every call of this pool so far.
        self.replays = 0
        #: Seconds spent in warm-ups and captures, in all.
        self.seconds = 0.0

    def call(self, fn: Callable[[], Output], *, warmups: int = 1) -> CapturedCall[Output]:
        """``fn`` captured now (after ``warmups`` runs on a side stream), or kept eager."""
        if not self.capture:
            return CapturedCall(self, fn, None, None)
        started = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(warmups):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.handle, capture_error_mode="thread_local"), torch.inference_mode():
            output = fn()
        self.seconds += time.perf_counter() - started
        return CapturedCall(self, fn, graph, output)

    def synchronize(self) -> None:
        """Waits for the captures' work (the device's, after a run of captures)."""
        if self.capture:
            torch.cuda.synchronize(self.device)

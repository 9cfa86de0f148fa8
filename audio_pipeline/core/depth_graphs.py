"""A depth decoder's frame captured as CUDA graphs, one per batch bucket and sampling rule.

A frame model samples each position's other codes with a small transformer after the backbone's
(core/depth.py): Qwen3-TTS's code predictor is 15 passes of a five-layer model, each followed by a
draw, so an eager frame launches a few thousand kernels from Python, far more than the backbone's
step (60 ms a frame at one stream on an H200, against 20 ms for the whole eager talker step).
Replayed from a graph they are one call.

Each bucket owns fixed inputs (the backbone's states and first codes, the rows' depth sampling
settings and draws) and two graphs over them, one per sampling rule the sampler may take without
reading the device: the prefix rule (every sampled row's top_k within NUCLEUS_PREFIX) and the whole
row. Greedy rows take the argmax in either (the sampler keeps it for temperature 0), so an all-greedy
batch replays the prefix graph. Penalties never act on the depth codes. A step of n rows copies its
inputs into the first n rows of the smallest bucket that holds them; the padding rows keep what an
earlier step left there (valid numbers: the rows never mix) and their outputs are dropped.

The graphs share one memory pool (their own: the decode graphs' outputs are never overwritten) and
are captured at start-up, largest first, after one warm-up run each on a side stream.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from audio_pipeline.core.sampler import FLOAT_FIELDS, SamplingRows

logger = logging.getLogger(__name__)

#: The depth sampling inputs a step stages (core/depth.py), copied into a bucket before a replay.
ROW_INPUTS = ("depth_starts", "depth_extra", "depth_blocked", "depth_top_k")


def _rule(codebook: int, prefix: bool) -> SamplingRows:
    """Flags that select a sampling rule (what sample_rows reads of the host rows): every row may
    sample, no penalties, and the prefix rule or the whole row."""
    empty = np.zeros(0, dtype=np.int64)
    return SamplingRows(codebook, empty, empty, empty, empty, empty, empty, any_sampling=True, penalized=False,
                        prefix_suffices=prefix, prefix_may_suffice=prefix)


class DepthFrames(Protocol):
    """What the graphs capture of the depth decoder's sampling (core/depth.py's DepthSampling):
    its codes per frame and one frame of a batch."""

    codes: int

    def frames(self, states: torch.Tensor, codes: torch.Tensor, inputs: dict[str, torch.Tensor],
               rows: SamplingRows) -> torch.Tensor: ...


class DepthGraphs:
    """Captured frames of ``sampling``'s depth decoder for each size in ``buckets``."""

    def __init__(self, sampling: DepthFrames, buckets: Sequence[int], *, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, codebook: int):
        self.codebook = codebook
        self.sizes = sorted(set(buckets))
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}
        #: Replays so far (the tests check the graphs are used).
        self.replays = 0
        depth = sampling.codes - 1
        pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        for size in reversed(self.sizes):
            floats = torch.zeros(depth, len(FLOAT_FIELDS), size, dtype=torch.float32, device=device)
            for name, value in (("temperature", 1.0), ("top_p", 1.0), ("repetition_penalty", 1.0), ("uniform", 0.5)):
                floats[:, FLOAT_FIELDS.index(name)] = value
            blocked = torch.zeros(size, codebook + 1, dtype=torch.bool, device=device)
            blocked[:, codebook] = True  # the one (unused) extra column, as DepthSampling.stage blocks it
            inputs = {"states": torch.zeros(size, hidden_size, dtype=dtype, device=device),
                      "codes": torch.zeros(size, dtype=torch.long, device=device),
                      "depth_starts": torch.zeros(size, dtype=torch.long, device=device),
                      "depth_extra": torch.zeros(size, 1, dtype=torch.long, device=device),
                      "depth_blocked": blocked, "depth_floats": floats,
                      "depth_top_k": torch.full((size,), codebook + 1, dtype=torch.long, device=device)}
            self._inputs[size] = inputs
            for prefix in (True, False):
                rule = _rule(codebook, prefix)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.inference_mode():
                    sampling.frames(inputs["states"], inputs["codes"], inputs, rule)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: work another thread queues meanwhile is no capture error.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), torch.inference_mode():
                    frames = sampling.frames(inputs["states"], inputs["codes"], inputs, rule)
                self._graphs[size, prefix] = (graph, frames)
        torch.cuda.synchronize(device)
        logger.info("CUDA graphs: the depth decoder's frame at %d buckets (%s), two sampling rules each, captured "
                    "in %.1f s", len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - started)

    def bucket_inputs(self, count: int) -> dict[str, torch.Tensor]:
        """The fixed inputs of the bucket a step of ``count`` rows replays (the tests run the eager
        frame on them)."""
        return self._inputs[self.sizes[bisect.bisect_left(self.sizes, count)]]

    def run(self, states: torch.Tensor, codes: torch.Tensor, device: dict[str, torch.Tensor],
            rows: SamplingRows) -> torch.Tensor | None:
        """The [n, codes] frames of ``states`` ([n, hidden]) and their first ``codes`` ([n]), with
        the depth sampling inputs a step staged in ``device`` and chosen by ``rows``; None where no
        graph fits (more rows than the largest bucket, penalties, another codebook): the caller
        runs the frame eagerly."""
        count = states.shape[0]
        index = bisect.bisect_left(self.sizes, count)
        if index == len(self.sizes) or rows.penalized or rows.codebook_size != self.codebook:
            return None
        size = self.sizes[index]
        inputs = self._inputs[size]
        inputs["states"][:count].copy_(states)
        inputs["codes"][:count].copy_(codes)
        for name in ROW_INPUTS:
            inputs[name][:count].copy_(device[name])
        inputs["depth_floats"][:, :, :count].copy_(device["depth_floats"])
        graph, frames = self._graphs[size, rows.prefix_suffices or not rows.any_sampling]
        graph.replay()
        self.replays += 1
        return frames[:count]

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
are captured at start-up, largest first (cuda/graphs.py: the capture). ``capture=False`` runs the
same frames on the same buffers (the tests check the plumbing on a CPU).
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import numpy as np
import torch

from audio_pipeline.core.sampler import FLOAT_FIELDS, SamplingRows
from audio_pipeline.cuda.graphs import Buckets, CapturedCall, GraphPool

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
                 device: torch.device, codebook: int, capture: bool = True):
        self.codebook = codebook
        self.buckets = Buckets(buckets)
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._calls: dict[tuple[int, bool], CapturedCall[torch.Tensor]] = {}
        depth = sampling.codes - 1
        self.pool = GraphPool(device, capture=capture)
        for size in reversed(self.buckets.sizes):
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
                self._calls[size, prefix] = self.pool.call(
                    lambda inputs=inputs, rule=rule: sampling.frames(inputs["states"], inputs["codes"], inputs, rule))
        self.pool.synchronize()
        if capture:
            logger.info("CUDA graphs: the depth decoder's frame at %d buckets (%s), two sampling rules each, "
                        "captured in %.1f s", len(self.buckets), self.buckets, self.pool.seconds)

    @property
    def replays(self) -> int:
        """Replays so far (the tests check the graphs are used)."""
        return self.pool.replays

    def bucket_inputs(self, count: int) -> dict[str, torch.Tensor]:
        """The fixed inputs of the bucket a step of ``count`` rows replays (the tests run the eager
        frame on them)."""
        return self._inputs[self.buckets.fit(count)]

    def run(self, states: torch.Tensor, codes: torch.Tensor, device: dict[str, torch.Tensor],
            rows: SamplingRows) -> torch.Tensor | None:
        """The [n, codes] frames of ``states`` ([n, hidden]) and their first ``codes`` ([n]), with
        the depth sampling inputs a step staged in ``device`` and chosen by ``rows``; None where no
        graph fits (more rows than the largest bucket, penalties, another codebook): the caller
        runs the frame eagerly."""
        count = states.shape[0]
        size = self.buckets.fit(count)
        if size is None or rows.penalized or rows.codebook_size != self.codebook:
            return None
        inputs = self._inputs[size]
        inputs["states"][:count].copy_(states)
        inputs["codes"][:count].copy_(codes)
        for name in ROW_INPUTS:
            inputs[name][:count].copy_(device[name])
        inputs["depth_floats"][:, :, :count].copy_(device["depth_floats"])
        return self._calls[size, rows.prefix_suffices or not rows.any_sampling]()[:count]

"""Decode forward passes captured as CUDA graphs, one per batch bucket (CUDA with FlashInfer only).

An eager decode step of a 3B model launches about 1,500 kernels from Python; replaying a captured
graph launches them in one call. Each bucket owns fixed input buffers (token ids, positions, cache
slots, and the model's other per-position inputs: a frame model's frames, a text track's ids), a
FlashInfer decode wrapper in CUDA-graph mode (fixed page-list buffers that its ``plan`` refills
outside the graph) and the graph's output. A step copies its staged inputs into the bucket's
buffers (device to device), plans, and replays.

The graphs share one memory pool and are captured largest first (cuda/graphs.py: the capture, after
two warm-ups on a side stream); during capture the rows compute a dummy token in the cache's
scratch page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from audio_pipeline_kernels import StepMetadata, write_paged_kv

from audio_pipeline.cuda.graphs import Buckets, CapturedCall, GraphPool

if TYPE_CHECKING:
    from audio_pipeline.models.llama_model import LlamaPipelineModel
    from audio_pipeline.core.kv_cache.paged import PagedKVCacheManager

logger = logging.getLogger(__name__)


class _GraphAttention:
    """The attention view a captured forward reads: a fixed slot buffer and a graph-mode wrapper."""

    def __init__(self, cache, slots: torch.Tensor, wrapper):
        self.cache, self.slots, self.wrapper = cache, slots, wrapper

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.cache.keys[layer], self.cache.values[layer]
        write_paged_kv(key_cache, value_cache, keys, values, self.slots)
        return self.wrapper.run(query, (key_cache, value_cache))


@dataclass
class _Bucket:
    call: CapturedCall[torch.Tensor]
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    wrapper: Any
    #: The forward pass's other inputs by keyword (a frame model's frames, a text track's ids).
    inputs: dict[str, torch.Tensor]
    #: Recorded after the last plan's copies: the wrapper's pinned buffers are free again once it passed.
    planned: Any = None


class DecodeGraphs:
    """Captured decode forwards of ``model`` over the cache ``kv`` for each size in ``buckets``; ``inputs`` names the
    forward pass's other per-position inputs (keyword -> (shape after the position, dtype, the value
    of a position without one))."""

    def __init__(self, model: "LlamaPipelineModel", kv: "PagedKVCacheManager", buckets: Sequence[int],
                 inputs: dict[str, tuple[tuple[int, ...], torch.dtype, int]] | None = None):
        import flashinfer

        backend = kv.backend
        if backend.name != "flashinfer":
            raise ValueError("model.cuda_graphs needs model.kv_cache.attention_kernel flashinfer (the torch form's "
                             "shapes change with every step); set model.cuda_graphs=false")
        self.backend = backend
        device = kv.device
        scratch = kv.cache.scratch_block
        pages_per_sequence = -(-model.max_seq_len // kv.page_size)
        self.buckets = Buckets(buckets)
        self.pool = GraphPool(device)
        self._buckets: dict[int, _Bucket] = {}
        for size in reversed(self.buckets.sizes):
            tokens = torch.zeros(size, dtype=torch.long, device=device)
            positions = torch.zeros(size, dtype=torch.long, device=device)
            slots = torch.full((size,), scratch * kv.page_size, dtype=torch.long, device=device)
            extra = {name: torch.full((size, *shape), fill, dtype=dtype, device=device)
                     for name, (shape, dtype, fill) in (inputs or {}).items()}
            # Page lists of a full bucket: a page shared through the prefix cache counts once per row.
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=backend.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(size * pages_per_sequence, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device))
            self._plan(wrapper, StepMetadata.build([[scratch]] * size, [0] * size, [1] * size, kv.page_size))
            attention = _GraphAttention(kv.cache, slots, wrapper)
            call = self.pool.call(lambda tokens=tokens, positions=positions, attention=attention, extra=extra:
                                  model.forward(tokens, positions, attention, **extra), warmups=2)
            self._buckets[size] = _Bucket(call, tokens, positions, slots, wrapper, extra)
        self.pool.synchronize()
        logger.info("CUDA graphs: %d decode buckets (%s) captured in %.1f s", len(self.buckets), self.buckets,
                    self.pool.seconds)

    @property
    def replays(self) -> int:
        """Replays so far (the tests check the graphs are used)."""
        return self.pool.replays

    def __contains__(self, size: int) -> bool:
        return size in self._buckets

    def _plan(self, wrapper, metadata: StepMetadata) -> None:
        """Plans a bucket's wrapper for a step. The page indices go to the device first (pinned,
        non-blocking): FlashInfer copies host indices into its graph buffer with a blocking copy,
        which would make the host wait for the step before."""
        backend = self.backend
        indices = torch.from_numpy(np.ascontiguousarray(metadata.kv_indices)).pin_memory().to(
            backend.device, non_blocking=True)
        wrapper.plan(torch.from_numpy(metadata.kv_indptr), indices,
                     torch.from_numpy(metadata.kv_last_page_len), backend.num_heads, backend.num_kv_heads,
                     backend.head_dim, backend.page_size, q_data_type=backend.dtype, kv_data_type=backend.cache_dtype,
                     sm_scale=backend.scale)

    def run(self, size: int, device: dict[str, torch.Tensor], metadata: StepMetadata,
            inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Replays bucket ``size`` on the staged inputs ``device`` (tokens, positions, slots) and the
        forward's other ``inputs`` (those named at capture) with the step's ``metadata``; returns the
        graph's hidden states ([size, hidden], valid until the next replay of this bucket)."""
        bucket = self._buckets[size]
        bucket.tokens.copy_(device["tokens"])
        bucket.positions.copy_(device["positions"])
        bucket.slots.copy_(device["slots"])
        for name, buffer in bucket.inputs.items():
            buffer.copy_(inputs[name])
        if bucket.planned is not None:
            bucket.planned.synchronize()
        self._plan(bucket.wrapper, metadata)
        bucket.planned = torch.cuda.Event()
        bucket.planned.record()
        return bucket.call()

"""Attention backends behind one interface: a backend plans a step once (from its host metadata)
and the plan attends every layer.

- ``native``: the C++ CPU kernel (float32 models; a float32, float16 or bfloat16 cache), reading the
  cache in place; the CPU default.
- ``flashinfer``: FlashInfer's paged kernels on CUDA (see flashinfer_attention.py); the CUDA default
  where the package is installed.
- ``torch``: gather + ``scaled_dot_product_attention``; runs on any device and dtype.

Every backend equals ``paged_attention_reference`` (tests/test_kernels.py).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from audio_pipeline_kernels.native_paged_attention import native_attention
from audio_pipeline_kernels.paged_attention import RaggedStep, ragged_paged_attention
from audio_pipeline_kernels.paged_layout import StepMetadata

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "flashinfer", "torch")
#: FlashInfer's prefill kernels: auto (FA3 on Hopper, else FA2), fa2, fa3 (Hopper only).
PREFILL_BACKENDS = ("auto", "fa2", "fa3")


class AttentionPlan(Protocol):
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """Causal attention of the step's new tokens ([T, heads, head_dim]) over one layer's cache,
        which already holds their keys and values."""


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: StepMetadata) -> AttentionPlan:
        """What every layer of the step described by ``metadata`` attends with."""


class TorchPlan:
    def __init__(self, step: RaggedStep, scale: float):
        self.step, self.scale = step, scale

    def attend(self, query, key_cache, value_cache):
        return ragged_paged_attention(query, key_cache, value_cache, self.step, self.scale)


class TorchBackend:
    """The padded gather + SDPA form: any device, any dtype."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, scale: float, window: int | None = None):
        self.device, self.dtype, self.scale, self.window = device, dtype, scale, window

    def plan(self, metadata: StepMetadata) -> TorchPlan:
        return TorchPlan(RaggedStep.build(metadata, self.device, self.dtype, self.window), self.scale)


class NativePlan:
    def __init__(self, kernel, metadata: StepMetadata, scale: float, window: int | None = None):
        self.kernel, self.scale, self.window = kernel, scale, window or 0
        self.args = tuple(torch.from_numpy(a) for a in (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                                                         metadata.seq_lens))

    def attend(self, query, key_cache, value_cache):
        return self.kernel(query, key_cache, value_cache, *self.args, self.scale, self.window)


#: Cache dtypes the native kernel reads (a 16-bit one widened to float32 as it is loaded).
NATIVE_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NativeBackend:
    """The C++ CPU kernel (float32 queries; a cache of NATIVE_CACHE_DTYPES)."""

    name = "native"

    def __init__(self, kernel, scale: float, window: int | None = None):
        self.kernel, self.scale, self.window = kernel, scale, window

    def plan(self, metadata: StepMetadata) -> NativePlan:
        return NativePlan(self.kernel, metadata, self.scale, self.window)


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, *, num_heads: int,
                             num_kv_heads: int, head_dim: int, page_size: int,
                             cache_dtype: torch.dtype | None = None, prefill_backend: str = "auto",
                             window: int | None = None) -> AttentionBackend:
    """The backend ``name`` (one of BACKENDS) for a model's attention on ``device``; ``auto`` takes the
    fastest that runs there. ``prefill_backend`` (PREFILL_BACKENDS) picks FlashInfer's prefill kernel.
    ``window``: the model's sliding attention window (each query sees the ``window`` positions
    ending at its own; None: causal over the whole sequence). ValueError naming the setting when the
    one asked for cannot run."""
    if name not in BACKENDS:
        raise ValueError(f"model.kv_cache.attention_kernel: {name!r} is not one of {', '.join(BACKENDS)}")
    if prefill_backend not in PREFILL_BACKENDS:
        raise ValueError(f"model.kv_cache.prefill_backend: {prefill_backend!r} is not one of "
                         f"{', '.join(PREFILL_BACKENDS)}")
    scale = head_dim ** -0.5
    cache_dtype = cache_dtype or dtype
    if window is not None and name == "flashinfer":
        raise ValueError("model.kv_cache.attention_kernel=flashinfer: this model's sliding attention window is not "
                         "passed to FlashInfer yet; use auto or torch")
    if device.type == "cuda" and name == "auto" and window is not None:
        logger.warning("a sliding attention window: attention on CUDA uses the torch form (slower, no CUDA graphs)")
    elif device.type == "cuda" and name in ("auto", "flashinfer"):
        from audio_pipeline_kernels.flashinfer_attention import FlashInferBackend, flashinfer_unavailable

        reason = flashinfer_unavailable(head_dim, dtype, cache_dtype)
        if reason is None:
            return FlashInferBackend(device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     page_size=page_size, dtype=dtype, cache_dtype=cache_dtype, scale=scale,
                                     prefill_backend=prefill_backend)
        if name == "flashinfer":
            raise ValueError(f"model.kv_cache.attention_kernel=flashinfer: {reason}")
        # Said at start-up, so that a slow GPU server tells why (the tiny test models, the built-in voices).
        logger.warning("FlashInfer cannot serve this model (%s): attention on CUDA uses the torch form (slower, "
                       "no CUDA graphs)", reason)
    if name == "flashinfer":
        raise ValueError("model.kv_cache.attention_kernel=flashinfer runs on CUDA only; use auto, native or torch")
    if (device.type == "cpu" and name in ("auto", "native") and dtype == torch.float32
            and cache_dtype in NATIVE_CACHE_DTYPES):
        kernel = native_attention()
        if kernel is not None:
            return NativeBackend(kernel, scale, window)
    if name == "native":
        raise ValueError("model.kv_cache.attention_kernel=native: the native kernel runs on CPU with a float32 "
                         "model and a float32, float16 or bfloat16 cache, and needs a C++ compiler (see the log); "
                         "use auto or torch")
    return TorchBackend(device, dtype, scale, window)


__all__ = ["BACKENDS", "NATIVE_CACHE_DTYPES", "PREFILL_BACKENDS", "AttentionBackend", "AttentionPlan", "NativeBackend",
           "TorchBackend", "select_attention_backend"]

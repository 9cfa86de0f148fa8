"""The engine's KV cache for a model, sized from the memory there is: the core builds and owns it;
the model only says what one token needs (its ``kv_params``) and how much its sequences want
(``estimate_kv_cache_size``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from audio_pipeline.core.kv_cache.paged import PagedKVCache, PagedKVCacheManager

if TYPE_CHECKING:
    from audio_pipeline.models.llama_model import LlamaPipelineModel

#: Tokens per row the CPU's KV cache starts with room for (it grows on demand from there).
CPU_START_TOKENS = 256


def available_memory(device: torch.device, utilization: float) -> int:
    """Bytes the KV cache may use on ``device``: free memory times ``utilization``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * utilization)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages * utilization)


def build_kv_cache(model: "LlamaPipelineModel", available_cache_memory: int | None = None, *,
                   reserve_bytes: int = 0) -> PagedKVCacheManager:
    """The paged cache of ``model``: sized from ``available_cache_memory`` bytes, or from the memory
    measured free now (after the weights and the decoder are loaded) times
    device_memory_utilization, less ``reserve_bytes`` for the steps' activations."""
    params, device, settings = model.kv_params, model.devices[0], model.kv_cache_config
    if available_cache_memory is None:
        available_cache_memory = max(0, available_memory(device, settings.device_memory_utilization) - reserve_bytes)
    size = model.estimate_kv_cache_size(model.pipeline_config, available_cache_memory, model.devices,
                                        model.huggingface_config, settings, model.cache_dtype)
    blocks = most = size // PagedKVCache.bytes_per_block(params)
    if device.type == "cpu" and settings.kv_cache_memory_bytes is None:
        # Start with room for every row's first CPU_START_TOKENS tokens and grow on demand: the
        # server holds what its streams use (CUDA sizes the cache once, from the measured memory).
        start = model.pipeline_config.max_batch_size * min(CPU_START_TOKENS, model.max_seq_len)
        blocks = min(most, max(1, -(-start // params.page_size)))
    return PagedKVCacheManager(params, device, blocks, max_num_blocks=most,
                               enable_prefix_caching=settings.enable_prefix_caching,
                               attention_kernel=settings.attention_kernel,
                               num_heads=model.huggingface_config.num_attention_heads,
                               model_dtype=model.dtype, prefill_backend=settings.prefill_backend)

"""Paged attention on CUDA with FlashInfer (``flashinfer-python``, the ``gpu`` extra).

FlashInfer reads the cache in this project's layout (NHD: ``[pages, page_size, kv_heads, head_dim]``
per layer, keys and values as a pair) and the step metadata of ``paged_layout`` as it is (int32
indptr / indices / last-page lengths). A step whose rows are all single tokens runs the decode
kernel (tensor cores for grouped-query attention of group 4 and more, and for fp8 caches); any
other step (prompts, forced-token runs, mixed batches) the causal prefill kernel.

``plan`` runs on the host from host tensors (FlashInfer copies the indptr arrays to the host
anyway, so passing device tensors would add a sync); only the page indices travel to the device.
Two sets of wrappers alternate between steps: a wrapper's plan fills a pinned buffer that an
asynchronous copy reads, so a step is never planned into the wrapper the step before it may still
be reading (see ``FlashInferBackend.plan``).

The prebuilt kernels (FlashInfer's ``jit-cache`` wheels, installed by ``flashinfer download-kernels``
at the same version as ``flashinfer-python``) keep anything from compiling at run time; without
them FlashInfer compiles each kernel with nvcc on first use and caches it.
"""

from __future__ import annotations

import numpy as np
import torch

from audio_pipeline_kernels.paged_layout import StepMetadata

#: Float workspace FlashInfer's planners split work into (its recommended size).
WORKSPACE_BYTES = 128 * 1024 * 1024


#: The dtypes FlashInfer's kernels take: queries, and the cache (fp8 stored, widened in the kernel).
QUERY_DTYPES = (torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


#: The head sizes FlashInfer instantiates its decode and prefill kernels for (its dispatch lists
#: 64, 128 and 256; any other size fails when the kernel is first built or loaded, not here).
HEAD_DIMS = (64, 128, 256)


def flashinfer_unavailable(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot serve a model of ``head_dim`` in ``dtype`` over a ``cache_dtype`` cache,
    or None when it can. The model's shape is checked before the package, so the answer for a model
    FlashInfer has no kernels for is the same with or without it installed."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: its kernels exist for head sizes {', '.join(map(str, HEAD_DIMS))} only"
    if dtype not in QUERY_DTYPES or cache_dtype not in CACHE_DTYPES:
        return f"its kernels take float16 or bfloat16 models and caches (or an fp8_e4m3 cache), not {dtype} / {cache_dtype}"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "the flashinfer-python package is not installed (pip install 'audio-pipeline[gpu]')"
    return None


class FlashInferPlan:
    def __init__(self, wrapper):
        self.wrapper = wrapper

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(query, (key_cache, value_cache))


class FlashInferBackend:
    """FlashInfer's batch decode and batch prefill kernels over the paged cache."""

    name = "flashinfer"

    def __init__(self, device: torch.device, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, cache_dtype: torch.dtype, scale: float, prefill_backend: str = "auto"):
        import flashinfer

        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_heads, num_kv_heads, head_dim, page_size
        self.dtype, self.cache_dtype, self.scale = dtype, cache_dtype, scale
        self.prefill_backend = prefill_backend
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.use_tensor_cores = fp8 or num_heads // num_kv_heads >= 4
        self._sets = [(flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                     use_tensor_cores=self.use_tensor_cores),
                       flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend))
                      for _ in range(2)]
        self._done = [None, None]
        self._turn = 0

    def _next_set(self):
        """The wrapper pair for the next step: the one the step before last used, once that step is done."""
        turn = self._turn
        self._turn ^= 1
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # two steps back: long finished when steps are read in order
        return turn, self._sets[turn]

    def plan(self, metadata: StepMetadata) -> FlashInferPlan:
        turn, (decode, prefill) = self._next_set()
        host = {name: torch.from_numpy(getattr(metadata, name))
                for name in ("qo_indptr", "kv_indptr", "kv_last_page_len")}
        indices = torch.from_numpy(np.ascontiguousarray(metadata.kv_indices)).pin_memory().to(self.device,
                                                                                               non_blocking=True)
        common = dict(q_data_type=self.dtype, kv_data_type=self.cache_dtype, sm_scale=self.scale)
        if metadata.max_query_len == 1:
            decode.plan(host["kv_indptr"], indices, host["kv_last_page_len"], self.num_heads, self.num_kv_heads,
                        self.head_dim, self.page_size, **common)
            wrapper = decode
        else:
            prefill.plan(host["qo_indptr"], host["kv_indptr"], indices, host["kv_last_page_len"], self.num_heads,
                         self.num_kv_heads, self.head_dim, self.page_size, causal=True, **common)
            wrapper = prefill
        # Recorded after the plan's own host-to-device copies: once it has passed, the pinned buffers
        # they read may be filled again.
        event = torch.cuda.Event()
        event.record()
        self._done[turn] = event
        return FlashInferPlan(wrapper)

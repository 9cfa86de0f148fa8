"""The Llama-family PipelineModel: loads a local Hugging Face directory and runs ragged batches."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from audio_pipeline.models.interface import AttentionBatch, KVCacheParams, PipelineModel
from audio_pipeline.models.llama import LlamaForCausalLM, fuse_layers
from audio_pipeline.models.cpu_linear import PackedWeight, pack_linears, pack_weight, use_packed_linears
from audio_pipeline.models.native_layers import attach_native_layers
from audio_pipeline.models.prompt_precision import add_prompt_weights, choose_prompt_dtype
from audio_pipeline.models.weights import load_safetensors_into
from audio_pipeline_kernels import native_attention
from audio_pipeline_kernels.native_decode import native_decode

if TYPE_CHECKING:
    from audio_pipeline.config import KVCacheConfig, PipelineConfig

logger = logging.getLogger(__name__)


#: model.kv_cache.cache_dtype values other than "auto".
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn}


def resolve_cache_dtype(kv_cache_config: "KVCacheConfig", dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for a model of ``dtype`` on ``device``: model.kv_cache.cache_dtype, or for
    "auto" float16 where a float32 model's attention runs in the native CPU kernel (it widens the
    cache as it loads it, and a decode step's attention is bound by the bytes it reads: through the
    server, 16 and 32 streams of the built-in voice ran 1.2-1.3x as many forward passes per second
    as with a float32 cache, with logits within 0.02 of it; see docs/performance-history.md, A 16-bit KV cache), else
    the model's own dtype."""
    if kv_cache_config.cache_dtype != "auto":
        return CACHE_DTYPES[kv_cache_config.cache_dtype]
    if (device.type == "cpu" and dtype == torch.float32 and kv_cache_config.attention_kernel in ("auto", "native")
            and native_attention() is not None):
        return torch.float16
    return dtype


class LlamaPipelineModel(PipelineModel):
    """Llama-family causal LM over the paged KV cache."""

    #: model.quantization=int8 applies (the decoder layers' linears: _quantize_int8).
    supports_int8 = True
    #: The torch module it builds from the checkpoint's config.
    module_class: type = LlamaForCausalLM

    def __init__(self, pipeline_config: "PipelineConfig", huggingface_config: Any, model_dir: Path, *,
                 devices: Sequence[torch.device], dtype: torch.dtype, kv_cache_config: "KVCacheConfig",
                 random_weights: bool = False):
        super().__init__(pipeline_config, huggingface_config, devices=devices, dtype=dtype,
                         kv_cache_config=kv_cache_config)
        self.model_dir = model_dir
        #: The KV cache's dtype (resolve_cache_dtype).
        self.cache_dtype = resolve_cache_dtype(kv_cache_config, dtype, self.devices[0])
        self.max_seq_len = self.calculate_max_seq_len(pipeline_config, huggingface_config)
        quantization = pipeline_config.model.quantization
        if quantization != "none":
            check_quantization(quantization, self.devices[0], dtype, type(self))
        self.model = self._build_model(huggingface_config, model_dir, dtype, self.devices[0], random_weights)
        self.model.reset_rotary(self.devices[0])
        self.model.eval()
        if quantization == "int8":
            self._quantize_int8()
        #: Whether decode steps multiply by packed, row-stable weights (model.packed_linears).
        self.packed_linears = use_packed_linears(pipeline_config.model.packed_linears, self.backbone_layers(), dtype,
                                                 self.devices[0], quantized=quantization == "int8",
                                                 compiled=pipeline_config.model.compile)
        # On the CPU fusing pays with packed weights only (fewer calls, and oneDNN's fixed cost per
        # call, about 10 us, where it serves): their fused products are the separate ones' bits
        # (test_cpu_linear), the BLAS's are not.
        if pipeline_config.model.fuse_layers and (self.devices[0].type == "cuda" or self.packed_linears):
            fuse_layers(self.model)
        #: The output projection's candidate ranges packed (cpu_linear.pack_weight), by (first id, width): the
        #: layout's, packed as the model runner starts (pack_candidate_ranges; model.packed_linears).
        self._packed_ranges: dict[tuple[int, int], PackedWeight] = {}
        if self.packed_linears:
            layers, depth = pack_linears(self.backbone_layers()), self._pack_sampling_products()
            packed = [m.packed_weight for m in self.model.modules()
                      if isinstance(getattr(m, "packed_weight", None), PackedWeight)]
            kernel = native_decode()
            native = 0 if kernel is None else self._attach_native(kernel)
            logger.info("decode steps' products on %s packed weights (model.packed_linears): %d in the decoder "
                        "layers, %d in the depth head, the candidate logits' ranges as the runner starts; %d of "
                        "them padded to two rows for a lone row (another kernel there); %d of %d decoder layers "
                        "on the native kernels", "the native kernel's" if kernel is not None else "oneDNN's", layers,
                        depth, sum(not weight.lone_exact for weight in packed), native, len(self.backbone_layers()))
        #: The dtype of prompt positions' products (model.prompt_dtype), None: the model's own.
        self.prompt_dtype, why = choose_prompt_dtype(pipeline_config.model.prompt_dtype, dtype, self.devices[0],
                                                     quantized=quantization == "int8",
                                                     dtype_setting=pipeline_config.model.dtype)
        if self.prompt_dtype is not None:
            count = add_prompt_weights(self.backbone_layers(), self.prompt_dtype)
            logger.info("prompt positions' products in %s (%s): %d weight copies",
                        str(self.prompt_dtype).removeprefix("torch."), why, count)
        else:
            logger.info("prompt positions' products in %s, the model's dtype (%s)",
                        str(dtype).removeprefix("torch."), why)
        #: The forward pass the steps run: the module itself, or its torch.compile'd twin (model.compile).
        self.forward = self._make_forward(pipeline_config.model.compile)

    def _build_model(self, huggingface_config: Any, model_dir: Path, dtype: torch.dtype, device: torch.device,
                     random_weights: bool) -> torch.nn.Module:
        """The language model with its weights on ``device`` (built on the meta device, then loaded)."""
        from audio_pipeline.models.weights import skipped_weight_init

        with torch.device("meta"), skipped_weight_init():
            model = self.module_class(huggingface_config)
        if random_weights:
            from audio_pipeline.models.weights import init_random_weights

            init_random_weights(model, dtype, device)
            model.tie_weights()
        else:
            load_safetensors_into(model, model_dir, dtype, device)
        return model

    def _attach_native(self, kernel) -> int:
        """Runs what can run on the native decode ``kernel`` there (models/native_layers.py): the
        decoder layers and the backbone's final norm; returns how many layers."""
        return attach_native_layers(self.backbone_layers(), kernel, getattr(getattr(self.model, "model", None), "norm",
                                                                            None))

    def _pack_sampling_products(self) -> int:
        """Packs what a step's sampling multiplies beside the output projection (a frame model's
        depth head: models/frame_head.py); returns the weights packed."""
        depth = getattr(self.model, "depth", None)
        return depth.pack(self.model.model.embed_tokens) if hasattr(depth, "pack") else 0

    def backbone_layers(self) -> torch.nn.Module:
        """The decoder layers the engine's paged steps run (what model.prompt_dtype applies to)."""
        return self.model.model.layers

    def _quantize_int8(self) -> None:
        """model.quantization=int8: the decoder layers' nn.Linear modules become dynamically quantized
        int8 ones (the embedding and lm_head stay: the engine slices lm_head's rows)."""
        quantize_linears_int8(self.model.model.layers)

    def _make_forward(self, compile: bool):
        """``self.model``, or its torch.compile'd twin: dynamic shapes, or with model.decode_buckets one
        static graph per bucket's decode step (:class:`StaticBucketForward`)."""
        if not compile:
            return self.model
        buckets = self.pipeline_config.model.decode_buckets
        if buckets:
            return StaticBucketForward(self.model, buckets)
        return torch.compile(self.model, dynamic=True)

    # --- sizes -----------------------------------------------------------------------------------

    @classmethod
    def calculate_max_seq_len(cls, pipeline_config: "PipelineConfig", huggingface_config: Any) -> int:
        limit = int(getattr(huggingface_config, "max_position_embeddings", 0) or 0)
        asked = pipeline_config.max_length
        if asked is None:
            if not limit:
                raise ValueError("the model config has no max_position_embeddings: set max_length")
            return limit
        if limit and asked > limit:
            raise ValueError(f"max_length ({asked}) exceeds the model's max_position_embeddings ({limit})")
        return asked

    @classmethod
    def get_num_layers(cls, huggingface_config: Any) -> int:
        return int(huggingface_config.num_hidden_layers)

    @classmethod
    def get_kv_params(cls, huggingface_config: Any, n_devices: int, kv_cache_config: "KVCacheConfig",
                      cache_dtype: torch.dtype, *, device_type: str = "cpu") -> KVCacheParams:
        heads = huggingface_config.num_attention_heads
        return KVCacheParams(
            num_layers=cls.get_num_layers(huggingface_config),
            n_kv_heads=getattr(huggingface_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(huggingface_config, "head_dim", None) or huggingface_config.hidden_size // heads,
            dtype=cache_dtype, page_size=kv_cache_config.page_size_for(device_type), n_devices=n_devices)

    @property
    def kv_params(self) -> KVCacheParams:
        """This model's cache: its shape, the cache dtype in force and the device's page size."""
        return self.get_kv_params(self.huggingface_config, len(self.devices), self.kv_cache_config, self.cache_dtype,
                                  device_type=self.devices[0].type)

    @classmethod
    def estimate_kv_cache_size(cls, pipeline_config: "PipelineConfig", available_cache_memory: int,
                               devices: Sequence[torch.device], huggingface_config: Any,
                               kv_cache_config: "KVCacheConfig", cache_dtype: torch.dtype) -> int:
        """Bytes for the cache: what max_batch_size full-length sequences need, capped by the memory
        available (an explicit kv_cache_memory_bytes is taken as is)."""
        if kv_cache_config.kv_cache_memory_bytes is not None:
            return kv_cache_config.kv_cache_memory_bytes
        params = cls.get_kv_params(huggingface_config, len(devices), kv_cache_config, cache_dtype,
                                   device_type=devices[0].type)
        longest = cls.calculate_max_seq_len(pipeline_config, huggingface_config)
        wanted = pipeline_config.max_batch_size * longest * params.bytes_per_token
        return min(wanted, available_cache_memory)

    # --- execution -------------------------------------------------------------------------------

    def compute_candidate_logits(self, hidden: torch.Tensor, groups: Sequence[tuple[int, int, int]],
                                 order: torch.Tensor, extra_ids: torch.Tensor, width: int) -> torch.Tensor:
        """Logits of each row's candidates: ``width`` ids from its range start, then its ``extra_ids``
        ([rows, E]); [rows, width + E] float32.

        Rows that share a range (the same frame slot) go through one matrix product over a
        contiguous slice of the output projection: ``order`` ([rows], on the device) sorts the rows
        by range start, ``groups`` ((first, end, start id) in that order, host data; see
        :func:`candidate_groups`) says where each range's rows are. Nothing is read back.
        """
        logits = self._with_extra_logits(hidden, extra_ids, width)
        if len(groups) == 1:  # one range: the rows are in order already
            logits[:, :width] = self._range_product(hidden, groups[0][2], width)
        else:
            ordered = hidden.index_select(0, order)
            by_range = torch.empty(hidden.shape[0], width, dtype=torch.float32, device=hidden.device)
            for first, end, start in groups:
                by_range[first:end] = self._range_product(ordered[first:end], start, width)
            logits[:, :width].index_copy_(0, order, by_range)
        return logits

    def pack_candidate_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """With model.packed_linears, packs the output projection's candidate ``ranges`` ((first id,
        width): the layout's frame slots' codebooks) before serving (the model runner calls it)."""
        if self.packed_linears:
            for start, width in ranges:
                if (start, width) not in self._packed_ranges:
                    self._packed_ranges[start, width] = pack_weight(self.model.lm_head.weight[start:start + width])

    def _range_product(self, hidden: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """``hidden @ lm_head.weight[start:start + width].T``; with model.packed_linears on that range
        packed (cpu_linear.pack_weight), so a row's logits do not depend on its batch."""
        if not self.packed_linears:
            return hidden @ self.model.lm_head.weight[start:start + width].T
        packed = self._packed_ranges.get((start, width))
        if packed is None:  # a range pack_candidate_ranges was not told of: packed now, without the
            # probe (it reads products back), so its lone rows are padded
            packed = self._packed_ranges[start, width] = pack_weight(self.model.lm_head.weight[start:start + width],
                                                                     probe=False)
        return packed(hidden)

    def compute_slot_logits(self, hidden: torch.Tensor, starts: torch.Tensor, extra_ids: torch.Tensor, width: int,
                            first: int, slots: int) -> torch.Tensor:
        """compute_candidate_logits for a layout whose ``slots`` candidate ranges of ``width`` ids
        tile the vocabulary from id ``first``: one product over all of them, each row's own range
        gathered from it by its ``starts`` (device data), so the kernels do not depend on which
        ranges the rows need (what a captured step requires; core/sample_graphs.py). On a GPU the
        extra products cost little: the weights are read once either way."""
        every = hidden @ self.model.lm_head.weight[first:first + slots * width].T
        columns = (starts - first)[:, None] + torch.arange(width, device=hidden.device)[None, :]
        logits = self._with_extra_logits(hidden, extra_ids, width)
        logits[:, :width] = every.gather(1, columns)
        return logits

    def _with_extra_logits(self, hidden: torch.Tensor, extra_ids: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, width + E] float32 candidate logits with the ``extra_ids`` columns filled (the
        first ``width`` are the caller's)."""
        weight = self.model.lm_head.weight
        logits = torch.empty(hidden.shape[0], width + extra_ids.shape[1], dtype=torch.float32, device=hidden.device)
        logits[:, width:] = torch.bmm(weight[extra_ids], hidden[:, :, None])[:, :, 0]
        return logits


class DepthPipelineModel(LlamaPipelineModel):
    """A model whose positions are frames: the module samples each frame's first code over the
    paged cache and its depth decoder the others (``codes_per_token`` and ``depth_frame`` are the
    module's: CSM's, Qwen3-TTS's, the frame Llama's)."""

    has_depth_decoder = True

    @property
    def codes_per_token(self) -> int:
        return self.model.codes_per_token

    def depth_frame(self, backbone_hidden: torch.Tensor, first_codes: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The module's [B, codes] frames after each row's first code (``choose(k, logits)`` picks codebook k)."""
        return self.model.depth_frame(backbone_hidden, first_codes, choose)


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype,
                       model_class: type | None = None) -> None:
    """Refuses model.quantization where it does not run (before any weight loads): int8 is CPU-only,
    for a float32 model whose class supports it."""
    if model_class is not None and not model_class.supports_int8:
        raise ValueError(f"model.quantization={quantization} is not supported for this model "
                         f"({model_class.__name__}) yet; set model.quantization=none")
    if device.type != "cpu":
        raise ValueError(f"model.quantization={quantization} runs on the CPU only (device {device}); "
                         "set model.quantization=none")
    if dtype != torch.float32:
        raise ValueError(f"model.quantization={quantization} needs a float32 model (model.dtype resolves to "
                         f"{str(dtype).removeprefix('torch.')}); set model.dtype=float32 or model.quantization=none")


def quantize_linears_int8(module: torch.nn.Module) -> None:
    """Replaces, in place, every nn.Linear under ``module`` by its dynamically quantized int8 twin
    (int8 weights per tensor; each call quantizes its activations and accumulates in int32)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao.quantization warns that it moves to torchao; quantize_dynamic still works in torch 2.13.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


class StaticBucketForward:
    """model.compile with model.decode_buckets: decode steps of a bucket's size run a torch.compile'd
    graph of static shapes (dynamic=False, one per bucket); every other step (prompts, mixed steps,
    batches above the largest bucket) runs the eager module, so an arbitrary length never recompiles."""

    def __init__(self, module: torch.nn.Module, buckets: Sequence[int]):
        import torch._dynamo

        self.module = module
        self.buckets = frozenset(buckets)
        # The attention call breaks the graph, so each layer's code is compiled per layer and bucket.
        layers = len(getattr(getattr(module, "model", module), "layers", ())) or 1
        limit = (len(self.buckets) + 1) * (layers + 1)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), limit))
        if hasattr(config, "accumulated_recompile_limit"):
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * limit)
        self.compiled = torch.compile(module, dynamic=False)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, **extra) -> torch.Tensor:
        rows = tokens.shape[0]
        if rows in self.buckets and len(batch.metadata.query_lens) == rows:  # a decode step of a bucket
            return self.compiled(tokens, positions, batch, **extra)
        return self.module(tokens, positions, batch, **extra)


def candidate_groups(starts: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Rows sorted by candidate range start, and each range's (first, end, start id) in that order."""
    order = np.argsort(starts, kind="stable")
    ordered = starts[order]
    edges = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist(), len(starts)]
    return order, [(a, b, int(ordered[a])) for a, b in zip(edges[:-1], edges[1:])]

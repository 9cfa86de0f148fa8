"""The Llama-family PipelineModel: loads a local Hugging Face directory and runs ragged batches."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from audio_pipeline.defaults import DEFAULT_MAX_BATCH_SIZE
from audio_pipeline.interfaces import KVCacheParams, ModelInputs, ModelOutputs, PipelineModel
from audio_pipeline.kv_cache import ContiguousKVCacheManager
from audio_pipeline.models.llama import LlamaForCausalLM, RaggedBatch
from audio_pipeline.models.weights import checkpoint_files, load_safetensors_into

if TYPE_CHECKING:
    from audio_pipeline.config import KVCacheConfig, PipelineConfig
    from audio_pipeline.context import TTSContext


@dataclass
class LlamaInputs(ModelInputs):
    """A flat batch: every sequence's new tokens back to back."""

    tokens: torch.Tensor
    positions: torch.Tensor
    #: Row of the flat batch whose logits predict each sequence's next token.
    logit_indices: torch.Tensor
    batch: RaggedBatch


class LlamaPipelineModel(PipelineModel["TTSContext"]):
    """Llama-family causal LM over per-request KV caches."""

    def __init__(self, pipeline_config: "PipelineConfig", huggingface_config: Any, model_dir: Path, *,
                 devices: Sequence[torch.device], dtype: torch.dtype, kv_cache_config: "KVCacheConfig"):
        super().__init__(pipeline_config, huggingface_config, devices=devices, dtype=dtype,
                         kv_cache_config=kv_cache_config)
        self.model_dir = model_dir
        self.max_seq_len = self.calculate_max_seq_len(pipeline_config, huggingface_config)
        with torch.device("meta"):
            self.model = LlamaForCausalLM(huggingface_config)
        load_safetensors_into(self.model, model_dir, dtype, self.devices[0])
        self.model.reset_rotary(self.devices[0])
        self.model.eval()
        self.kv_manager: ContiguousKVCacheManager | None = None

    # --- sizes -----------------------------------------------------------------------------------

    @classmethod
    def calculate_max_seq_len(cls, pipeline_config: "PipelineConfig", huggingface_config: Any) -> int:
        limit = int(getattr(huggingface_config, "max_position_embeddings", 0) or 0)
        asked = pipeline_config.max_length or pipeline_config.model.max_length
        if asked is None:
            if not limit:
                raise ValueError("the model config has no max_position_embeddings: set max_length")
            return limit
        if limit and asked > limit:
            raise ValueError(f"max_length ({asked}) exceeds the model's max_position_embeddings ({limit})")
        return asked

    @classmethod
    def estimate_weights_size(cls, pipeline_config: "PipelineConfig") -> int:
        model_dir = Path(pipeline_config.model.model_path)
        try:
            return sum(os.path.getsize(f) for f in checkpoint_files(model_dir))
        except (FileNotFoundError, OSError):
            return 0

    @classmethod
    def get_num_layers(cls, huggingface_config: Any) -> int:
        return int(huggingface_config.num_hidden_layers)

    @classmethod
    def get_kv_params(cls, huggingface_config: Any, n_devices: int, kv_cache_config: "KVCacheConfig",
                      cache_dtype: torch.dtype) -> KVCacheParams:
        heads = huggingface_config.num_attention_heads
        return KVCacheParams(
            num_layers=cls.get_num_layers(huggingface_config),
            n_kv_heads=getattr(huggingface_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(huggingface_config, "head_dim", None) or huggingface_config.hidden_size // heads,
            dtype=cache_dtype, page_size=kv_cache_config.kv_cache_page_size, n_devices=n_devices)

    @classmethod
    def estimate_kv_cache_size(cls, pipeline_config: "PipelineConfig", available_cache_memory: int,
                               devices: Sequence[torch.device], huggingface_config: Any,
                               kv_cache_config: "KVCacheConfig", cache_dtype: torch.dtype) -> int:
        """Bytes for the cache: what max_batch_size full-length sequences need, capped by memory."""
        params = cls.get_kv_params(huggingface_config, len(devices), kv_cache_config, cache_dtype)
        batch = pipeline_config.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        wanted = batch * cls.calculate_max_seq_len(pipeline_config, huggingface_config) * params.bytes_per_token
        return min(wanted, available_cache_memory)

    @classmethod
    def infer_optimal_batch_size(cls, pipeline_config, available_cache_memory, huggingface_config, devices,
                                 kv_cache_config, cache_dtype) -> int:
        params = cls.get_kv_params(huggingface_config, len(devices), kv_cache_config, cache_dtype)
        per_sequence = cls.calculate_max_seq_len(pipeline_config, huggingface_config) * params.bytes_per_token
        return max(1, available_cache_memory // per_sequence)

    def load_kv_manager(self, available_cache_memory: int | None) -> ContiguousKVCacheManager:
        params = self.get_kv_params(self.huggingface_config, len(self.devices), self.kv_cache_config, self.dtype)
        if available_cache_memory is None:
            available_cache_memory = available_memory(self.devices[0], self.kv_cache_config.device_memory_utilization)
        size = self.estimate_kv_cache_size(self.pipeline_config, available_cache_memory, self.devices,
                                           self.huggingface_config, self.kv_cache_config, self.dtype)
        self.kv_manager = ContiguousKVCacheManager(params, self.devices[0], size // params.bytes_per_token)
        return self.kv_manager

    # --- execution -------------------------------------------------------------------------------

    def prepare_initial_token_inputs(self, context_batch: Sequence["TTSContext"], kv_cache_inputs: Any = None,
                                     return_n_logits: int = 1) -> LlamaInputs:
        if self.kv_manager is None:
            raise RuntimeError("load_kv_manager() must run before execution")
        tokens: list[int] = []
        positions: list[int] = []
        starts, lengths, caches, last_rows = [], [], [], []
        for context in context_batch:
            new = context.unprocessed_tokens()
            starts.append(len(tokens))
            lengths.append(len(new))
            caches.append(self.kv_manager.get(context.request_id))
            positions.extend(range(context.processed, context.processed + len(new)))
            tokens.extend(new)
            last_rows.append(len(tokens) - 1)
        device = self.devices[0]
        return LlamaInputs(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            logit_indices=torch.tensor(last_rows, dtype=torch.long, device=device),
            batch=RaggedBatch(starts, lengths, caches))

    def prepare_next_token_inputs(self, next_tokens: torch.Tensor, prev_model_inputs: LlamaInputs) -> LlamaInputs:
        count = next_tokens.shape[0]
        prev = prev_model_inputs
        return LlamaInputs(
            tokens=next_tokens.to(prev.tokens.device),
            positions=prev.positions[prev.logit_indices] + 1,
            logit_indices=torch.arange(count, device=prev.tokens.device),
            batch=RaggedBatch(list(range(count)), [1] * count, prev.batch.caches))

    @torch.inference_mode()
    def execute(self, model_inputs: LlamaInputs) -> ModelOutputs:
        hidden = self.model(model_inputs.tokens, model_inputs.positions, model_inputs.batch)
        for cache in model_inputs.batch.caches:
            cache.commit()
        logits = self.model.compute_logits(hidden[model_inputs.logit_indices])
        offsets = torch.arange(logits.shape[0] + 1, device=logits.device)
        return ModelOutputs(logits=logits, next_token_logits=logits, logit_offsets=offsets)


def available_memory(device: torch.device, utilization: float) -> int:
    """Bytes the KV cache may use on ``device``: free memory times ``utilization``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * utilization)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages * utilization)

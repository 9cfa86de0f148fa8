"""Pipeline interfaces (after MAX's `interfaces` module), over torch tensors and devices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Generic, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from audio_pipeline.config import KVCacheConfig, PipelineConfig

ContextType = TypeVar("ContextType")
RequestType = TypeVar("RequestType")


class ModelInputs:
    """Base class for a model's inputs: subclasses hold any number of tensor fields.

    Iterating yields the tensor-valued attributes in definition order.
    """

    kv_cache_inputs: Any | None = None
    lora_ids: torch.Tensor | None = None
    lora_ranks: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        names = [f.name for f in fields(self)] if is_dataclass(self) else list(vars(self))
        for name in names:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                yield value

    def update(self, **kwargs: Any) -> None:
        """Sets existing attributes; an unknown name is an error."""
        for key, value in kwargs.items():
            if not hasattr(self, key):
                raise AttributeError(f"{type(self).__name__} has no input {key!r}")
            setattr(self, key, value)


@dataclass
class ModelOutputs:
    """What one execute() returns."""

    #: Logits for a variable number of tokens per sequence.
    logits: torch.Tensor
    #: Logits for just the next token of each sequence ([batch, vocab]).
    next_token_logits: torch.Tensor | None = None
    #: Offsets into ``logits`` of each sequence's rows (length batch + 1).
    logit_offsets: torch.Tensor | None = None


@dataclass(frozen=True)
class KVCacheParams:
    """Shape and type of the KV cache a model needs."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    n_devices: int = 1

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across all layers (keys and values)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * element


class PipelineModel(ABC, Generic[ContextType]):
    """A model with set-up, input preparation and execution."""

    def __init__(self, pipeline_config: "PipelineConfig", huggingface_config: Any, *,
                 devices: Sequence[torch.device], dtype: torch.dtype,
                 kv_cache_config: "KVCacheConfig", return_logits: str = "last_token"):
        self.pipeline_config = pipeline_config
        self.huggingface_config = huggingface_config
        self.devices = list(devices)
        self._dtype = dtype
        self.kv_cache_config = kv_cache_config
        self.return_logits = return_logits

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @classmethod
    @abstractmethod
    def calculate_max_seq_len(cls, pipeline_config: "PipelineConfig", huggingface_config: Any) -> int:
        """The longest sequence (prompt + generated tokens) this model will run."""

    @classmethod
    def estimate_weights_size(cls, pipeline_config: "PipelineConfig") -> int:
        """Bytes the weights take; 0 when unknown."""
        return 0

    @classmethod
    def estimate_activation_memory(cls, pipeline_config: "PipelineConfig", huggingface_config: Any) -> int:
        """Bytes of temporary buffers during execution; 0 when negligible."""
        return 0

    @classmethod
    def infer_optimal_batch_size(cls, pipeline_config: "PipelineConfig", available_cache_memory: int,
                                 huggingface_config: Any, devices: Sequence[torch.device],
                                 kv_cache_config: "KVCacheConfig", cache_dtype: torch.dtype) -> int:
        """The batch size the cache can hold at full sequence length (at least 1)."""
        return 1

    @abstractmethod
    def prepare_initial_token_inputs(self, context_batch: Sequence[ContextType],
                                     kv_cache_inputs: Any | None = None,
                                     return_n_logits: int = 1) -> ModelInputs:
        """Inputs for the first execute() of a batch: each context's tokens not yet in its cache."""

    @abstractmethod
    def prepare_next_token_inputs(self, next_tokens: torch.Tensor, prev_model_inputs: ModelInputs) -> ModelInputs:
        """Inputs for the following step of the same batch: one new token per sequence."""

    @abstractmethod
    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        """Runs the model on ``model_inputs``."""

    def compute_log_probabilities(self, model_inputs: ModelInputs, model_outputs: ModelOutputs,
                                  next_tokens: torch.Tensor, batch_top_n: Sequence[int],
                                  batch_echo: Sequence[bool]) -> list[Any | None]:
        """Log probabilities of the sampled tokens; None for rows that asked for none."""
        logits = model_outputs.next_token_logits
        if logits is None:
            return [None] * len(batch_top_n)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        results: list[Any | None] = []
        for row, top_n in enumerate(batch_top_n):
            if top_n <= 0:
                results.append(None)
                continue
            values, ids = log_probs[row].topk(top_n)
            results.append({"token_log_probability": log_probs[row, next_tokens[row]].item(),
                            "top": dict(zip(ids.tolist(), values.tolist()))})
        return results


@runtime_checkable
class KVCacheMixin(Protocol):
    """What a model says about the KV cache it needs, and how its manager is built."""

    @classmethod
    def get_kv_params(cls, huggingface_config: Any, n_devices: int, kv_cache_config: "KVCacheConfig",
                      cache_dtype: torch.dtype) -> KVCacheParams: ...

    @classmethod
    def get_num_layers(cls, huggingface_config: Any) -> int: ...

    @classmethod
    def estimate_kv_cache_size(cls, pipeline_config: "PipelineConfig", available_cache_memory: int,
                               devices: Sequence[torch.device], huggingface_config: Any,
                               kv_cache_config: "KVCacheConfig", cache_dtype: torch.dtype) -> int: ...

    def load_kv_manager(self, available_cache_memory: int | None) -> Any: ...


class AlwaysSignalBuffersMixin:
    """For models whose collectives run even on one device: they always get signal buffers."""

    devices: list[torch.device]

    @property
    def signal_buffers(self) -> list[torch.Tensor]:
        """One small synchronisation buffer per device."""
        return [torch.zeros(1, dtype=torch.uint8, device=d) for d in self.devices]


class GenerateMixin(Protocol[ContextType, RequestType]):
    """Whole-request generation on top of a step-wise pipeline."""

    @property
    def pipeline_config(self) -> "PipelineConfig": ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def kv_managers(self) -> list[Any]: ...

    def generate(self, prompts: RequestType | list[RequestType]) -> list[Any]: ...

    async def generate_async(self, prompts: RequestType | list[RequestType]) -> Any: ...


def get_paged_manager(pipeline: Any) -> Any | None:
    """The pipeline's KV cache manager, or None when it has none."""
    return getattr(pipeline, "kv_manager", None)

"""What the engine needs of a model: the KV cache it asks for, and the calls the model runner makes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from audio_pipeline.config import KVCacheConfig, PipelineConfig


@dataclass(frozen=True)
class KVCacheParams:
    """Shape and type of the KV cache a model needs."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    n_devices: int = 1
    #: The model's sliding attention window (each query sees the ``window`` positions ending at its
    #: own); None: causal over the whole sequence.
    window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across all layers (keys and values)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * element


class AttentionBatch(Protocol):
    """What a model's layers call on a step's batch (the core's paged KV cache builds it: where the
    new tokens' keys and values go, and how each token attends)."""

    #: The step's shape (``query_lens``: new tokens per sequence).
    metadata: Any
    #: The row ranges that are prompt positions, where model.prompt_dtype applies (else empty).
    prompt_rows: tuple[tuple[int, int], ...]

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Stores the new keys and values of ``layer`` and returns the attention of ``query``."""

    def stored_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where ``layer``'s new keys and values go (for layers that write them themselves)."""

    def attend_stored(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """The attention of ``query`` over ``layer``'s cache as stored."""


class RunnerModel(Protocol):
    """The calls the model runner (and the CUDA graphs) make on a model, and nothing else."""

    devices: list[torch.device]
    max_seq_len: int
    #: The dtype of prompt positions' products (model.prompt_dtype); None: the model's own.
    prompt_dtype: torch.dtype | None
    #: Codes each position carries (1; above 1 a depth decoder samples the rest of each frame).
    codes_per_token: int

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: Any, **inputs) -> torch.Tensor:
        """Hidden states after the final norm of every new token of a ragged step ([T] -> [T, hidden])."""

    def pack_candidate_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Prepares the output products of the (start id, size) candidate ranges the layout samples."""

    def compute_candidate_logits(self, hidden: torch.Tensor, groups: Sequence[tuple[int, int, int]],
                                 order: torch.Tensor, extra_ids: torch.Tensor, width: int) -> torch.Tensor:
        """Each row's logits over its candidate ids only (its frame slot's codebook, then its stop ids)."""

    def depth_frame(self, backbone_hidden: torch.Tensor, first_codes: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A frame-per-position model's [B, codes] frames after each row's first code (codes_per_token > 1)."""


class PipelineModel(ABC):
    """A served model's configuration, devices and dtype; subclasses load the weights and the cache."""

    #: Whether the architecture samples a frame's other codes after the backbone's (``depth_frame``).
    has_depth_decoder: ClassVar[bool] = False
    #: Codes each position carries (above 1 only with a depth decoder).
    codes_per_token: int = 1
    #: The sample rate of the recordings ``speaker_embedding`` takes; None: the model clones without one.
    speaker_sample_rate: int | None = None

    def speaker_embedding(self, samples) -> torch.Tensor:
        """A recording's speaker embedding (mono float32 at speaker_sample_rate), for a model that
        clones by one (Qwen3-TTS Base: its x-vector)."""
        raise NotImplementedError(f"{type(self).__name__} does not clone by a speaker embedding")

    def __init__(self, pipeline_config: "PipelineConfig", huggingface_config: Any, *,
                 devices: Sequence[torch.device], dtype: torch.dtype, kv_cache_config: "KVCacheConfig"):
        self.pipeline_config = pipeline_config
        self.huggingface_config = huggingface_config
        self.devices = list(devices)
        self._dtype = dtype
        self.kv_cache_config = kv_cache_config

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @classmethod
    @abstractmethod
    def calculate_max_seq_len(cls, pipeline_config: "PipelineConfig", huggingface_config: Any) -> int:
        """The longest sequence (prompt + generated tokens) this model will run."""

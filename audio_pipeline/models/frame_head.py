"""What a Llama needs to run one position per audio frame: frame inputs and a depth head.

A checkpoint says so in its config.json (``frame_head``, :class:`FrameHeadConfig`). Each position
carries a frame of ``C`` codes, every column a codebook whose ids are a contiguous range of the
vocabulary (``code_offsets``). Its input is the embedding of its token id plus those of its
frame's other codes (``-1``: none in that column); the token id is the code the backbone samples
(``token_column``), and one more code (``depth_column``) comes from the depth head: a small
residual SwiGLU stack over the backbone's final hidden state plus the sampled code's embedding,
read out through the same (tied) embedding rows. Columns that neither samples are the layout's to
fill (the built-in voice's alignment: audio_pipeline/layouts/phoneme_lpc_frame.py).

The recipe trains with these very modules (recipes/builtin_voice/frame_training.py), so training
and serving compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.models.cpu_linear import PackedWeight, linear, pack_linears, pack_weight
from audio_pipeline.models.llama import RMSNorm
from audio_pipeline.models.native_layers import native_block_call, native_head_call
from audio_pipeline_kernels.native_decode import native_decode

CONFIG_KEY = "frame_head"


@dataclass(frozen=True)
class FrameHeadConfig:
    #: First vocabulary id of each frame column's codebook.
    code_offsets: tuple[int, ...]
    codebook_size: int
    #: The column whose code the backbone samples (the position's token id).
    token_column: int
    #: The column the depth head samples.
    depth_column: int
    num_layers: int = 2
    intermediate_size: int = 384
    #: Input-only ids that stand for a pair of vocabulary ids (a folded prompt's (phoneme,
    #: duration)): {"base", "offsets": [a, b], "sizes": [n, m]}; id base + i * m + j is embedded as
    #: embedding[a + i] + embedding[b + j]. None: no such ids.
    fold: dict | None = None

    @classmethod
    def of(cls, huggingface_config: Any) -> "FrameHeadConfig | None":
        """The checkpoint's frame head, or None for a plain Llama."""
        data = getattr(huggingface_config, CONFIG_KEY, None)
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"config.json: {CONFIG_KEY} must be an object, got {data!r}")
        try:
            head = cls(**{**data, "code_offsets": tuple(data["code_offsets"])})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"config.json: invalid {CONFIG_KEY}: {exc}") from exc
        columns = len(head.code_offsets)
        if not (0 <= head.token_column < columns and 0 <= head.depth_column < columns
                and head.token_column != head.depth_column):
            raise ValueError(f"config.json: {CONFIG_KEY} needs two different columns of its {columns}")
        vocab = int(getattr(huggingface_config, "vocab_size", 0))
        if any(o < 0 or o + head.codebook_size > vocab for o in head.code_offsets):
            raise ValueError(f"config.json: {CONFIG_KEY}'s codebooks do not fit the {vocab}-id vocabulary")
        if head.fold is not None:
            fold = head.fold
            try:
                base, (a, b), (n, m) = int(fold["base"]), fold["offsets"], fold["sizes"]
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"config.json: {CONFIG_KEY}.fold needs base, offsets [a, b] and sizes [n, m]") from exc
            if base < vocab or not (0 <= a and a + n <= vocab and 0 <= b and b + m <= vocab and n > 0 and m > 0):
                raise ValueError(f"config.json: {CONFIG_KEY}.fold's ids must start at or after the vocabulary "
                                 f"({vocab}) and its parts lie inside it")
        return head

    @property
    def codes(self) -> int:
        return len(self.code_offsets)


def token_embeddings(embedding: nn.Embedding, ids: torch.Tensor, head: FrameHeadConfig) -> torch.Tensor:
    """The embeddings of ``ids``, a fold's pair ids ([FrameHeadConfig.fold]) as the sum of their
    two parts' (computed for every id, with no look at the values on the host: no device sync)."""
    if head.fold is None:
        return embedding(ids)
    fold = head.fold
    base, (first, second), (_, size) = int(fold["base"]), fold["offsets"], fold["sizes"]
    folded = ids >= base
    pair = (ids - base).clamp(min=0)
    one = torch.where(folded, first + pair // size, ids)
    vectors = embedding(one)
    other = embedding(second + pair % size)
    return vectors + other * folded[..., None].to(vectors.dtype)


def frame_embeddings(embedding: nn.Embedding, frames: torch.Tensor, head: FrameHeadConfig) -> torch.Tensor:
    """Sum of the embeddings of ``frames``' codes ([..., C], -1 for none) outside the token column
    ([..., hidden]): what a position adds to its token's embedding."""
    columns = [c for c in range(head.codes) if c != head.token_column]
    codes = frames[..., columns]
    offsets = torch.tensor([head.code_offsets[c] for c in columns], device=frames.device)
    present = (codes >= 0).to(embedding.weight.dtype)
    vectors = embedding(codes.clamp(min=0) + offsets)
    return (vectors * present[..., None]).sum(-2)


class _Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        #: The gate and up weights side by side, packed (:meth:`pack`), else None.
        self.packed_gate_up: PackedWeight | None = None
        #: The whole block as one call of the native decode kernels (where they packed it), else None.
        self.native = None

    def pack(self) -> int:
        """One packed product for gate and up (fewer calls; the same bits as two separate ones, checked
        by tests/test_cpu_linear.py), one for down; returns the weights packed."""
        self.packed_gate_up = pack_weight(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        count = 1 + pack_linears(self.down_proj)
        self.native = native_block_call(self.packed_gate_up, self.down_proj.packed_weight, native_decode())
        return count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x, self.norm)
        y = self.norm(x)
        if self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(y).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(y), self.up_proj(y)
        return x + linear(self.down_proj, F.silu(gate) * up)


class DepthHead(nn.Module):
    """The depth column's logits from the backbone's final hidden state and the token column's code."""

    def __init__(self, hidden: int, head: FrameHeadConfig, eps: float):
        super().__init__()
        self.head = head
        self.blocks = nn.ModuleList(_Block(hidden, head.intermediate_size, eps) for _ in range(head.num_layers))
        self.norm = RMSNorm(hidden, eps)
        #: The readout's rows (the depth column's codebook of the tied embedding) packed
        #: (:meth:`pack`), else None: the plain product.
        self.packed_readout: PackedWeight | None = None
        #: The head as one call of the native decode kernels (:meth:`pack`), else None.
        self.native = None

    def pack(self, embedding: nn.Embedding) -> int:
        """The blocks' products and the readout on packed weights (model.packed_linears), so a
        row's depth logits are the same bits whatever the batch; returns the weights packed. Where
        they are the native kernel's, the whole head runs as one native call (``self.native``)."""
        start = self.head.code_offsets[self.head.depth_column]
        self.packed_readout = pack_weight(embedding.weight[start:start + self.head.codebook_size])
        count = sum(block.pack() for block in self.blocks) + 1
        self.native = native_head_call(self, embedding, native_decode())
        return count

    def forward(self, hidden: torch.Tensor, token_codes: torch.Tensor, embedding: nn.Embedding) -> torch.Tensor:
        """[..., codebook] logits of the depth column (hidden [..., H], token_codes [...])."""
        if self.native is not None and hidden.dim() == 2:
            return self.native(hidden, token_codes)
        head = self.head
        x = hidden + embedding(token_codes + head.code_offsets[head.token_column])
        for block in self.blocks:
            x = block(x)
        if self.packed_readout is not None:
            return self.packed_readout(self.norm(x))
        start = head.code_offsets[head.depth_column]
        return self.norm(x) @ embedding.weight[start:start + head.codebook_size].T


"""Per-request sampling parameters and the sampler, constrained to valid speech tokens per frame slot."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Sequence

import torch

from audio_pipeline.errors import InvalidArgument

if TYPE_CHECKING:
    from audio_pipeline.config import SamplingConfig
    from audio_pipeline.context import TTSContext


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (server defaults with the request's overrides applied)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 1200
    min_tokens: int = 0
    seed: int | None = None

    @classmethod
    def from_config(cls, config: "SamplingConfig") -> "SamplingParams":
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def with_overrides(self, *, max_tokens_limit: int, tokens_per_frame: int, **overrides) -> "SamplingParams":
        """A copy with the given (non-None) overrides, validated; InvalidArgument names the field."""
        params = replace(self, **{k: v for k, v in overrides.items() if v is not None})
        params.validate(max_tokens_limit=max_tokens_limit, tokens_per_frame=tokens_per_frame)
        return params

    def validate(self, *, max_tokens_limit: int, tokens_per_frame: int) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise InvalidArgument(f"{rule}, got {getattr(self, name)}", field=f"sampling.{name}")

        check(self.temperature >= 0 and self.temperature == self.temperature, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (no limit) or >= 1")
        check(0 <= self.min_p < 1, "min_p", "must be in [0, 1)")
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(tokens_per_frame <= self.max_tokens <= max_tokens_limit, "max_tokens",
              f"must be between {tokens_per_frame} (one audio frame) and the server limit {max_tokens_limit}")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens")
        check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")

    def make_generator(self) -> torch.Generator:
        """This request's own random generator: its output does not depend on its batch mates."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def sample_next_tokens(logits: torch.Tensor, contexts: Sequence["TTSContext"]) -> list[int]:
    """One speech token per context from ``logits`` ([batch, vocab]).

    Each row only considers the ids its next frame slot allows (plus end-of-speech on a frame
    boundary once min_tokens are out), so a stream can never hold a broken frame.
    """
    chosen = []
    for row, context in enumerate(contexts):
        candidate_ids = context.allowed_next_tokens()
        scores = logits[row, candidate_ids].float()
        chosen.append(int(candidate_ids[_sample_row(scores, candidate_ids, context)]))
    return chosen


def _sample_row(scores: torch.Tensor, candidate_ids: torch.Tensor, context: "TTSContext") -> int:
    params = context.sampling
    counts = context.recent_token_counts(candidate_ids)
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if params.frequency_penalty:
        scores = scores - params.frequency_penalty * counts
    if params.presence_penalty:
        scores = scores - params.presence_penalty * seen.float()
    if params.temperature == 0:
        return int(scores.argmax())
    scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=context.generator))

"""What a request asks of the sampler: its sampling settings, validated, without torch (the
scheduler, the service and the doors read them; only the sampler needs torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from audio_pipeline.errors import InvalidArgument

#: Accepted repetition penalties (1 = none).
REPETITION_PENALTY_RANGE = (0.01, 100.0)

if TYPE_CHECKING:
    from audio_pipeline.config import SamplingConfig


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
    #: Extra ids that end the speech (the layout's end-of-speech always does), on frame boundaries.
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: "SamplingConfig") -> "SamplingParams":
        return cls(**{f.name: tuple(getattr(config, f.name)) if f.name == "stop_token_ids" else getattr(config, f.name)
                      for f in fields(cls)})

    def with_overrides(self, *, max_tokens_limit: int, tokens_per_frame: int, **overrides) -> "SamplingParams":
        """A copy with the given (non-None) overrides, validated; InvalidArgument names the field."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "stop_token_ids" in overrides:
            overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
        params = replace(self, **overrides)
        params.validate(max_tokens_limit=max_tokens_limit, tokens_per_frame=tokens_per_frame)
        return params

    def validate(self, *, max_tokens_limit: int, tokens_per_frame: int) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise InvalidArgument(f"{rule}, got {getattr(self, name)}", field=f"sampling.{name}")

        check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (no limit) or >= 1")
        check(0 <= self.min_p < 1, "min_p", "must be in [0, 1)")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        # Outside this range a penalty overflows the logits it divides (1e-40 makes them infinite).
        check(REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
              "repetition_penalty", f"must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}]")
        check(tokens_per_frame <= self.max_tokens <= max_tokens_limit, "max_tokens",
              f"must be between {tokens_per_frame} (one audio frame) and the server limit {max_tokens_limit}")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative token ids")
        check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")

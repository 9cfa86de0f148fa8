"""Per-request sampling parameters and the sampler, constrained to valid speech tokens per frame slot."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Sequence

import torch

from audio_pipeline.errors import InvalidArgument

#: Accepted repetition penalties (1 = none).
REPETITION_PENALTY_RANGE = (0.01, 100.0)

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

    def make_generator(self) -> torch.Generator:
        """This request's own random generator: its output does not depend on its batch mates."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def candidate_width(contexts: Sequence["TTSContext"]) -> int:
    """Candidates per row for a batch: the codebook plus the most stop ids any request has."""
    return max(c.layout.codebook_size + len(c.stop_ids) for c in contexts)


@dataclass
class CandidateBatch:
    """Each row's candidate ids and which of them are allowed now, for a whole batch at once (what
    each context's ``candidate_ids`` / ``candidate_mask`` give, built without per-row tensors).

    Row i's candidates are its next frame slot's codebook ``[starts[i], starts[i] + codebook)``
    followed by ``extra_ids[i]`` (its stop ids, padded with end-of-speech to a common width).
    """

    starts: list[int]
    codebook_size: int
    #: [B, E] stop ids per row.
    extra_ids: torch.Tensor
    #: [B, codebook + E] every candidate id.
    ids: torch.Tensor
    #: [B, codebook + E] allowed now.
    allowed: torch.Tensor

    @classmethod
    def build(cls, contexts: Sequence["TTSContext"]) -> "CandidateBatch":
        layout = contexts[0].layout
        codebook, frame, eos = layout.codebook_size, layout.tokens_per_frame, layout.end_of_speech
        stops = [c.stop_ids for c in contexts]
        width = max(len(s) for s in stops)
        starts, forced, stop_ok = [], [], []
        for context in contexts:
            position = len(context.generated)
            starts.append(layout.token_range(position)[0])
            fixed = context.alignment.forced(position) if context.alignment is not None else None
            forced.append(-1 if fixed is None else fixed)
            stop_ok.append(position % frame == 0 and position > 0 and position >= context.sampling.min_tokens)
        extra = torch.tensor([list(s) + [eos] * (width - len(s)) for s in stops], dtype=torch.long)
        start_t = torch.tensor(starts, dtype=torch.long)
        ids = torch.cat([start_t[:, None] + torch.arange(codebook)[None, :], extra], dim=1)
        columns = torch.arange(width)[None, :]
        stop_allowed = torch.tensor(stop_ok)[:, None] & (columns < torch.tensor([len(s) for s in stops])[:, None])
        allowed = torch.cat([torch.ones(len(contexts), codebook, dtype=torch.bool), stop_allowed], dim=1)
        forced_t = torch.tensor(forced, dtype=torch.long)
        allowed = torch.where((forced_t >= 0)[:, None], ids == forced_t[:, None], allowed)
        return cls(starts, codebook, extra, ids, allowed)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(start, start + self.codebook_size) for start in self.starts]


def sample_next_tokens(logits: torch.Tensor, contexts: Sequence["TTSContext"], *,
                       candidate_logits: bool = False, candidates: CandidateBatch | None = None) -> list[int]:
    """One speech token per context from ``logits`` ([batch, vocab]), all rows at once.

    Each row only considers the ids its next frame slot allows (plus end-of-speech on a frame
    boundary once min_tokens are out), so a stream can never hold a broken frame. Every row draws
    one uniform number from its own request's generator, so a request's tokens do not depend on
    what else is in the batch.

    ``logits`` is [batch, vocab], or with ``candidate_logits`` already [batch, candidates] in the
    order of each context's ``candidate_ids(candidate_width(contexts))`` (the model computes
    only those columns then, which is much cheaper than the whole vocabulary). ``candidates`` is
    the batch's CandidateBatch when the caller has built it already.
    """
    if not contexts:
        return []
    candidates = candidates or CandidateBatch.build(contexts)
    candidate_ids = candidates.ids.to(logits.device)  # [B, C]
    allowed = candidates.allowed.to(logits.device)
    scores = logits.float() if candidate_logits else logits.float().gather(1, candidate_ids)
    counts = torch.stack([c.candidate_counts(candidate_ids.shape[1]) for c in contexts]).to(logits.device)
    params = [c.sampling for c in contexts]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=logits.device)[:, None]

    seen = counts > 0
    penalty = column("repetition_penalty")
    scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    scores = scores - column("frequency_penalty") * counts - column("presence_penalty") * seen.float()
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Never a token the layout forbids, whatever the numbers: a row whose scores overflowed or went
    # NaN (extreme logits, a misbehaving model) falls back to its allowed candidates, uniformly.
    # Checked on each row's best score (NaN and infinities show there), so sound rows pay one max.
    extreme = not bool(torch.isfinite(scores.amax(dim=1)).all())
    if extreme:
        scores = _finite_or_excluded(scores)
        broken = ~torch.isfinite(scores).any(dim=1, keepdim=True)
        scores = torch.where(broken & allowed, torch.zeros_like(scores), scores)

    greedy = column("temperature")[:, 0] == 0
    chosen = scores.argmax(dim=1)
    if not bool(greedy.all()):
        scores = scores / column("temperature").clamp_min(1e-6)
        if extreme:  # the largest scores may overflow once divided by the temperature
            scores = _finite_or_excluded(scores)
        uniform = torch.cat([torch.rand(1, generator=c.generator) for c in contexts]).to(logits.device)
        top_k = [p.top_k if 0 < p.top_k < scores.shape[1] else scores.shape[1] for p in params]
        min_p, top_p = column("min_p"), column("top_p")
        sampled = None
        if scores.shape[1] > NUCLEUS_PREFIX and all(k == scores.shape[1] or k <= NUCLEUS_PREFIX for k in top_k):
            sampled = _sample_nucleus(scores, top_k, min_p, top_p, uniform, NUCLEUS_PREFIX)
        if sampled is None:
            sampled = _sample_nucleus(scores, top_k, min_p, top_p, uniform, scores.shape[1])
        chosen = torch.where(greedy, chosen, sampled)
    return candidate_ids.gather(1, chosen[:, None])[:, 0].tolist()


def _finite_or_excluded(scores: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest float; -inf stays -inf."""
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))


#: Candidates ranked before top-k / top-p / min-p filtering when that suffices (see _sample_nucleus):
#: a full sort of a 1,024-code row costs about 45 us per row on CPU, a top-64 selection a fraction.
NUCLEUS_PREFIX = 64


def _sample_nucleus(scores: torch.Tensor, top_k: list[int], min_p: torch.Tensor, top_p: torch.Tensor,
                    uniform: torch.Tensor, prefix: int) -> torch.Tensor | None:
    """Top-k, min-p and top-p filtering, then one draw per row, over each row's ``prefix`` best
    candidates; None when a row's kept set might reach past them (then call again with the whole
    row: ``prefix = scores.shape[1]``).

    With the whole row this is the plain rule. With a prefix it picks exactly the same: the
    probabilities are normalized over the whole row (or over its top_k, all inside the prefix), and
    when the prefix's kept mass exceeds top_p, every candidate past the prefix would have been cut
    by top_p anyway.
    """
    width = scores.shape[1]
    if prefix >= width:
        ordered, order = scores.sort(dim=1, descending=True)
    else:
        ordered, order = scores.topk(prefix, dim=1)
    ranks = torch.arange(ordered.shape[1], device=scores.device)[None, :]
    k = torch.tensor(top_k, device=scores.device)
    best = ordered[:, :1]
    weights = torch.exp(ordered - best).masked_fill(ranks >= k[:, None], 0.0)
    whole_row = (k == width)[:, None]
    denominator = torch.where(whole_row, torch.exp(scores - best).sum(dim=1, keepdim=True),
                              weights.sum(dim=1, keepdim=True))
    probs = weights / denominator
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    before = probs.cumsum(dim=1) - probs  # probability mass ranked above each candidate
    if prefix < width and not bool(((before[:, -1:] + probs[:, -1:] > top_p) | ~whole_row).all()):
        return None
    probs = probs.masked_fill(before > top_p, 0.0)
    probs[:, 0] = torch.where(probs[:, 0] > 0, probs[:, 0], torch.ones_like(probs[:, 0]))
    cumulative = probs.cumsum(dim=1)
    picks = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None]).clamp_max(ordered.shape[1] - 1)
    return order.gather(1, picks)[:, 0]

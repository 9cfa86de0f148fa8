"""The sampler, constrained to valid speech tokens per frame slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch


if TYPE_CHECKING:
    from audio_pipeline.core.request import TTSContext


def candidate_width(contexts: Sequence["TTSContext"]) -> int:
    """Candidates per row for a batch: the codebook plus the most stop ids any request has."""
    return max(c.layout.codebook_size + len(c.stop_ids) for c in contexts)


#: The per-row floats of a step's sampling, in the order SamplingRows.floats stacks them.
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                "uniform")


@dataclass
class SamplingRows:
    """What the sampler needs of each row of a step, built on the host (numpy) from the requests
    alone, so that sampling on the device reads no device value back.

    The random draw is made here, from each sampling request's own generator (one uniform number
    per sampling step, as the sampler always has), so a seed gives the same tokens whatever the
    device and whatever else is in the batch.
    """

    codebook_size: int
    #: [B] first id of each row's candidate range (its next frame slot's codebook).
    starts: np.ndarray
    #: [B, E] stop ids (padded with end-of-speech) and [B, E] whether each may be chosen now.
    extra_ids: np.ndarray
    #: [B, codebook + E] candidates that may not be chosen now: stop ids off a frame boundary or
    #: before min_tokens, padding, and everything but the forced id where a layout forces one.
    blocked: np.ndarray
    #: [len(FLOAT_FIELDS), B] float32: the settings, then the uniform draw (0 for greedy rows).
    floats: np.ndarray
    #: [B] top_k, the whole width where unlimited.
    top_k: np.ndarray
    #: [B] frame slot (position % tokens_per_frame) of the token each row samples.
    frame_slots: np.ndarray
    #: Some row samples (temperature > 0); else every row is greedy and no draw is needed.
    any_sampling: bool = False
    #: Some row has a repetition, frequency or presence penalty.
    penalized: bool = False
    #: Every sampling row keeps at most NUCLEUS_PREFIX candidates (top_k), so the prefix rule is
    #: exact without looking at the scores.
    prefix_suffices: bool = True
    #: Every sampling row's top_k fits the prefix or is unlimited: the prefix rule is exact where
    #: the scores show the top_p mass inside it (_sample_nucleus's check).
    prefix_may_suffice: bool = True

    @classmethod
    def build(cls, contexts: Sequence["TTSContext"], *, positions: Sequence[int] | None = None,
              draw: bool = True) -> "SamplingRows":
        """Row i samples generated position ``positions[i]`` of ``contexts[i]`` (default: the
        position after its generated tokens; a step launched before the one before it is applied
        samples further on)."""
        # Column by column (a few Python lists turned into arrays at once), not a numpy write per row
        # and field: at hundreds of rows a step this is most of the host's staging time.
        layout = contexts[0].layout
        codebook, frame, eos = layout.codebook_size, layout.tokens_per_frame, layout.end_of_speech
        batch = len(contexts)
        if positions is None:
            positions = [len(c.generated) for c in contexts]
        stops = [c.stop_ids for c in contexts]
        lengths = [len(s) for s in stops]
        width = max(lengths)
        slots = np.fromiter((p % frame for p in positions), dtype=np.int64, count=batch)
        # A position's candidate range depends on its frame slot alone (its codebook).
        slot_starts = np.array([layout.token_range(slot)[0] for slot in range(frame)], dtype=np.int64)
        starts = slot_starts[slots]
        if min(lengths) == width:
            extra_ids = np.array(stops, dtype=np.int64).reshape(batch, width)
        else:
            extra_ids = np.full((batch, width), eos, dtype=np.int64)
            for row, ids in enumerate(stops):
                extra_ids[row, :len(ids)] = ids
        # Stop ids may be chosen only where the speech may end; the padding never.
        stop_by_token = layout.stops_by_token
        allowed = np.fromiter((n if stop_by_token and c.may_stop(p) else 0
                               for c, p, n in zip(contexts, positions, lengths)), dtype=np.int64, count=batch)
        blocked = np.zeros((batch, codebook + width), dtype=bool)
        blocked[:, codebook:] = np.arange(width)[None, :] >= allowed[:, None]
        params = [c.sampling for c in contexts]
        floats = np.zeros((len(FLOAT_FIELDS), batch), dtype=np.float32)
        floats[:6] = np.array([(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                                p.presence_penalty) for p in params], dtype=np.float32).reshape(batch, 6).T
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_k = np.where((top_k > 0) & (top_k < codebook + width), top_k, codebook + width)
        sampling = [row for row, p in enumerate(params) if p.temperature > 0]
        if draw and sampling:  # each row's from its request's own generator, on the host: nothing read back
            floats[FLOAT_FIELDS.index("uniform"), sampling] = [contexts[row].uniforms(1)[0] for row in sampling]
        forced = np.full(batch, -1, dtype=np.int64)
        for row, context in enumerate(contexts):
            if context.alignment is not None:
                fixed = context.alignment.forced(positions[row])
                if fixed is not None:
                    forced[row] = fixed
        sampled_top_k = top_k[sampling].tolist()
        flags = dict(any_sampling=bool(sampled_top_k),
                     penalized=any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
                                   for p in params),
                     prefix_suffices=all(k <= NUCLEUS_PREFIX for k in sampled_top_k),
                     prefix_may_suffice=all(k <= NUCLEUS_PREFIX or k == codebook + width for k in sampled_top_k))
        built = cls(codebook, starts, extra_ids, blocked, floats, top_k, slots, **flags)
        rows = np.flatnonzero(forced >= 0)
        if rows.size:  # a forced row allows its forced id alone
            blocked[rows] = built.candidate_ids(rows) != forced[rows, None]
        return built

    def candidate_ids(self, rows: np.ndarray | None = None) -> np.ndarray:
        """[B, codebook + E] each row's candidate ids (its frame slot's codebook, then its stop ids),
        or those of ``rows``."""
        starts, extra = (self.starts, self.extra_ids) if rows is None else (self.starts[rows], self.extra_ids[rows])
        return np.concatenate([starts[:, None] + np.arange(self.codebook_size)[None, :], extra], axis=1)

    @property
    def width(self) -> int:
        return self.codebook_size + self.extra_ids.shape[1]


@dataclass
class DeviceSamplingRows:
    """SamplingRows on the device (views of a step's staged inputs, or copies)."""

    starts: torch.Tensor
    extra_ids: torch.Tensor
    blocked: torch.Tensor
    floats: torch.Tensor
    top_k: torch.Tensor

    #: The SamplingRows arrays a device copy holds, in field order.
    FIELDS = ("starts", "extra_ids", "blocked", "floats", "top_k")

    @classmethod
    def copy_of(cls, rows: SamplingRows, device: torch.device) -> "DeviceSamplingRows":
        return cls(*(torch.from_numpy(getattr(rows, name)).to(device) for name in cls.FIELDS))

    def column(self, name: str) -> torch.Tensor:
        return self.floats[FLOAT_FIELDS.index(name)][:, None]


def sample_rows(scores: torch.Tensor, rows: SamplingRows, device_rows: DeviceSamplingRows, counts: torch.Tensor, *,
                sync_free: bool = True, native: bool = True) -> torch.Tensor:
    """One speech token id per row ([B] int64, on the scores' device) from candidate logits
    ``scores`` ([B, codebook + E], each row's candidates in SamplingRows order) and each row's
    earlier codes in its frame slot ``counts`` ([B, codebook]).

    Each row only considers the ids its next frame slot allows (plus its stop ids on a frame boundary
    once min_tokens are out), so a stream can never hold a broken frame. Nothing here reads a device
    value on the host when ``sync_free``: which rule runs is decided from the requests' settings
    (host data). Without it (the CPU, where a device value costs nothing to read) a flat row's
    nucleus may first be tried over the best NUCLEUS_PREFIX candidates; the result is the same.
    There (and with ``native``) the rule runs as one C++ call where it could be built
    (audio_pipeline_kernels/native_sampler.py: the same picks but at float-rounding boundaries),
    else as the torch operations below.
    """
    codebook = rows.codebook_size
    scores = scores.float()
    host = not sync_free and scores.device.type == "cpu"  # reading the scores back is free
    if host and native:
        from audio_pipeline_kernels.native_sampler import PREFIX, native_sampler

        kernel = native_sampler()
        if kernel is not None:
            return kernel(scores.contiguous(), device_rows.blocked.contiguous(),
                          counts.float().contiguous() if rows.penalized else scores.new_empty(0),
                          device_rows.floats.contiguous(), device_rows.top_k.contiguous(),
                          device_rows.starts.contiguous(), device_rows.extra_ids.contiguous(), codebook,
                          rows.penalized, rows.any_sampling, PREFIX)
    if rows.penalized:  # the penalties act on the codebook's columns; stop ids are never counted
        codes = scores[:, :codebook]
        seen = counts > 0
        penalty = device_rows.column("repetition_penalty")
        codes = torch.where(seen, torch.where(codes > 0, codes / penalty, codes * penalty), codes)
        codes = codes - device_rows.column("frequency_penalty") * counts - device_rows.column("presence_penalty") * seen
        scores = torch.cat([codes, scores[:, codebook:]], dim=1)
    scores = scores.masked_fill(device_rows.blocked, float("-inf"))
    # Never a token the layout forbids, whatever the numbers: a row whose scores overflowed or went
    # NaN (extreme logits, a misbehaving model) falls back to its allowed candidates, uniformly.
    # Where reading back is free, sound batches (every row's best score finite) skip this.
    extreme = sync_free or not bool(torch.isfinite(scores.amax(dim=1)).all())
    if extreme:
        scores = _finite_or_excluded(scores)
        broken = ~torch.isfinite(scores).any(dim=1, keepdim=True)
        scores = torch.where(broken & ~device_rows.blocked, torch.zeros_like(scores), scores)
    chosen = scores.argmax(dim=1)
    if rows.any_sampling:
        temperature = device_rows.column("temperature")
        scaled = scores / temperature.clamp_min(1e-6)
        if extreme:  # the largest scores may overflow once divided by the temperature
            scaled = _finite_or_excluded(scaled)
        top_k, min_p, top_p = device_rows.top_k, device_rows.column("min_p"), device_rows.column("top_p")
        uniform = device_rows.column("uniform")[:, 0]
        width = scores.shape[1]
        sampled = None
        if width > NUCLEUS_PREFIX and (rows.prefix_suffices or (not sync_free and rows.prefix_may_suffice)):
            sampled = _sample_nucleus(scores=scaled, top_k=top_k, min_p=min_p, top_p=top_p, uniform=uniform,
                                      prefix=NUCLEUS_PREFIX, check=not rows.prefix_suffices, host=host)
        if sampled is None:
            sampled = _sample_nucleus(scaled, top_k, min_p, top_p, uniform, width, host=host)
        chosen = torch.where(temperature[:, 0] == 0, chosen, sampled)
    stop = device_rows.extra_ids.gather(1, (chosen - codebook).clamp_min(0)[:, None])[:, 0]
    return torch.where(chosen < codebook, device_rows.starts + chosen, stop)


def slot_counts(context: "TTSContext") -> np.ndarray:
    """How often each code came before in the frame slot ``context`` samples next ([codebook]): what
    the repetition penalties look at (the engine keeps these on the device; this is their reference)."""
    layout = context.layout
    frame, position = layout.tokens_per_frame, len(context.generated)
    slot = position % frame
    codes = [layout.token_to_code(token, p) for p, token in enumerate(context.generated) if p % frame == slot]
    return np.bincount(np.asarray(codes, dtype=np.int64), minlength=layout.codebook_size).astype(np.float32)


def sample_next_tokens(logits: torch.Tensor, contexts: Sequence["TTSContext"], *,
                       candidate_logits: bool = False, sync_free: bool = False) -> list[int]:
    """One speech token per context from ``logits`` ([batch, vocab], or with ``candidate_logits``
    already [batch, candidates] in SamplingRows order), all rows at once; for use without an engine
    (the engine's model runner keeps the counts on the device and reads its ids back later).

    Every sampling row draws one uniform number from its own request's generator, so a request's
    tokens do not depend on what else is in the batch.
    """
    if not contexts:
        return []
    rows = SamplingRows.build(contexts)
    device_rows = DeviceSamplingRows.copy_of(rows, logits.device)
    if not candidate_logits:
        logits = logits.gather(1, torch.from_numpy(rows.candidate_ids()).to(logits.device))
    counts = torch.from_numpy(np.stack([slot_counts(c) for c in contexts])).to(logits.device)
    return sample_rows(logits, rows, device_rows, counts, sync_free=sync_free).tolist()


def _finite_or_excluded(scores: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest float; -inf stays -inf."""
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))


#: Candidates ranked before top-k / top-p / min-p filtering when that suffices (see _sample_nucleus):
#: a full sort of a 1,024-code row costs about 45 us per row on CPU, a top-64 selection a fraction.
NUCLEUS_PREFIX = 64


def _ranked_on_host(scores: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``prefix`` best scores, best first, and their columns (the whole row ranked when
    ``prefix`` covers it), for scores on the CPU. numpy's partition and sort do it in a fraction of
    torch's CPU topk and sort (64 rows of 1,024: 0.17 ms against 0.56 for the best 64, 0.49 ms
    against 2.9 for a whole sort). Equal scores may come in another order than torch's, the same
    for the same row whatever the batch (a row's order depends on its own values only)."""
    negated = -scores.numpy()
    if prefix >= negated.shape[1]:
        order = torch.from_numpy(np.argsort(negated, axis=1))
        return scores.gather(1, order), order
    best = torch.from_numpy(np.argpartition(negated, prefix - 1, axis=1)[:, :prefix])
    ordered, within = scores.gather(1, best).sort(dim=1, descending=True)  # a small sort: 64 a row
    return ordered, best.gather(1, within)


def _sample_nucleus(scores: torch.Tensor, top_k, min_p: torch.Tensor, top_p: torch.Tensor,
                    uniform: torch.Tensor, prefix: int, check: bool = True, host: bool = False) -> torch.Tensor | None:
    """Top-k, min-p and top-p filtering, then one draw per row, over each row's ``prefix`` best
    candidates; with ``check``, None when a row's kept set might reach past them (then call again
    with the whole row: ``prefix = scores.shape[1]``). ``check`` reads the scores on the host;
    without it the caller knows every row's top_k fits the prefix.

    With the whole row this is the plain rule. With a prefix it picks exactly the same: the
    probabilities are normalized over the whole row (or over its top_k, all inside the prefix), and
    when the prefix's kept mass exceeds top_p, every candidate past the prefix would have been cut
    by top_p anyway.
    """
    width = scores.shape[1]
    if host:  # the scores may be read on the host (a CPU engine): ranked by numpy
        ordered, order = _ranked_on_host(scores, prefix)
    elif prefix >= width:
        ordered, order = scores.sort(dim=1, descending=True)
    else:
        ordered, order = scores.topk(prefix, dim=1)
    ranks = torch.arange(ordered.shape[1], device=scores.device)[None, :]
    k = top_k if isinstance(top_k, torch.Tensor) else torch.tensor(top_k, device=scores.device)
    best = ordered[:, :1]
    weights = torch.exp(ordered - best).masked_fill(ranks >= k[:, None], 0.0)
    whole_row = (k == width)[:, None]
    denominator = torch.where(whole_row, torch.exp(scores - best).sum(dim=1, keepdim=True),
                              weights.sum(dim=1, keepdim=True))
    probs = weights / denominator
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    before = probs.cumsum(dim=1) - probs  # probability mass ranked above each candidate
    if check and prefix < width and not bool(((before[:, -1:] + probs[:, -1:] > top_p) | ~whole_row).all()):
        return None
    probs = probs.masked_fill(before > top_p, 0.0)
    probs[:, 0] = torch.where(probs[:, 0] > 0, probs[:, 0], torch.ones_like(probs[:, 0]))
    cumulative = probs.cumsum(dim=1)
    picks = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None]).clamp_max(ordered.shape[1] - 1)
    return order.gather(1, picks)[:, 0]

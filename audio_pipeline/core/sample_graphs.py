"""A decode step's token sampling captured as CUDA graphs, one per batch bucket and sampling rule.

After a captured decode forward (decode_graphs.py) the step's sampling still ran eagerly: the rows'
candidate logits, the penalties, the guard against broken rows, the nucleus rule and the draw are
about 60 small kernels launched from Python, a fifth of the engine loop's time at 160 streams on an
H100 (py-spy). Replayed from a graph they are one call.

What a graph cannot hold is host data that changes the kernels, so the captured sampling fixes it:

- The candidate logits come from one product over every frame slot's codebook at once (the layout's
  slot ranges must tile one contiguous stretch of the vocabulary, as Orpheus's do), each row's own
  slot gathered from it, instead of one product per slot that the step's rows happen to need. The
  eager sampling of a runner with these graphs computes the same form, so the two agree.
- The penalties are always applied (a penalty of 1 and factors of 0 leave a logit exactly as it
  was) and every row goes through the sampling rule (a greedy row's temperature of 0 keeps its
  argmax): the same ids as the rule the host would pick.
- Two graphs per bucket: the prefix rule (every sampling row's top_k within NUCLEUS_PREFIX, or no row
  samples) and the whole row.
- The stop-id columns are fixed in number (``extra_width``: the layout's end of speech alone);
  requests with stop ids of their own sample eagerly.

A step of n rows copies its inputs into the first n rows of the smallest bucket that holds them
(the padding rows keep what an earlier step left there: valid numbers, never mixed with the rows')
and reads the first n ids. The repetition counts are read into the bucket before the replay and
updated after it, outside the graph: the counts table grows while the engine runs.

The capture itself is cuda/graphs.py's; on a CPU there is nothing to capture, and ``capture=False``
runs the same function on the same buffers (the tests check the plumbing there).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from audio_pipeline.core.sampler import FLOAT_FIELDS, DeviceSamplingRows, SamplingRows, sample_rows
from audio_pipeline.cuda.graphs import Buckets, CapturedCall, GraphPool

if TYPE_CHECKING:
    from audio_pipeline.models.llama_model import LlamaPipelineModel

logger = logging.getLogger(__name__)

#: The SamplingRows arrays a step stages (by their staged names) that a bucket copies before a replay.
ROW_INPUTS = ("starts", "extra_ids", "blocked", "top_k")


def slot_span(layout: Any) -> tuple[int, int] | None:
    """(first id, number of slots) where the layout's frame slots' codebooks tile one stretch of
    the vocabulary in slot order; None otherwise (the captured sampling needs one product)."""
    codebook, frame = layout.codebook_size, layout.tokens_per_frame
    first = layout.token_range(0)[0]
    for slot in range(frame):
        start, end = layout.token_range(slot)
        if start != first + slot * codebook or end != start + codebook:
            return None
    return first, frame


def _rule(codebook: int, prefix: bool) -> SamplingRows:
    """The host flags of a captured rule: penalties on, every row through the sampling rule, the
    prefix rule or the whole row."""
    empty = np.zeros(0, dtype=np.int64)
    return SamplingRows(codebook, empty, empty, empty, empty, empty, empty, any_sampling=True, penalized=True,
                        prefix_suffices=prefix, prefix_may_suffice=prefix)


def draw_ids(model: "LlamaPipelineModel", inputs: dict[str, torch.Tensor], rule: SamplingRows,
             span: tuple[int, int]) -> torch.Tensor:
    """The sampled ids of ``inputs``' rows under ``rule`` (what a graph captures)."""
    codebook = rule.codebook_size
    logits = model.compute_slot_logits(inputs["states"], inputs["starts"], inputs["extra_ids"], codebook, *span)
    rows = DeviceSamplingRows(inputs["starts"], inputs["extra_ids"], inputs["blocked"], inputs["floats"],
                              inputs["top_k"])
    return sample_rows(logits, rule, rows, inputs["counts"], sync_free=True)


class SampleGraphs:
    """Captured sampling of ``model``'s decode steps for each size in ``buckets``."""

    def __init__(self, model: "LlamaPipelineModel", buckets: Sequence[int], *, codebook: int, extra_width: int,
                 span: tuple[int, int], end_of_speech: int, capture: bool = True):
        self.model, self.codebook, self.extra_width, self.span = model, codebook, extra_width, span
        self.buckets = Buckets(buckets)
        device = model.devices[0]
        hidden = int(model.model.config.hidden_size)
        width = codebook + extra_width
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._calls: dict[tuple[int, bool], CapturedCall[torch.Tensor]] = {}
        self.pool = GraphPool(device, capture=capture)
        for size in reversed(self.buckets.sizes):
            # A padding row: greedy, nothing blocked, no penalty, slot 0's codebook.
            floats = torch.zeros(len(FLOAT_FIELDS), size, dtype=torch.float32, device=device)
            for name in ("top_p", "repetition_penalty"):
                floats[FLOAT_FIELDS.index(name)] = 1.0
            inputs = {"states": torch.zeros(size, hidden, dtype=model.dtype, device=device),
                      "starts": torch.full((size,), span[0], dtype=torch.long, device=device),
                      "extra_ids": torch.full((size, extra_width), end_of_speech, dtype=torch.long, device=device),
                      "blocked": torch.zeros(size, width, dtype=torch.bool, device=device),
                      "floats": floats,
                      "top_k": torch.full((size,), width, dtype=torch.long, device=device),
                      "counts": torch.zeros(size, codebook, dtype=torch.float32, device=device)}
            self._inputs[size] = inputs
            for prefix in (True, False):
                self._calls[size, prefix] = self.pool.call(
                    lambda inputs=inputs, rule=_rule(codebook, prefix): draw_ids(model, inputs, rule, span))
        self.pool.synchronize()
        if capture:
            logger.info("CUDA graphs: the token sampling at %d buckets, two rules each, captured in %.1f s",
                        len(self.buckets), self.pool.seconds)

    @property
    def captured(self) -> bool:
        """Whether the calls are CUDA graphs (false: run eagerly on the same buffers)."""
        return self.pool.capture

    @property
    def replays(self) -> int:
        """Replays so far (the tests check the graphs are used)."""
        return self.pool.replays

    def fits(self, rows: SamplingRows) -> bool:
        """Whether a step's sampling rows can replay a graph (host data only)."""
        return (rows.codebook_size == self.codebook and rows.extra_ids.shape[1] == self.extra_width
                and rows.starts.shape[0] <= self.buckets.largest)

    def bucket_inputs(self, count: int) -> dict[str, torch.Tensor]:
        """The fixed inputs of the bucket a step of ``count`` rows replays (the tests read them)."""
        return self._inputs[self.buckets.fit(count)]

    @torch.inference_mode()
    def run(self, states: torch.Tensor, device: dict[str, torch.Tensor], counts_table: torch.Tensor,
            rows: SamplingRows) -> torch.Tensor:
        """The [n] sampled ids of a step whose n sampling rows' states are ``states`` ([n, hidden]),
        with the sampling inputs the step staged in ``device`` and the repetition counts of its rows
        from ``counts_table``. The caller checked :meth:`fits`."""
        count = states.shape[0]
        size = self.buckets.fit(count)
        inputs = self._inputs[size]
        inputs["states"][:count].copy_(states)
        for name in ROW_INPUTS:
            inputs[name][:count].copy_(device[name])
        inputs["floats"][:, :count].copy_(device["floats"])
        torch.index_select(counts_table, 0, device["count_rows"], out=inputs["counts"][:count])
        return self._calls[size, rows.prefix_suffices or not rows.any_sampling]()[:count]

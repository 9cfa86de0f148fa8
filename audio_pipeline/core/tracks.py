"""A second input track beside the token ids: a text token per position, and raw input vectors.

Some families (Qwen3-TTS) add to every position's input a text token (the prompt's text, then one
per generated frame while the text lasts) and put a raw vector (a cloned voice's speaker
embedding) where a prompt position has no id. The request's preparation gives the request its
:class:`~audio_pipeline.layouts.text_track.TextTrack` (the layout's ``text_track``); the model runner stages it beside the tokens
(:class:`TrackInputs`, chosen once per model) and the model adds it to its input embeddings.
Requests of other families carry none, and the runner's :class:`NoTracks` stages nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


class NoTracks:
    """Token ids alone: nothing to stage."""

    def arrays(self, items: Sequence[Any], total: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {}

    def fill(self, host: dict[str, np.ndarray], items: Sequence[Any], ends: Sequence[int]) -> None:
        pass

    def forward_inputs(self, device: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {}

    def graph_inputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        """The per-position inputs a captured decode step takes (keyword -> (shape after the
        position, dtype, the value of a position without one)); raw vectors never reach a decode
        step (they sit at prompt positions)."""
        return {}


class TrackInputs(NoTracks):
    """Stages each position's text id (``text_ids``) and the raw vectors of the positions a step
    computes (``vector_rows``, ``vector_values``)."""

    def __init__(self, width: int):
        #: The vectors' size (the model's hidden size).
        self.width = width

    @staticmethod
    def _vectors(item: Any) -> list[tuple[int, torch.Tensor]]:
        """(offset in the item, vector) of the item's positions that carry one."""
        track = item.request.text_track
        if track is None or not track.vectors:
            return []
        end = item.start + item.num_tokens
        return [(position - item.start, vector) for position, vector in sorted(track.vectors.items())
                if item.start <= position < end]

    def arrays(self, items: Sequence[Any], total: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        arrays: dict[str, tuple[tuple[int, ...], Any]] = {"text_ids": ((total,), np.int64)}
        count = sum(len(self._vectors(item)) for item in items)
        if count:
            arrays.update(vector_rows=((count,), np.int64), vector_values=((count, self.width), np.float32))
        return arrays

    def fill(self, host: dict[str, np.ndarray], items: Sequence[Any], ends: Sequence[int]) -> None:
        text = host["text_ids"]
        text[:] = -1  # padding rows, and requests without a track
        row = 0
        for index, item in enumerate(items):
            track = item.request.text_track
            if track is None:
                continue
            text[ends[index]:ends[index + 1]] = track.ids(item.start, item.start + item.num_tokens)
            for offset, vector in self._vectors(item):
                host["vector_rows"][row] = ends[index] + offset
                host["vector_values"][row] = vector.float().numpy()
                row += 1

    def graph_inputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        return {"text_ids": ((), torch.long, -1)}

    def forward_inputs(self, device: dict[str, torch.Tensor]) -> dict[str, Any]:
        inputs: dict[str, Any] = {"text_ids": device["text_ids"]}
        if "vector_rows" in device:
            inputs["vectors"] = (device["vector_rows"], device["vector_values"])
        return inputs


def track_inputs(model: Any, layout: Any) -> NoTracks:
    """What the runner stages beside the tokens for ``layout`` on ``model``."""
    if layout.has_text_track:
        return TrackInputs(int(model.huggingface_config.hidden_size))
    return NoTracks()

"""What a step samples per position for a text stream (a layout's ``text_stream``: Kyutai TTS):
the backbone samples a text id; each row's request turns it into the position's token (its
``text_rule``, on the host: the reference reads each sampled text id back the same way); the model's
depth decoder then samples every audio code of the frame from that token. A step's samples are
[B, 1 + codes]: the token, then the frame; the next position embeds both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from audio_pipeline.core.depth import DepthSampling
from audio_pipeline.core.sampler import FLOAT_FIELDS, SamplingRows

#: The audio codes' top_k where a request's own top_k (which acts on the text) leaves them open:
#: the reference's.
AUDIO_TOP_K = 250


@dataclass
class TextStreamRows:
    """What the step's sampling rows need after the backbone's sample: the depth decoder's
    settings, and each row's request (its rule)."""

    depth: SamplingRows
    contexts: list[Any]


class TextStreamSampling(DepthSampling):
    """A text id from the backbone, the request's rule, then the whole frame from the depth decoder."""

    first_depth_code = 0

    def __init__(self, model: Any, codes: int, audio_codebook: int, *, sync_free: bool):
        super().__init__(model, codes, sync_free=sync_free)
        self.audio_codebook = audio_codebook

    def arrays(self, total: int, batch: int, codebook: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        arrays: dict[str, tuple[tuple[int, ...], Any]] = {"frames": ((total, self.codes), np.int64)}
        if batch:
            audio = self.audio_codebook
            arrays.update(depth_floats=((self.codes, len(FLOAT_FIELDS), batch), np.float32),
                          depth_top_k=((batch,), np.int64), depth_starts=((batch,), np.int64),
                          depth_extra=((batch, 1), np.int64), depth_blocked=((batch, audio + 1), np.bool_))
        return arrays

    def stage(self, host: dict[str, np.ndarray], contexts: list[Any], positions: np.ndarray,
              rows: SamplingRows, table: Any, slots: np.ndarray, draws: np.ndarray | None) -> TextStreamRows:
        """Each row's settings for its audio codes (the penalties off, the audio's own top_k), one
        uniform draw per code after the backbone's from the request's own generator."""
        depth = self._depth_rows(host, rows, table, slots, draws, self.audio_codebook,
                                 min(AUDIO_TOP_K, self.audio_codebook + 1))
        return TextStreamRows(depth, list(contexts))

    def capture(self, buckets: Sequence[int], **model: Any) -> None:
        """Nothing is captured: the rule runs on the host between the two samples."""

    def complete(self, ids: torch.Tensor, states: torch.Tensor, codes: torch.Tensor,
                 device: dict[str, torch.Tensor], rows: TextStreamRows | None) -> torch.Tensor:
        """[B, 1 + codes]: each row's token (its rule's answer to the sampled text id), then the
        frame the depth decoder samples from it."""
        fed = [context.text_rule.step(sampled) for context, sampled in zip(rows.contexts, ids.tolist())]
        tokens = torch.tensor(fed, dtype=ids.dtype, device=ids.device)
        return torch.cat([tokens[:, None], self.frames(states, tokens, device, rows.depth)], dim=1)


def text_stream_sampling(model: Any, layout: Any, *, sync_free: bool) -> TextStreamSampling:
    """The runner's sampling for a text stream's ``layout`` on ``model``."""
    return TextStreamSampling(model, layout.codes_per_token, layout.audio_codebook_size, sync_free=sync_free)

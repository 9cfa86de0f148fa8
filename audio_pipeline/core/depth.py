"""What a step samples per position: a token, or a whole frame with a depth decoder.

The model runner asks its :class:`PositionSampling` (chosen once per model, from the layout's
``codes_per_token``) for everything that differs between the two, so its own step has no frame
branches:

* :class:`TokenSampling` (one code per position: Orpheus, Maya1, NeuTTS, phoneme-lpc): a step's
  samples are [B] ids; nothing else travels.
* :class:`DepthSampling` (a frame per position: CSM, the frame voice): the backbone samples the
  frame's first code (the position's token id) and the model's depth decoder the others, each
  row with its own settings and draws; a step's samples are [B, 1 + codes] (the id, then the
  frame), and every position's input is its frame (``frames``: -1 rows for text positions), which
  later steps embed.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from audio_pipeline.core.sampler import FLOAT_FIELDS, NUCLEUS_PREFIX, DeviceSamplingRows, SamplingRows, sample_rows

logger = logging.getLogger(__name__)


class TokenSampling:
    """One code per position: the step samples token ids and nothing else."""

    #: Codes each position carries.
    codes = 1

    def ids_shape(self, rows: int) -> tuple[int, ...]:
        """The shape of a step's samples."""
        return (rows,)

    def arrays(self, total: int, batch: int, codebook: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Host arrays the step stages beside the tokens (name -> (shape, dtype))."""
        return {}

    def fill_inputs(self, host: dict[str, np.ndarray], items: Sequence[Any], ends: Sequence[int]) -> None:
        """The step's per-position inputs beside the token ids, into ``host``."""

    def graph_inputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        """The forward's other inputs a captured decode step takes (keyword -> (shape after the
        position, dtype, the value of a position without one))."""
        return {}

    def capture(self, buckets: Sequence[int], **model: Any) -> None:
        """Captures what follows the backbone's sample as CUDA graphs (nothing does here)."""

    def stage(self, host: dict[str, np.ndarray], contexts: list[Any], positions: np.ndarray,
              rows: SamplingRows, table: Any, slots: np.ndarray, draws: np.ndarray | None) -> SamplingRows | None:
        """The sampling rows of what follows the backbone's sample (None: nothing follows);
        ``table``: the runner's row table, ``slots`` the rows' slots in it, ``draws`` the sampling
        rows' uniform draws (the backbone's first)."""
        return None

    def chain(self, device: dict[str, torch.Tensor], rows: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        """Earlier steps' samples ``picked`` (for the positions ``rows``) as this step's token ids."""
        return picked

    def forward_inputs(self, device: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keyword inputs of the model's forward pass beside the token ids."""
        return {}

    def complete(self, ids: torch.Tensor, states: torch.Tensor, codes: torch.Tensor,
                 device: dict[str, torch.Tensor], rows: SamplingRows | None) -> torch.Tensor:
        """The step's samples from the backbone's sampled ``ids`` (``codes``: their codes)."""
        return ids


class DepthSampling(TokenSampling):
    """A frame per position: the model's ``depth_frame`` samples the codes after the backbone's."""

    #: The first codebook the depth decoder samples (the backbone's code is codebook 0).
    first_depth_code = 1

    def __init__(self, model: Any, codes: int, *, sync_free: bool):
        self.model, self.codes, self.sync_free = model, codes, sync_free
        #: The frame's captured CUDA graphs (core/depth_graphs.py; :meth:`capture`), else None.
        self.graphs = None

    def ids_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, 1 + self.codes)

    def arrays(self, total: int, batch: int, codebook: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        arrays: dict[str, tuple[tuple[int, ...], Any]] = {"frames": ((total, self.codes), np.int64)}
        if batch:
            arrays.update(depth_floats=((self.codes - 1, len(FLOAT_FIELDS), batch), np.float32),
                          depth_top_k=((batch,), np.int64), depth_starts=((batch,), np.int64),
                          depth_extra=((batch, 1), np.int64), depth_blocked=((batch, codebook + 1), np.bool_),
                          depth_fixed=((batch, self.codes), np.int64))
        return arrays

    def fill_inputs(self, host: dict[str, np.ndarray], items: Sequence[Any], ends: Sequence[int]) -> None:
        frames = host["frames"]
        frames[:] = -1
        for index, item in enumerate(items):
            self._item_frames(item, frames[ends[index]:ends[index + 1]])

    @staticmethod
    def _item_frames(item: Any, out: np.ndarray) -> None:
        """The frames of the item's positions known on the host into ``out`` (rows stay -1 for text
        positions, and for a sample still on the device: the step copies it there)."""
        request, start, end = item.request, item.start, item.start + item.num_tokens
        split = len(request.prompt_ids)
        if request.prompt_frames is not None and start < split:
            out[:min(end, split) - start] = request.prompt_frames[start:min(end, split)].numpy()
        known = [request.frames[i - split] for i in range(max(start, split), end) if i - split < len(request.frames)]
        if known:
            first = max(start, split) - start
            out[first:first + len(known)] = known

    def stage(self, host: dict[str, np.ndarray], contexts: list[Any], positions: np.ndarray,
              rows: SamplingRows, table: Any, slots: np.ndarray, draws: np.ndarray | None) -> SamplingRows:
        """The depth decoder's sampling rows: each row's settings (the penalties stay off: they count
        the backbone's codebook) and one uniform draw per codebook from the request's own generator,
        drawn after the backbone's (``draws``' later columns), so a seed gives the same frames
        whatever the batch. Also the frame codes each row's alignment fixes (``depth_fixed``, -1
        where none): gathered from the row table, asked row by row only of an alignment it does not
        list."""
        codebook = rows.codebook_size
        fixed = host["depth_fixed"]
        table.frame_codes(slots, positions, fixed)
        for row in np.flatnonzero(table.aligned[slots]).tolist():
            context = contexts[row]
            codes = context.alignment.frame_codes(int(positions[row]))
            if codes is not None:  # the alignment fixes some of this frame's codes
                fixed[row] = codes
        top_k = table.top_k[slots]
        return self._depth_rows(host, rows, table, slots, draws, codebook,
                                np.where((top_k > 0) & (top_k < codebook + 1), top_k, codebook + 1))

    def _depth_rows(self, host: dict[str, np.ndarray], rows: SamplingRows, table: Any, slots: np.ndarray,
                    draws: np.ndarray | None, codebook: int, top_k: np.ndarray | int) -> SamplingRows:
        """The depth decoder's sampling rows over ``codebook`` codes with ``top_k``: the backbone
        rows' settings, the penalties off, one of each row's draws per code it samples."""
        floats = host["depth_floats"]
        floats[:] = rows.floats[None]
        sampled = table.sampled[slots]
        if draws is not None and draws.shape[0]:
            depth = self.codes - self.first_depth_code
            floats[:, FLOAT_FIELDS.index("uniform"), np.flatnonzero(sampled)] = draws[:, 1:1 + depth].T
        host["depth_top_k"][:] = top_k
        host["depth_starts"][:] = 0
        host["depth_extra"][:] = 0
        host["depth_blocked"][:] = False
        host["depth_blocked"][:, codebook] = True  # the one (unused) extra column
        chosen = host["depth_top_k"][sampled]
        flags = dict(any_sampling=rows.any_sampling, penalized=False,
                     prefix_suffices=bool((chosen <= NUCLEUS_PREFIX).all()),
                     prefix_may_suffice=bool(((chosen <= NUCLEUS_PREFIX) | (chosen == codebook + 1)).all()))
        return SamplingRows(codebook, host["depth_starts"], host["depth_extra"], host["depth_blocked"], floats[0],
                            host["depth_top_k"], rows.frame_slots, **flags)

    def chain(self, device: dict[str, torch.Tensor], rows: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        device["frames"].index_copy_(0, rows, picked[:, 1:])
        return picked[:, 0]

    def forward_inputs(self, device: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"frames": device["frames"]}

    def graph_inputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        return {"frames": ((self.codes,), torch.long, -1)}

    def capture(self, buckets: Sequence[int], *, hidden_size: int, dtype: torch.dtype, device: torch.device,
                codebook: int) -> None:
        """Captures the depth decoder's frame as CUDA graphs for ``buckets`` (core/depth_graphs.py).
        A model whose frame cannot be captured runs it eagerly, with a warning that says why:
        slower, never wrong (measured on Qwen3-TTS; CSM's and the frame voice's frames have not been
        captured on a GPU yet)."""
        from audio_pipeline.core.depth_graphs import DepthGraphs

        try:
            self.graphs = DepthGraphs(self, buckets, hidden_size=hidden_size, dtype=dtype, device=device,
                                      codebook=codebook)
        except RuntimeError as error:
            torch.cuda.synchronize(device)
            logger.warning("CUDA graphs: the depth decoder's frame runs eagerly (its capture failed: %s)", error)

    def frames(self, states: torch.Tensor, codes: torch.Tensor, inputs: dict[str, torch.Tensor],
               rows: SamplingRows) -> torch.Tensor:
        """[B, codes] frames from the model's depth decoder, each codebook sampled with the rows'
        depth settings and draws (``inputs``: the depth_* arrays :meth:`stage` fills, on the device;
        ``rows``: what decides the sampling rule)."""
        codebook = rows.codebook_size
        top_k = inputs["depth_top_k"]
        no_counts = torch.zeros(1, device=states.device)

        first = self.first_depth_code

        def choose(k: int, logits: torch.Tensor) -> torch.Tensor:
            scores = torch.cat([logits[:, :codebook].float(), logits.new_zeros(logits.shape[0], 1).float()], dim=1)
            device_rows = DeviceSamplingRows(inputs["depth_starts"], inputs["depth_extra"], inputs["depth_blocked"],
                                             inputs["depth_floats"][k - first], top_k)
            return sample_rows(scores, rows, device_rows, no_counts, sync_free=self.sync_free)

        return self.model.depth_frame(states, codes, choose)

    def complete(self, ids: torch.Tensor, states: torch.Tensor, codes: torch.Tensor,
                 device: dict[str, torch.Tensor], rows: SamplingRows | None) -> torch.Tensor:
        """[B, 1 + codes]: each row's id, then its frame: the depth decoder's codebooks after the
        backbone's code, sampled with each row's settings and draws (:meth:`stage`'s ``rows``),
        replayed from a captured graph where one fits."""
        frames = self.graphs.run(states, codes, device, rows) if self.graphs is not None else None
        if frames is None:
            frames = self.frames(states, codes, device, rows)
        fixed = device["depth_fixed"]
        frames = torch.where(fixed >= 0, fixed, frames)
        return torch.cat([ids[:, None], frames], dim=1)


def position_sampling(model: Any, layout: Any, *, sync_free: bool) -> TokenSampling:
    """What the runner samples per position for ``layout`` on ``model`` (a text stream's:
    core/text_stream.py)."""
    if layout.codes_per_token > 1:
        return DepthSampling(model, layout.codes_per_token, sync_free=sync_free)
    return TokenSampling()

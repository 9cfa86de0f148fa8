"""What the built-in voices' vocoders (``lpc``, ``mcep``) share: 4-code frames ``[phoneme,
context, envelope, prosody]`` whose alignment codes are ignored, an envelope codebook, a prosody
code ``f0 * gain_levels + gain``, weights as a directory with ``config.json`` and
``envelope_codebook.npy``, and synthesis on a per-stream state that every block carries on from
(``causal_state``: streaming equals one-shot decoding exactly).

A subclass sets ``name`` and ``DEFAULT_CONFIG``, and implements ``init_state()`` and
``_synthesize(frames, state)`` (frames: [F, 4] int64; the state is updated in place).
"""

from __future__ import annotations

import copy
import json
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from audio_pipeline.decoders.base import AudioDecoder


def level_value(codes: np.ndarray, bounds: tuple[float, float], levels: int) -> np.ndarray:
    """The value of level ``codes`` of ``levels`` evenly spaced from bounds[0] to bounds[1]."""
    lo, hi = bounds
    return lo + np.asarray(codes) / (levels - 1) * (hi - lo)


class CodebookVocoder(AudioDecoder):
    tokens_per_frame = 4
    supports_block_causal = True
    causal_state = True
    DEFAULT_CONFIG: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: dict[str, Any], codebook: np.ndarray, width: int, layout: str):
        """``width``: the codebook's columns; ``layout``: what they are, for the error message."""
        self.config = config
        self.sample_rate = int(config["sample_rate"])
        self.samples_per_frame = int(config["hop"])
        self.order = int(config["order"])
        if codebook.ndim != 2 or codebook.shape[1] != width:
            raise ValueError(f"audio_decoder_weights: the envelope codebook must be [size, {width}]{layout}, "
                             f"got {list(codebook.shape)}")
        self.codebook = codebook.astype(np.float64)
        self.codebook_size = codebook.shape[0]
        self.f0_levels = int(config["f0_levels"])
        self.gain_levels = int(config["gain_levels"])
        # Streams decode every block on the state the one before left (causal_state): no window
        # ever restarts, so the receptive field only matters to callers that ask.
        self.receptive_field_frames = 2

    @classmethod
    def load(cls, weights: str, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "CodebookVocoder":
        path = Path(weights)
        if not (path / "config.json").is_file() or not (path / "envelope_codebook.npy").is_file():
            raise ValueError(f"audio_decoder_weights: {path} must hold config.json and envelope_codebook.npy")
        merged = {**cls.DEFAULT_CONFIG, **json.loads((path / "config.json").read_text()), **(config or {})}
        return cls(merged, np.load(path / "envelope_codebook.npy"))

    @abstractmethod
    def init_state(self) -> Any:
        """A new stream's state."""

    @abstractmethod
    def _synthesize(self, frames: np.ndarray, state: Any) -> np.ndarray:
        """float32 audio of ``frames`` ([F, 4] codes), continuing ``state`` (updated in place)."""

    def _check(self, codes: torch.Tensor) -> np.ndarray:
        self.check_codes(codes)
        frames = codes.detach().cpu().numpy().astype(np.int64).reshape(-1, self.tokens_per_frame)
        for column, limit in enumerate(self.code_limits()):
            if column < 2:
                continue  # the alignment codes: the language model's, any value
            values = frames[:, column]
            if values.size and (values.min() < 0 or values.max() >= limit):
                raise ValueError(f"code out of range at frame position {column}: must be in [0, {limit})")
        return frames

    def code_limits(self) -> list[int]:
        """The alignment codes take any value (bounded here by the envelope codebook's size, for
        whoever draws codes); the envelope is a codebook entry; the prosody code is ``f0 *
        gain_levels + gain`` with f0 0 (unvoiced) to f0_levels."""
        return [self.codebook_size] * 3 + [(self.f0_levels + 1) * self.gain_levels]

    def prosody(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(F0 level, 0 for unvoiced; gain level) of each frame's prosody code."""
        return np.divmod(frames[:, 3], self.gain_levels)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._synthesize(self._check(codes), self.init_state()))

    def decode_blocks(self, blocks: list[torch.Tensor], states: list[Any]) -> list[tuple[torch.Tensor, Any]]:
        """Each block on its stream's state (states are not modified; new ones are returned)."""
        out = []
        for codes, state in zip(blocks, states):
            state = copy.deepcopy(state) if state is not None else self.init_state()
            out.append((torch.from_numpy(self._synthesize(self._check(codes), state)), state))
        return out


def save_codebook_vocoder(path: str | Path, codebook: np.ndarray, config: dict[str, Any],
                          dtype: type = np.float32) -> Path:
    """Writes a vocoder directory (config.json + envelope_codebook.npy)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    np.save(path / "envelope_codebook.npy", np.asarray(codebook, dtype=dtype))
    return path

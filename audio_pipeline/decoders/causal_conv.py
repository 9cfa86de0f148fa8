"""A small causal convolutional decoder ("causal-conv"): every output sample depends only on codes at
or before its frame, so block-causal streaming is exact.

Layout (all convolutions causal: left padding only):

- each frame's ``tokens_per_frame`` codes are embedded (one table per frame position) and summed;
- ``frame_layers`` residual causal convolutions at the frame rate;
- for each entry of ``upsample``: a transposed convolution with kernel == stride (no overlap, so
  no state), then a residual causal convolution;
- a causal convolution to one channel and ``tanh``.

Streaming state is, per causal convolution, the last ``(kernel - 1) * dilation`` input columns; a
block decoded from a state gives exactly the samples a one-shot decode gives for those frames.

Weights: a directory with ``config.json`` and ``model.safetensors`` (see
audio_pipeline.testing.random_decoders.save_random_causal_checkpoint writes a random one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.registry import register_audio_decoder

DEFAULT_CONFIG: dict[str, Any] = {
    "tokens_per_frame": 7,
    "codebook_size": 4096,
    "sample_rate": 24000,
    "dim": 16,
    "frame_layers": [[3, 1], [3, 2]],  # (kernel, dilation)
    "upsample": [8, 8, 4, 8],
    "upsample_kernel": 3,
    "out_kernel": 5,
}

State = list[torch.Tensor]


class CausalConv(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation)
        self.history = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, C, T]; state: [B, C, history] (None: zeros). Returns (y [B, out, T], new state)."""
        if state is None:
            state = x.new_zeros(x.shape[0], x.shape[1], self.history)
        full = torch.cat([state, x], dim=2)
        return self.conv(full), full[:, :, full.shape[2] - self.history:]


class CausalConvDecoder(AudioDecoder):
    name = "causal-conv"
    tokens_per_frame = 7
    supports_block_causal = True

    def __init__(self, config: dict[str, Any], device: torch.device, dtype: torch.dtype):
        self.config = config
        # The class says 7 (the Orpheus layout); a checkpoint may choose otherwise.
        self.tokens_per_frame = int(config["tokens_per_frame"])  # type: ignore[misc]
        self.codebook_size = int(config["codebook_size"])
        self.sample_rate = int(config["sample_rate"])
        self.samples_per_frame = math.prod(config["upsample"])
        dim = int(config["dim"])
        self.device, self.dtype = device, dtype
        self.embed = nn.Embedding(self.tokens_per_frame * self.codebook_size, dim)
        self.frame_convs = nn.ModuleList(CausalConv(dim, dim, k, d) for k, d in config["frame_layers"])
        self.ups = nn.ModuleList(nn.ConvTranspose1d(dim, dim, s, stride=s) for s in config["upsample"])
        self.up_convs = nn.ModuleList(CausalConv(dim, dim, int(config["upsample_kernel"])) for _ in config["upsample"])
        self.out = CausalConv(dim, 1, int(config["out_kernel"]))
        self.modules = nn.ModuleDict({"embed": self.embed, "frame_convs": self.frame_convs, "ups": self.ups,
                                      "up_convs": self.up_convs, "out": self.out}).to(device, dtype).eval()
        # Left context, in frames, that can still change a frame's audio (the receptive field).
        frame_history = sum(c.history for c in self.frame_convs)
        sample_history = sum(c.history for c in self.up_convs) + self.out.history
        self.receptive_field_frames = frame_history + math.ceil(sample_history / self.samples_per_frame)

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def load(cls, weights: str, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "CausalConvDecoder":
        path = Path(weights)
        config_path = path / "config.json"
        weights_path = path / "model.safetensors"
        if not config_path.is_file() or not weights_path.is_file():
            raise ValueError(f"audio_decoder_weights: {path} must hold config.json and model.safetensors")
        merged = {**DEFAULT_CONFIG, **json.loads(config_path.read_text()), **(config or {})}
        decoder = cls(merged, torch.device(device), dtype)
        state = load_file(str(weights_path))
        missing, unexpected = decoder.modules.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"audio_decoder_weights: {weights_path} does not match its config "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
        return decoder

    # --- decoding ------------------------------------------------------------------------------

    def _check(self, codes: torch.Tensor) -> None:
        self.check_code_values(codes, self.codebook_size)

    def init_state(self) -> State | None:
        """The state before any block: None (zeros, as at the start of a one-shot decode)."""
        return None

    @torch.inference_mode()
    def _run(self, codes: torch.Tensor, states: list[State | None]) -> tuple[torch.Tensor, list[State]]:
        """codes: [B, frames * tokens_per_frame]; returns waves [B, samples] and the new states."""
        batch = codes.shape[0]
        frames = codes.shape[1] // self.tokens_per_frame
        offsets = torch.arange(self.tokens_per_frame, device=codes.device) * self.codebook_size
        ids = codes.view(batch, frames, self.tokens_per_frame) + offsets
        x = self.embed(ids).sum(dim=2).transpose(1, 2)  # [B, dim, frames]
        convs = [*self.frame_convs, *self.up_convs, self.out]

        def layer_state(index: int) -> torch.Tensor | None:
            if all(s is None for s in states):
                return None
            conv = convs[index]
            parts = [s[index] if s is not None else x.new_zeros(x.shape[1], conv.history) for s in states]
            return torch.stack(parts)

        new_states: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        index = 0
        for conv in self.frame_convs:
            y, tail = conv(x, layer_state(index))
            x = x + torch.tanh(y)
            for b in range(batch):
                new_states[b].append(tail[b])
            index += 1
        for up, conv in zip(self.ups, self.up_convs):
            x = F.leaky_relu(up(x), 0.1)
            y, tail = conv(x, layer_state(index))
            x = x + torch.tanh(y)
            for b in range(batch):
                new_states[b].append(tail[b])
            index += 1
        y, tail = self.out(x, layer_state(index))
        for b in range(batch):
            new_states[b].append(tail[b])
        return torch.tanh(y[:, 0, :]), new_states

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        self._check(codes)
        wave, _ = self._run(codes.to(self.device)[None], [None])
        return wave[0].float()

    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [wave for wave, _ in self.decode_blocks(batch, [None] * len(batch))]

    def decode_blocks(self, blocks: list[torch.Tensor], states: list[State | None]) -> list[tuple[torch.Tensor, State]]:
        """Decodes each block from its stream's state; returns (audio of the block, the new state).

        Blocks of equal length run as one batch."""
        results: list[tuple[torch.Tensor, State] | None] = [None] * len(blocks)
        groups: dict[int, list[int]] = {}
        for i, codes in enumerate(blocks):
            self._check(codes)
            groups.setdefault(codes.numel(), []).append(i)
        for members in groups.values():
            stacked = torch.stack([blocks[i].to(self.device) for i in members])
            waves, new_states = self._run(stacked, [states[i] for i in members])
            for row, i in enumerate(members):
                # clone: views would keep the whole batch's activations alive with the state
                results[i] = (waves[row].float(), [t.clone() for t in new_states[row]])
        return results  # type: ignore[return-value]


register_audio_decoder(CausalConvDecoder)

"""NeuCodec audio decoder (Neuphonic's codec, the one NeuTTS Air speaks), on transformers' NeuCodec
modules.

Codes
    One code per frame from a single finite-scalar codebook (65,536 codes for the published
    checkpoint: ``quantization_levels`` [4] * 8), 50 frames a second. A frame decodes to 480 samples
    at 24 kHz (``output_sampling_rate``); audio is encoded from 16 kHz (``input_sampling_rate``),
    320 samples a frame.

Weights
    A NeuCodec directory as transformers writes it (``config.json`` with ``model_type: neucodec``
    and safetensors under ``NeuCodecModel``'s module names). Decoding reads the quantizer's and the
    acoustic decoder's tensors only; the encoder (the semantic model, its adapter, the acoustic
    encoder) is read on the first :meth:`NeuCodecDecoder.encode`, so a server that never clones
    does not hold it.

Not causal
    The decoder's transformer attends over its whole input both ways, and its ResNet blocks'
    group norms take statistics over the whole input too: every frame's audio depends on every
    code of the call (``receptive_field_frames`` is unbounded). Decoding a stream in pieces
    therefore differs from decoding it whole, a little, and most near the pieces' ends; streams
    give it left context (``buffer``) and the voice's reference codes (the prepend modes) instead
    of decoding block by block (no ``block_causal``).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import soxr
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, NeuCodecConfig, SeamlessM4TFeatureExtractor
from transformers.models.neucodec.modeling_neucodec import (
    NeuCodecDecoder as NeuCodecAcousticDecoder,
    NeuCodecEncoder,
    NeuCodecQuantizer,
    NeuCodecSemanticAdapter,
)

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.registry import register_audio_decoder
from audio_pipeline.models.weights import load_strict, read_config_json

__all__ = ["NeuCodecDecoder"]

#: The parts of NeuCodecModel, by the prefix of their tensors: what decoding reads, what encoding adds.
DECODING_PARTS = ("quantizer", "acoustic_decoder")
ENCODING_PARTS = ("semantic_encoder", "semantic_adapter", "acoustic_encoder", "fc_encoder")


def _semantic_features() -> SeamlessM4TFeatureExtractor:
    """The semantic model's input features: w2v-BERT 2.0's own extractor (80 log-mel bins at 16 kHz,
    two frames stacked per step), the one the reference encoder calls; numpy only."""
    return SeamlessM4TFeatureExtractor(feature_size=80, num_mel_bins=80, stride=2, padding_value=1.0,
                                       sampling_rate=16000)


def _read_config(directory: Path) -> NeuCodecConfig:
    raw = read_config_json(directory, "NeuCodec")
    if not isinstance(raw, dict) or raw.get("model_type") != "neucodec":
        raise ValueError(f"{directory / 'config.json'}: not a NeuCodec config (model_type must be 'neucodec')")
    return NeuCodecConfig.from_dict(raw, attn_implementation="sdpa")


def _load_parts(container: nn.Module, files: list[Path], parts: tuple[str, ...]) -> None:
    """Loads the tensors of ``parts`` (their prefixes in the checkpoint) into ``container``'s
    modules of the same names; ValueError naming what is missing, unexpected or of another shape."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.split(".", 1)[0] in parts:
                    tensors[key] = f.get_tensor(key)
    load_strict(container, tensors, f"{files[0].parent}: the NeuCodec {', '.join(parts)}")


@register_audio_decoder
class NeuCodecDecoder(AudioDecoder):
    """NeuCodec codes (one per frame) -> 24 kHz waveform, and back (encode)."""

    name = "neucodec"
    tokens_per_frame = 1
    supports_encoding = True
    #: See the module docstring: attention and group norms span the whole input.
    receptive_field_frames = math.inf

    def __init__(self, config: NeuCodecConfig, parts: nn.Module, *, files: list[Path], device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.parts = parts
        self.files = files
        self.device, self.dtype = device, dtype
        self.codebook_size = math.prod(config.quantization_levels)
        self.sample_rate = config.output_sampling_rate
        self.samples_per_frame = config.hop_length
        #: Encoder input: its rate and samples per frame.
        self.encode_rate = config.input_sampling_rate
        self.encode_hop = config.encoder_hop_length
        self._encoder_lock = threading.Lock()
        self._encoder_loaded = False
        self._features = _semantic_features()

    @classmethod
    def load(cls, weights: str | Path, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "NeuCodecDecoder":
        """Loads the decoding half of a NeuCodec directory (see the module docstring); nothing is fetched."""
        if config:
            raise ValueError(f"unknown NeuCodec decoder settings {sorted(config)}; it takes none")
        directory = Path(weights)
        if not directory.is_dir():
            raise FileNotFoundError(f"NeuCodec weights must be a directory (config.json and safetensors): {directory}")
        model_config = _read_config(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {directory}")
        parts = nn.Module()
        parts.quantizer = NeuCodecQuantizer(model_config)
        parts.acoustic_decoder = NeuCodecAcousticDecoder(model_config)
        _load_parts(parts, files, DECODING_PARTS)
        device = torch.device(device)
        parts.to(device=device, dtype=dtype).eval().requires_grad_(False)
        return cls(model_config, parts, files=files, device=device, dtype=dtype)

    # ---- decoding ------------------------------------------------------------------------

    def _validate(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codes_on_device(codes)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``frames * 480`` samples of the codes, as NeuCodecModel.decode, clamped to [-1, 1]."""
        return self.decode_batch([codes])[0]

    @torch.inference_mode()
    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decodes independent streams; streams of equal length run as one batch. Others are not
        padded to one: the attention could mask the padding, the group norms and convolutions would
        still see it."""
        checked = [self._validate(c) for c in batch]
        groups: dict[int, list[int]] = {}
        for i, codes in enumerate(checked):
            groups.setdefault(codes.numel(), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for members in groups.values():
            latents = self.parts.quantizer.from_codes(torch.stack([checked[i] for i in members])[:, :, None])
            audio = self.parts.acoustic_decoder(latents)[:, 0].float().clamp_(-1.0, 1.0).cpu()
            for row, i in enumerate(members):
                out[i] = audio[row]
        return out  # type: ignore[return-value]

    # ---- encoding ------------------------------------------------------------------------

    def _encoder(self) -> nn.Module:
        """The parts encoding needs, read on first use (the quantizer is the decoding one's)."""
        with self._encoder_lock:
            if not self._encoder_loaded:
                config, encoder = self.config, nn.Module()
                width = config.hidden_size + config.semantic_model_config.hidden_size
                encoder.semantic_encoder = AutoModel.from_config(config.semantic_model_config)
                encoder.semantic_adapter = NeuCodecSemanticAdapter(config)
                encoder.acoustic_encoder = NeuCodecEncoder(config)
                encoder.fc_encoder = nn.Linear(width, width)
                _load_parts(encoder, self.files, ENCODING_PARTS)
                for name, module in encoder.named_children():
                    self.parts.add_module(name, module.to(device=self.device, dtype=self.dtype).eval()
                                          .requires_grad_(False))
                self._encoder_loaded = True
            return self.parts

    def prepare(self, waveform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder input at 16 kHz, (1, 1, samples); semantic features, (1, steps, 160)) of a 1-D
        waveform at ``sample_rate``. As the reference encoder: the 16 kHz audio padded with 1 to 320
        zeros to whole frames, the features computed from the padded audio."""
        self.check_waveform(waveform)
        audio = waveform.detach().float().cpu().numpy()
        if self.sample_rate != self.encode_rate:
            audio = soxr.resample(audio, self.sample_rate, self.encode_rate, quality="HQ").astype(np.float32)
        audio = np.pad(audio, (0, self.encode_hop - audio.size % self.encode_hop))
        features = self._features(audio, sampling_rate=self.encode_rate, return_tensors="pt").input_features
        return torch.from_numpy(audio)[None, None], features

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """1-D waveform at ``sample_rate`` -> one code per 20 ms (1-D long, CPU): NeuCodecModel.encode
        of :meth:`prepare`'s inputs."""
        audio, features = self.prepare(waveform)
        parts = self._encoder()
        audio, features = audio.to(self.device, self.dtype), features.to(self.device, self.dtype)
        semantic = parts.semantic_adapter(parts.semantic_encoder(features).last_hidden_state.transpose(1, 2))
        acoustic = parts.acoustic_encoder(audio)
        # The two branches downsample separately and may differ by a frame: the shorter one counts.
        frames = min(semantic.shape[-1], acoustic.shape[-1])
        hidden = parts.fc_encoder(torch.cat([semantic[..., :frames], acoustic[..., :frames]], dim=1).transpose(1, 2))
        _, indices = parts.quantizer(hidden)  # (1, frames, 1)
        return indices[0, :, 0].long().cpu()

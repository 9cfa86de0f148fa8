"""Qwen3-TTS 12 Hz speech tokenizer ("qwen3-tts-12hz"): the codec Qwen3-TTS speaks, in plain torch.

Codes
    A frame is one code per codebook (16 in the published checkpoints, 2048 codes each), codebook 0
    first; codes are frame-major, ``[f0k0, ..., f0k15, f1k0, ...]``. A frame is 1920 samples at
    24 kHz (12.5 frames/s): ``samples_per_frame`` is the product of the decoder's
    ``upsampling_ratios`` and ``upsample_rates``, read from the checkpoint like everything else.
    The reference's ``decode()`` takes -1 as padding in a batch (decoded as code 0, its audio cut
    off); streams here are never padded, so every code must be in ``[0, codebook_size)``.

Weights
    The speech tokenizer directory (``config.json`` with ``model_type: qwen3_tts_tokenizer_12hz``
    and safetensors), or a Qwen3-TTS model directory holding it in ``speech_tokenizer/``. Decoding
    reads the ``decoder.*`` tensors; the encoder (``encoder.*``, a Mimi encoder under transformers'
    names) is read on the first :meth:`Qwen3TTS12HzDecoder.encode`, so a server that never clones
    does not hold it.

Decoder
    Dequantise (codebook 0 and the sum of codebooks 1-15 each projected, then added), a causal
    convolution, a transformer over frames with a 72-frame sliding window, two ConvNeXt upsamplers
    and a causal convolutional vocoder (SnakeBeta activations, transposed convolutions, dilated
    residual units). Every layer is causal, which gives the streaming below.

Streaming
    A stream's state holds what the causal layers need and nothing more, so it does not grow with
    the stream: each causal convolution's last ``(kernel - 1) * dilation`` inputs (zeros at the
    start, the one-shot decode's left padding); each overlapping transposed convolution's outputs
    that reach past the block (its right trim in the one-shot decode), less the bias that the next
    block adds; each transformer layer's keys and values of the last ``sliding_window - 1`` frames.
    Keys are kept before their rotary rotation and rotated each call at positions counted from the
    oldest one kept: the rotation is relative, so this equals the one-shot decode's absolute
    positions while positions stay small however long the stream runs.

    Block after block therefore equals the whole-sequence forward up to float rounding (a few 1e-6),
    each block yielding exactly its frames' samples (``causal_state``). Blocks of different lengths
    run as one batch, right-padded to the longest: a causal layer's padding only reaches positions
    after the row's own, which are dropped, and each row's state is taken at its own end.
    ``decode`` and ``decode_batch`` are the same path from a fresh state, in pieces of at most
    300 frames (the reference's chunk, bounding memory as it does).

    The reference's ``decode()`` restarts every 300 frames with 25 frames of context, which drops
    older context and differs from the whole-sequence forward (by up to 0.04 on the tiny test
    checkpoint) after the first 300 frames; the engine streams the whole-sequence result instead.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import MimiConfig
from transformers.models.mimi.modeling_mimi import MimiEncoderModel, MimiSplitResidualVectorQuantizer

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.qwen3_tts_12hz_layers import CausalConv, DecoderNet, StreamPass
from audio_pipeline.decoders.registry import register_audio_decoder
from audio_pipeline.models.weights import load_strict, read_config_json

__all__ = ["Qwen3TTS12HzDecoder", "Qwen3TTS12HzState"]

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
#: Frames decoded per forward at most: the reference's chunk (its activations' memory).
PIECE_FRAMES = 300
#: Where the encoder's stored tensors go in transformers' Mimi modules (stored prefix, part, ours).
_ENCODER_LAYOUT = (("encoder.encoder.", "encoder", "encoder_seanet."),
                   ("encoder.encoder_transformer.", "encoder", "encoder_transformer."),
                   ("encoder.downsample.", "encoder", "downsample."),
                   ("encoder.quantizer.", "quantizer", ""))


def _read_tokenizer_config(weights: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the speech tokenizer directory, its config): ``weights`` itself, or a Qwen3-TTS model's
    ``speech_tokenizer/``."""
    directory = Path(weights)
    if not directory.is_dir():
        raise FileNotFoundError(f"Qwen3-TTS 12 Hz weights must be a directory (the speech tokenizer, or a "
                                f"Qwen3-TTS model holding it in speech_tokenizer/): {directory}")
    raw = read_config_json(directory, "Qwen3-TTS speech tokenizer") if (directory / "config.json").is_file() else None
    if (not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE) and (directory / "speech_tokenizer").is_dir():
        directory = directory / "speech_tokenizer"
        raw = read_config_json(directory, "Qwen3-TTS speech tokenizer")
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind != MODEL_TYPE:
        raise ValueError(f"{directory}: not a Qwen3-TTS 12 Hz speech tokenizer (config.json's model_type is {kind!r}, "
                         f"expected {MODEL_TYPE!r}), and no speech_tokenizer/ directory holding one")
    if not isinstance(raw.get("decoder_config"), dict) or not isinstance(raw.get("encoder_config"), dict):
        raise ValueError(f"{directory / 'config.json'}: decoder_config and encoder_config must be objects")
    return directory, raw


def _read_tensors(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    tensors[key] = f.get_tensor(key)
    return tensors


def _decoder_tensors(stored: dict[str, torch.Tensor], codebooks: int, source: Path) -> dict[str, torch.Tensor]:
    """The stored ``decoder.*`` tensors under DecoderNet's names. The quantizer's ``input_proj``
    (the encoding direction) is not needed to decode."""
    tensors, usages, sums = {}, {}, {}
    for key, tensor in stored.items():
        name = key[len("decoder."):]
        part, _, rest = name.partition(".")
        if part != "quantizer":
            tensors[name] = tensor
            continue
        group, _, rest = rest.partition(".")
        first = {"rvq_first": 0, "rvq_rest": 1}.get(group)
        if first is None:
            tensors[name] = tensor  # load_strict names it
        elif rest == "output_proj.weight":
            tensors["quantizer.first_proj.weight" if first == 0 else "quantizer.rest_proj.weight"] = tensor
        elif rest.startswith("vq.layers.") and rest.endswith(("._codebook.embedding_sum", "._codebook.cluster_usage")):
            index = first + int(rest.split(".")[2])
            (sums if rest.endswith("embedding_sum") else usages)[index] = tensor
        elif rest != "input_proj.weight":
            tensors[name] = tensor
    if sorted(sums) != list(range(codebooks)) or sorted(usages) != list(range(codebooks)):
        raise ValueError(f"{source}: the decoder's codebooks: config.json says {codebooks}, the checkpoint has "
                         f"{len(sums)} embedding_sum and {len(usages)} cluster_usage tensors")
    tensors["quantizer.embeddings"] = torch.stack(
        [sums[k].float() / usages[k].float().clamp(min=1e-5)[:, None] for k in range(codebooks)])
    return tensors


#: decoder_config fields the network is built from (hidden_act and attention_bias have defaults).
_DECODER_FIELDS = ("num_quantizers", "codebook_size", "codebook_dim", "latent_dim", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                   "rope_theta", "sliding_window", "upsampling_ratios", "upsample_rates", "decoder_dim")


def _check_config(raw: dict[str, Any], source: Path) -> None:
    cfg = raw["decoder_config"]
    missing = [field for field in _DECODER_FIELDS if field not in cfg]
    if missing:
        raise ValueError(f"{source / 'config.json'}: decoder_config lacks {', '.join(missing)}")
    made = math.prod(cfg["upsampling_ratios"]) * math.prod(cfg["upsample_rates"])
    problems = [why for wrong, why in (
        (raw.get("decode_upsample_rate", made) != made,
         f"decode_upsample_rate {raw.get('decode_upsample_rate')} is not the {made} samples a frame decodes to"),
        (not cfg["sliding_window"], "decoder_config.sliding_window must be set (the stream state keeps that window)"),
        (cfg.get("hidden_act", "silu") != "silu", "decoder_config.hidden_act must be silu"),
        (cfg["num_attention_heads"] % cfg["num_key_value_heads"],
         "num_attention_heads must be a multiple of num_key_value_heads"),
        (raw.get("input_sample_rate", 24000) != raw.get("output_sample_rate", 24000),
         "input_sample_rate and output_sample_rate must agree (the engine clones at the decoder's rate)"),
        (raw.get("encoder_valid_num_quantizers", cfg["num_quantizers"]) != cfg["num_quantizers"],
         "encoder_valid_num_quantizers must be the decoder's num_quantizers (encode gives what decode takes)"),
    ) if wrong]
    if problems:
        raise ValueError(f"{source}: unsupported Qwen3-TTS 12 Hz speech tokenizer config: {'; '.join(problems)}")


# --------------------------------------------------------------------------------------------
# the decoder


@dataclass(frozen=True)
class Qwen3TTS12HzState:
    """One stream's state after the frames decoded so far (see the module docstring); its size is
    bounded whatever the stream's length. Two tensors, this stream's alone (no batch dimension: a
    block's states cost two copies a stream, not one per layer), never modified: each block makes
    a new state."""

    #: Every stateful convolution's tensor, in DecoderNet.stateful order, flattened and concatenated:
    #: a causal one's last inputs, or a transposed one's outputs reaching into the next block.
    conv_data: torch.Tensor
    #: The transformer layers' unrotated keys and values of the last ``min(frames, sliding_window -
    #: 1)`` frames: (layers, 2, kv_heads, frames kept, head_dim).
    cache: torch.Tensor
    #: (channels, width) of each convolution's part of ``conv_data``.
    conv_shapes: tuple[tuple[int, int], ...]

    @property
    def kept(self) -> int:
        """Frames whose keys and values are kept."""
        return self.cache.shape[3]

    @property
    def convs(self) -> tuple[torch.Tensor, ...]:
        """Each stateful convolution's part, (channels, width)."""
        sizes = [channels * width for channels, width in self.conv_shapes]
        return tuple(part.view(shape) for part, shape in zip(self.conv_data.split(sizes), self.conv_shapes))

    @property
    def keys(self) -> tuple[torch.Tensor, ...]:
        """Per layer, (kv_heads, frames kept, head_dim)."""
        return tuple(self.cache[:, 0].unbind(0))

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.cache[:, 1].unbind(0))


@register_audio_decoder
class Qwen3TTS12HzDecoder(AudioDecoder):
    """Qwen3-TTS 12 Hz codes (``tokens_per_frame`` codebooks, frame-major) -> 24 kHz waveform, and back (encode)."""

    name = "qwen3-tts-12hz"
    #: The published checkpoints'; each instance says its checkpoint's.
    tokens_per_frame = 16
    supports_block_causal = True
    causal_state = True
    supports_encoding = True

    def __init__(self, raw: dict[str, Any], net: DecoderNet, *, files: list[Path], device: torch.device,
                 dtype: torch.dtype):
        self.config, self.net, self._files = raw, net, files
        cfg = raw["decoder_config"]
        self.tokens_per_frame = cfg["num_quantizers"]
        self.codebook_size = cfg["codebook_size"]
        self.sample_rate = int(raw.get("output_sample_rate", 24000))
        self.samples_per_frame = net.samples_per_frame
        self.window = cfg["sliding_window"]
        self.receptive_field_frames = net.lookback_frames()
        self.device, self.dtype = device, dtype
        self._encoder_parts: nn.Module | None = None
        self._encoder_lock = threading.Lock()
        #: (channels, width) of each stateful convolution's state.
        self._conv_shapes = tuple((layer.conv.in_channels, layer.history) if isinstance(layer, CausalConv)
                                  else (layer.conv.out_channels, layer.overlap) for layer in net.stateful)
        #: Where each one's part starts in a state's conv_data, and where the last ends.
        self._conv_offsets = [0]
        for channels, width in self._conv_shapes:
            self._conv_offsets.append(self._conv_offsets[-1] + channels * width)

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, weights: str | Path, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Qwen3TTS12HzDecoder":
        """Loads a speech tokenizer directory, or a Qwen3-TTS model directory holding one in
        ``speech_tokenizer/``; nothing is fetched. It takes no settings."""
        if config:
            raise ValueError(f"unknown qwen3-tts-12hz decoder settings {sorted(config)}; it takes none")
        directory, raw = _read_tokenizer_config(weights)
        _check_config(raw, directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {directory}")
        net = DecoderNet(raw["decoder_config"])
        stored = _read_tensors(files, "decoder.")
        load_strict(net, _decoder_tensors(stored, raw["decoder_config"]["num_quantizers"], directory),
                    f"{directory}: the Qwen3-TTS 12 Hz decoder")
        device = torch.device(device)
        net.to(device=device, dtype=dtype).eval().requires_grad_(False)
        net.freeze()
        return cls(raw, net, files=files, device=device, dtype=dtype)

    # ---- decoding ------------------------------------------------------------------------

    def _validate(self, codes: torch.Tensor) -> torch.Tensor:
        """Checked codes as (codebooks, frames) on the device."""
        frame = self.tokens_per_frame
        if isinstance(codes, torch.Tensor) and codes.dim() == 2:
            raise ValueError(f"codes must be 1-D and frame-major ({frame} codes a frame: a (frames, {frame}) "
                             f"array flattened), got shape {tuple(codes.shape)}")
        return self.codes_on_device(codes, lambda pos: f"frame {pos // frame}, codebook {pos % frame}").view(-1, frame).T

    @torch.inference_mode()
    @torch.inference_mode()
    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decodes independent sequences in one batch, each as if alone."""
        return [audio for audio, _ in self.decode_blocks(batch, [self.init_state() for _ in batch])]

    # ---- block-causal decoding -------------------------------------------------------------

    def init_state(self) -> Qwen3TTS12HzState:
        """A new stream: zeros for every convolution's past (the one-shot's padding), no frames."""
        cfg = self.config["decoder_config"]
        cache = torch.zeros(cfg["num_hidden_layers"], 2, cfg["num_key_value_heads"], 0, cfg["head_dim"],
                            device=self.device, dtype=self.dtype)
        conv_data = torch.zeros(self._conv_offsets[-1], device=self.device, dtype=self.dtype)
        return Qwen3TTS12HzState(conv_data=conv_data, cache=cache, conv_shapes=self._conv_shapes)

    @torch.inference_mode()
    def decode_blocks(self, blocks: list[torch.Tensor],
                      states: list[Qwen3TTS12HzState]) -> list[tuple[torch.Tensor, Qwen3TTS12HzState]]:
        """Decodes each stream's next block on its state; returns (block audio, new state).

        Equals the whole-sequence forward of the stream so far, block after block (see the module
        docstring). All blocks run as one batch, in pieces of at most PIECE_FRAMES frames.
        """
        self.check_states(blocks, states, Qwen3TTS12HzState)
        checked = [self._validate(c) for c in blocks]
        states, parts, done = list(states), [[] for _ in blocks], [0] * len(blocks)
        while active := [i for i, codes in enumerate(checked) if done[i] < codes.shape[1]]:
            pieces = [checked[i][:, done[i]:done[i] + PIECE_FRAMES] for i in active]
            for i, piece, (audio, state) in zip(active, pieces, self._forward(pieces, [states[i] for i in active])):
                parts[i].append(audio)
                states[i] = state
                done[i] += piece.shape[1]
        return [(torch.cat(audio), state) for audio, state in zip(parts, states)]

    def _forward(self, pieces: list[torch.Tensor],
                 states: list[Qwen3TTS12HzState]) -> list[tuple[torch.Tensor, Qwen3TTS12HzState]]:
        """One batched forward: each (codebooks, frames) piece on its state, right-padded to the longest.
        The states go in and come out as whole-batch tensors (a few operations a call and two copies
        a stream, where one per stream, layer and convolution made most of the decoder's time at 64
        streams on a GPU)."""
        lengths, kept = [piece.shape[1] for piece in pieces], [s.kept for s in states]
        longest, cached, batch = max(lengths), max(kept), len(states)
        codes = torch.stack([piece if piece.shape[1] == longest else F.pad(piece, (0, longest - piece.shape[1]))
                             for piece in pieces])
        conv_data = torch.stack([s.conv_data for s in states])
        offsets = self._conv_offsets
        # each row's keys left-padded to the longest kept (masked by the transformer)
        cache = torch.stack([s.cache if s.kept == cached else F.pad(s.cache, (0, 0, cached - s.kept, 0))
                             for s in states])
        layers = cache.shape[1]
        run = StreamPass(convs=[conv_data[:, a:b].view(batch, *shape) for a, b, shape
                                in zip(offsets, offsets[1:], self._conv_shapes)],
                         keys=[cache[:, i, 0] for i in range(layers)], values=[cache[:, i, 1] for i in range(layers)],
                         kept=torch.tensor(kept, device=self.device), frames=torch.tensor(lengths, device=self.device))
        audio = self.net(codes, run).float().cpu()
        new_conv_data = torch.cat([t.reshape(batch, -1) for t in run.new_convs], dim=1)
        pairs = [t for k, v in zip(run.new_keys, run.new_values) for t in (k, v)]
        new_cache = torch.stack(pairs, dim=1)
        new_cache = new_cache.view(batch, layers, 2, *new_cache.shape[2:])
        out = []
        for row, (frames, before) in enumerate(zip(lengths, kept)):
            # this row's frames end at cached + frames; keep the window's last ones
            end = cached + frames
            start = end - min(before + frames, self.window - 1)
            # clones (two a stream): a view would keep the whole batch's states alive with an idle stream's
            state = Qwen3TTS12HzState(conv_data=new_conv_data[row].clone(),
                                      cache=new_cache[row, :, :, :, start:end].clone(), conv_shapes=self._conv_shapes)
            out.append((audio[row, :frames * self.samples_per_frame], state))
        return out

    # ---- encoding (voice cloning) ----------------------------------------------------------

    def _encoder(self) -> nn.Module:
        """transformers' Mimi encoder and quantizer under the checkpoint's ``encoder.*``, read on first use."""
        with self._encoder_lock:
            if self._encoder_parts is None:
                mimi = MimiConfig.from_dict(self.config["encoder_config"], attn_implementation="sdpa")
                parts = nn.Module()
                parts.encoder = MimiEncoderModel(mimi.encoder_config)
                parts.quantizer = MimiSplitResidualVectorQuantizer(mimi)
                tensors, unknown = {}, []
                for key, tensor in _read_tensors(self._files, "encoder.").items():
                    for theirs, part, ours in _ENCODER_LAYOUT:
                        if key.startswith(theirs):
                            tensors[f"{part}.{ours}{key[len(theirs):]}"] = tensor
                            break
                    else:
                        unknown.append(key)
                if unknown:
                    raise ValueError(f"{self._files[0].parent}: tensors not part of the Mimi encoder: {unknown[:4]}")
                load_strict(parts, tensors, f"{self._files[0].parent}: the Qwen3-TTS 12 Hz encoder")
                self._encoder_parts = parts.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
            return self._encoder_parts

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """1-D waveform at ``sample_rate`` -> frame-major codes (1-D long, CPU), as the reference's
        ``encode``: Mimi's encoder, the first ``tokens_per_frame`` quantizers, one frame per
        ``encode_downsample_rate`` samples begun (the last one padded with zeros)."""
        self.check_waveform(waveform)
        parts = self._encoder()
        latents = parts.encoder(waveform.to(device=self.device, dtype=self.dtype)[None, None]).latents
        codes = parts.quantizer.encode(latents, self.tokens_per_frame)[:, 0]  # (codebooks, frames)
        frames = -(-waveform.numel() // int(self.config.get("encode_downsample_rate", 1920)))
        return codes[:, :frames].T.reshape(-1).long().cpu()

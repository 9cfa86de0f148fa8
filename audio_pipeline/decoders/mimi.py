"""Mimi audio decoder (Kyutai's codec, the one Sesame CSM-1B speaks), on transformers' Mimi modules.

Codes
    A frame (12.5 frames/s: 1920 samples at 24 kHz) is one code per codebook, codebook 0 (the
    semantic one) first; codes are frame-major, ``[f0k0, f0k1, ..., f0k(K-1), f1k0, ...]``. ``K`` is
    the checkpoint's: a CSM checkpoint's ``num_codebooks`` (32 for CSM-1B), else the codec's
    ``num_quantizers``; the ``num_codebooks`` setting decodes with the first ``K`` of them only
    (the residual quantizer's coarser part). ``tokens_per_frame`` therefore belongs to the instance;
    the class says 32, CSM-1B's, for whoever reads it before loading.

Weights
    A Mimi directory (``config.json`` with ``model_type: mimi`` and safetensors), or a CSM directory
    (``config.json`` with a ``codec_config``; the codec's tensors are those under ``codec_model.``
    in its safetensors, and only those are read). Tensors may be in the published flat layout
    (what ``save_pretrained`` writes) or under the module names of transformers' ``MimiModel``.
    The encoder (for :meth:`MimiDecoder.encode`) is loaded on first use.

Streaming
    transformers keeps streaming state for the encoder's convolutions only, so the decoder's state
    here is our own, and each block runs the modules' own layers on it:

    * a causal convolution (stride 1) keeps the last ``padding_total`` inputs it saw; a new stream
      starts from zeros, the one-shot decode's left padding;
    * a transposed convolution (stride ``s``, kernel ``k``) emits ``L * s`` samples for ``L`` inputs
      and the one-shot decode drops the last ``k - s``: in a stream those are the start of the next
      block's samples, so the state carries them (without the bias, which the next block adds) and
      the next block adds them on;
    * the decoder transformer attends over a sliding window: the state keeps the keys and values of
      the last ``sliding_window - 1`` steps and the count of steps seen (their positions).

    Block by block therefore equals the one-shot decode up to float rounding (about 1e-6), and each
    block yields exactly its frames' samples with no lookahead (``causal_state``). Blocks of the
    same length from different streams run as one batch: their caches are left-padded to the
    longest and an explicit attention mask (window, causality, padding) and each stream's own
    positions keep every stream as it would be alone.

Receptive field
    Causal: nothing after a frame reaches it. Before it, each attention layer sees ``sliding_window
    - 1`` steps back (two steps per frame), the stacked layers as many times that, and the
    convolutions around them a few frames more: 1002 frames (80 s) for CSM-1B. The state carries
    all of it, so streams never restart a window and the figure only informs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import MimiConfig
from transformers.cache_utils import DynamicCache
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConvTranspose1d,
    MimiDecoderModel,
    MimiEncoderModel,
    MimiResnetBlock,
    MimiSplitResidualVectorQuantizer,
)

from audio_pipeline.checkpoints.kyutai_tts_config import dsm_config, generation_options, is_kyutai_tts_config
from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.mimi_moshi import read_moshi_config, transformers_config, transformers_tensors
from audio_pipeline.decoders.registry import register_audio_decoder
from audio_pipeline.models.weights import load_strict, read_config_json

__all__ = ["MimiDecoder", "MimiState"]

#: Where each stored tensor goes: (stored prefix, part, prefix in that part), first match wins. The
#: published flat layout first (transformers renames it on load the same way), then MimiModel's names.
_LAYOUT = (
    ("quantizer.", "quantizer", ""),
    ("upsample.", "decoder", "upsample."),
    ("decoder_transformer.", "decoder", "decoder_transformer."),
    ("decoder.layers.", "decoder", "decoder_seanet.layers."),
    ("decoder.", "decoder", ""),
    ("encoder.layers.", "encoder", "encoder_seanet.layers."),
    ("encoder_transformer.", "encoder", "encoder_transformer."),
    ("downsample.", "encoder", "downsample."),
    ("encoder.", "encoder", ""),
)
#: Key prefix of the codec inside a CSM checkpoint.
CSM_CODEC_PREFIX = "codec_model."


# --------------------------------------------------------------------------------------------
# checkpoint files


@dataclass(frozen=True)
class _Source:
    """Where a codec's tensors are: its files, the key prefix of its tensors in them, and (for
    Kyutai's own layout) the attention heads its names are translated with (decoders/mimi_moshi.py)."""

    files: tuple[Path, ...]
    prefix: str = ""
    moshi_heads: int | None = None


def _read_config(directory: Path) -> tuple[dict[str, Any], _Source, int | None]:
    """(the codec's config, where its tensors are, the codebooks its model speaks by default)."""
    raw = read_config_json(directory, "Mimi")
    if is_kyutai_tts_config(raw):
        config = transformers_config(read_moshi_config(directory, raw.get("mimi_config_name")), directory)
        path = directory / raw.get("mimi_name", "tokenizer-e351c8d8-checkpoint125.safetensors")
        if not path.is_file():
            raise FileNotFoundError(f"{path} (config.json mimi_name) is missing")
        # The codebooks the model generates (its manifest's layout_options.n_q, else all of them).
        codebooks = generation_options(directory, dsm_config(raw)).n_q
        return config, _Source((path,), "", config["num_attention_heads"]), codebooks
    if isinstance(raw, dict) and isinstance(raw.get("codec_config"), dict):
        config, prefix, codebooks = raw["codec_config"], CSM_CODEC_PREFIX, raw.get("num_codebooks")
    elif isinstance(raw, dict) and raw.get("model_type") == "mimi":
        config, prefix, codebooks = raw, "", None
    else:
        raise ValueError(f"{directory / 'config.json'}: neither a Mimi config (model_type mimi), a CSM config with a "
                         f"codec_config nor a Kyutai TTS config")
    return config, _Source(tuple(sorted(directory.glob("*.safetensors"))), prefix), codebooks


def _stored_tensors(source: _Source) -> dict[str, torch.Tensor] | None:
    """A Kyutai-layout codec's tensors under transformers' MimiModel names (None: read by name)."""
    if source.moshi_heads is None:
        return None
    from safetensors.torch import load_file

    return transformers_tensors(load_file(str(source.files[0])), source.moshi_heads)


def _read_tensors(source: _Source, parts: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors under ``source.prefix`` that belong to ``parts``, as {part: {module key: tensor}}."""
    out: dict[str, dict[str, torch.Tensor]] = {part: {} for part in parts}
    unknown = []

    def place(stored: str, get: Callable[[], torch.Tensor]) -> None:
        if not stored.startswith(source.prefix):
            return
        key = stored[len(source.prefix):]
        for theirs, part, ours in _LAYOUT:
            if key.startswith(theirs):
                if part in parts:
                    out[part][ours + key[len(theirs):]] = get()
                return
        unknown.append(stored)

    translated = _stored_tensors(source)
    if translated is not None:
        for stored, tensor in translated.items():
            place(stored, lambda tensor=tensor: tensor)
    else:
        for path in source.files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for stored in f.keys():
                    place(stored, lambda stored=stored: f.get_tensor(stored))
    if unknown:
        raise ValueError(f"{len(unknown)} tensors in {source.files[0].parent} are not part of a Mimi codec, "
                         f"e.g. {unknown[:4]}")
    return out


# --------------------------------------------------------------------------------------------
# streaming


@dataclass(frozen=True)
class MimiState:
    """One stream's decoder state after the frames decoded so far (see the module docstring).

    Tensors are this stream's alone (no batch dimension) and never modified: each block makes a new
    state.
    """

    #: Transformer steps seen (``latent_stride`` per frame): the positions of the next ones.
    steps: int
    #: Per convolution (see ``MimiDecoder._conv_slot``): a causal one's last inputs, or a transposed
    #: one's outputs that reach into the next block. (channels, width).
    convs: tuple[torch.Tensor, ...]
    #: Per transformer layer, the keys / values of the last ``min(steps, sliding_window - 1)``
    #: steps, (heads, steps kept, head_dim).
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


def _causal_step(conv: nn.Conv1d, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stride-1 causal convolution over a block: the inputs it saw last stand in for its left padding."""
    full = torch.cat([past, x], dim=2)
    return conv(full), full[:, :, full.shape[2] - past.shape[2]:]


def _transposed_step(conv: nn.ConvTranspose1d, x: torch.Tensor,
                     carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed convolution over a block: (the block's samples, what it adds to the next block's)."""
    y = conv(x)  # L * stride + (kernel - stride) samples, the bias in each
    width = carry.shape[2]
    y = torch.cat([y[:, :, :width] + carry, y[:, :, width:]], dim=2)
    emitted = y.shape[2] - width
    tail = y[:, :, emitted:]
    if conv.bias is not None:  # the next block's call adds the bias to those samples once
        tail = tail - conv.bias[:, None]
    return y[:, :, :emitted], tail


def _lookback_frames(decoder: nn.Module, window: int, layers: int) -> int:
    """Frames before a frame that reach its audio: its last sample's dependencies traced back
    through every layer (in each layer's input steps; a transposed convolution's input ``i``
    reaches outputs ``i * s`` to ``i * s + k - 1``; each attention layer sees ``window - 1`` steps
    back, so stacked layers see that many times further)."""

    def back(layer: nn.Module, span: int) -> int:
        if isinstance(layer, MimiConv1d):
            return span + int(layer.padding_total)
        if isinstance(layer, MimiConvTranspose1d):
            kernel, stride = layer.conv.kernel_size[0], layer.conv.stride[0]
            return math.ceil((span + kernel - 1) / stride)
        if isinstance(layer, MimiResnetBlock):
            inner = span
            for sub in reversed(layer.block):
                inner = back(sub, inner)
            return max(inner, back(layer.shortcut, span))
        return span  # activations, the identity shortcut

    span = 0
    for layer in reversed(decoder.decoder_seanet.layers):
        span = back(layer, span)
    span += layers * (window - 1)
    return back(decoder.upsample, span) if decoder.upsample is not None else span


# --------------------------------------------------------------------------------------------
# the decoder


@register_audio_decoder
class MimiDecoder(AudioDecoder):
    """Mimi codes (``tokens_per_frame`` codebooks, frame-major) -> 24 kHz waveform, and back (encode)."""

    name = "mimi"
    #: CSM-1B's; each instance says its checkpoint's (see the module docstring).
    tokens_per_frame = 32
    supports_block_causal = True
    causal_state = True
    supports_encoding = True

    def __init__(self, config: Any, quantizer: nn.Module, decoder: nn.Module, *, num_codebooks: int,
                 device: torch.device, dtype: torch.dtype, source: _Source):
        self.config = config
        self.quantizer, self.decoder = quantizer, decoder
        self.tokens_per_frame = num_codebooks
        self.codebook_size = config.codebook_size
        self.device, self.dtype = device, dtype
        self.sample_rate = config.sampling_rate
        self.latent_stride = config.latent_stride  # 1 where there is no upsampling
        self.samples_per_frame = self.latent_stride * math.prod(config.upsampling_ratios)
        self.window = config.sliding_window
        self.receptive_field_frames = _lookback_frames(decoder, self.window, config.num_hidden_layers)
        self._source = source
        self._encoder_model: nn.Module | None = None
        self._encoder_lock = threading.Lock()
        #: Slot in MimiState.convs of every convolution of the decoder.
        self._conv_slot = {m: i for i, m in enumerate(m for m in decoder.modules()
                                                       if isinstance(m, (MimiConv1d, MimiConvTranspose1d)))}

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, weights: str | Path, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "MimiDecoder":
        """Loads a Mimi or a CSM directory (see the module docstring); nothing is fetched.

        ``config`` holds runtime settings: ``num_codebooks`` (decode with the first ``n`` codebooks;
        default: all the checkpoint's, a CSM model's ``num_codebooks``).
        """
        settings = dict(config or {})
        unknown = sorted(set(settings) - {"num_codebooks"})
        if unknown:
            raise ValueError(f"unknown Mimi decoder settings {unknown}; accepted: num_codebooks")
        directory = Path(weights)
        if not directory.is_dir():
            raise FileNotFoundError(f"Mimi weights must be a directory (Mimi or CSM checkpoint): {directory}")
        raw, source, csm_codebooks = _read_config(directory)
        # sdpa: the batched block path hands the transformer a boolean mask, the form sdpa reads.
        model_config = MimiConfig.from_dict(raw, attn_implementation="sdpa")
        _check_streamable(model_config, directory)
        available = model_config.num_quantizers
        num_codebooks = settings.get("num_codebooks", csm_codebooks or available)
        if not isinstance(num_codebooks, int) or isinstance(num_codebooks, bool) or not 1 <= num_codebooks <= available:
            raise ValueError(f"num_codebooks must be an integer from 1 to the codec's {available} quantizers, "
                             f"got {num_codebooks!r}")

        quantizer = MimiSplitResidualVectorQuantizer(model_config)
        decoder = MimiDecoderModel(model_config.decoder_config)
        if not source.files:
            raise FileNotFoundError(f"no safetensors files in {directory}")
        tensors = _read_tensors(source, {"quantizer", "decoder"})
        load_strict(quantizer, tensors["quantizer"], f"{directory}: the Mimi quantizer")
        load_strict(decoder, tensors["decoder"], f"{directory}: the Mimi decoder")
        device = torch.device(device)
        for module in (quantizer, decoder):
            module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        return cls(model_config, quantizer, decoder, num_codebooks=num_codebooks, device=device, dtype=dtype,
                   source=source)

    # ---- decoding ------------------------------------------------------------------------

    def _validate(self, codes: torch.Tensor) -> torch.Tensor:
        """Checked codes as (codebooks, frames) on the device."""
        frame = self.tokens_per_frame
        return self.codes_on_device(codes, lambda pos: f"frame {pos // frame}, codebook {pos % frame}").view(-1, frame).T

    def _audio(self, wave: torch.Tensor) -> torch.Tensor:
        """(B, 1, samples) decoder output -> (B, samples) float32 CPU audio in [-1, 1]."""
        return wave[:, 0].float().clamp_(-1.0, 1.0).cpu()

    @torch.inference_mode()
    @torch.inference_mode()
    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decodes independent streams; streams of equal length run as one batch (padding would
        not be exact: the convolutions and the attention would see it)."""
        checked = [self._validate(c) for c in batch]
        out: list[torch.Tensor | None] = [None] * len(batch)
        for members in _by_length(checked):
            latents = self.quantizer.decode(torch.stack([checked[i] for i in members]))
            audio = self._audio(self.decoder(latents).audio_values)
            for row, i in enumerate(members):
                out[i] = audio[row]
        return out  # type: ignore[return-value]

    # ---- block-causal decoding -------------------------------------------------------------

    def init_state(self) -> MimiState:
        """A new stream: zeros for every convolution's past (the one-shot's padding), no steps."""
        cfg = self.config
        convs = []
        for layer in self._conv_slot:
            if isinstance(layer, MimiConvTranspose1d):
                shape = (layer.conv.out_channels, layer.conv.kernel_size[0] - layer.conv.stride[0])
            else:
                shape = (layer.conv.in_channels, int(layer.padding_total))
            convs.append(torch.zeros(shape, device=self.device, dtype=self.dtype))
        empty = torch.zeros(cfg.num_key_value_heads, 0, cfg.head_dim, device=self.device, dtype=self.dtype)
        layers = cfg.num_hidden_layers
        return MimiState(steps=0, convs=tuple(convs), keys=(empty,) * layers, values=(empty,) * layers)

    @torch.inference_mode()
    def decode_blocks(self, blocks: list[torch.Tensor],
                      states: list[MimiState]) -> list[tuple[torch.Tensor, MimiState]]:
        """Decodes each stream's next block on its state; returns (block audio, new state).

        Equals the one-shot decode of the stream so far, block after block (see the module
        docstring). Blocks of equal length run as one batch.
        """
        self.check_states(blocks, states, MimiState)
        checked = [self._validate(c) for c in blocks]
        out: list[tuple[torch.Tensor, MimiState] | None] = [None] * len(blocks)
        for members in _by_length(checked):
            group = [states[i] for i in members]
            convs = [torch.stack([s.convs[slot] for s in group]) for slot in range(len(self._conv_slot))]
            new_convs: list[torch.Tensor | None] = [None] * len(convs)

            def conv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
                slot = self._conv_slot[layer]
                step = _transposed_step if isinstance(layer, MimiConvTranspose1d) else _causal_step
                y, new_convs[slot] = step(layer.conv, x, convs[slot])
                return y

            x = self.quantizer.decode(torch.stack([checked[i] for i in members]))
            if self.decoder.upsample is not None:
                x = conv(self.decoder.upsample, x)
            x, keys, values = self._attend(x, group)
            for layer in self.decoder.decoder_seanet.layers:
                x = self._seanet_layer(layer, x, conv)
            audio = self._audio(x)
            for row, (i, state) in enumerate(zip(members, group)):
                # clone: a view would keep the whole batch's activations alive with the state
                out[i] = (audio[row], MimiState(
                    steps=state.steps + checked[i].shape[1] * self.latent_stride,
                    convs=tuple(t[row].clone() for t in new_convs),  # type: ignore[union-attr]
                    keys=keys[row], values=values[row]))
        return out  # type: ignore[return-value]

    def _attend(self, x: torch.Tensor, group: list[MimiState]
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]:
        """The decoder transformer over a batch of blocks (B, C, T), each on its stream's cached steps:
        (output, each stream's new keys, its new values)."""
        layers, steps = self.config.num_hidden_layers, x.shape[2]
        kept = [min(s.steps, self.window - 1) for s in group]
        longest = max(kept)

        def padded(tensors: list[torch.Tensor]) -> torch.Tensor:  # left-padded to the longest; masked below
            return torch.stack([F.pad(t, (0, 0, longest - n, 0)) for t, n in zip(tensors, kept)])

        cache = DynamicCache()
        if longest:
            for layer in range(layers):
                cache.update(padded([s.keys[layer] for s in group]), padded([s.values[layer] for s in group]), layer)
        arange = torch.arange(longest + steps, device=self.device)
        seen = torch.tensor([s.steps for s in group], device=self.device)[:, None]
        positions = seen + arange[:steps]  # (B, T): each stream's own
        ago = positions[:, :, None] - (seen - longest + arange)[:, None, :]  # query position - key position
        filled = arange >= longest - torch.tensor(kept, device=self.device)[:, None]
        mask = (ago >= 0) & (ago < self.window) & filled[:, None, :]  # what the one-shot's window shows
        out = self.decoder.decoder_transformer(x.transpose(1, 2), attention_mask=mask[:, None], position_ids=positions,
                                               cache=cache, use_cache=True).last_hidden_state.transpose(1, 2)
        keys, values = [], []
        for row, state in enumerate(group):
            start = longest + steps - min(state.steps + steps, self.window - 1)
            keys.append(tuple(cache.layers[i].keys[row, :, start:].clone() for i in range(layers)))
            values.append(tuple(cache.layers[i].values[row, :, start:].clone() for i in range(layers)))
        return out, keys, values

    def _seanet_layer(self, layer: nn.Module, x: torch.Tensor,
                      conv: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One layer of the SEANet decoder on a block, its convolutions through ``conv`` (on the state)."""
        if layer in self._conv_slot:
            return conv(layer, x)
        if isinstance(layer, MimiResnetBlock):
            branch = x
            for sub in layer.block:
                branch = self._seanet_layer(sub, branch, conv)
            return self._seanet_layer(layer.shortcut, x, conv) + branch
        return layer(x)  # activations, the identity shortcut

    # ---- encoding (voice cloning) ----------------------------------------------------------

    def _encoder(self) -> MimiEncoderModel:
        with self._encoder_lock:
            if self._encoder_model is None:
                encoder = MimiEncoderModel(self.config.encoder_config)
                tensors = _read_tensors(self._source, {"encoder"})["encoder"]
                load_strict(encoder, tensors, f"{self._source.files[0].parent}: the Mimi encoder")
                self._encoder_model = encoder.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
            return self._encoder_model

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """1-D waveform at ``sample_rate`` -> frame-major codes (1-D long, CPU), as MimiModel.encode
        with ``tokens_per_frame`` quantizers; a last partial frame is padded with zeros."""
        self.check_waveform(waveform)
        latents = self._encoder()(waveform.to(device=self.device, dtype=self.dtype)[None, None]).latents
        codes = self.quantizer.encode(latents, self.tokens_per_frame)  # (codebooks, 1, frames)
        return codes[:, 0].T.reshape(-1).cpu()


def _by_length(checked: list[torch.Tensor]) -> list[list[int]]:
    """Indices of (codebooks, frames) code tensors grouped by frame count."""
    groups: dict[int, list[int]] = {}
    for i, codes in enumerate(checked):
        groups.setdefault(codes.shape[1], []).append(i)
    return list(groups.values())


def _check_streamable(config: MimiConfig, source: Path) -> None:
    """The stream state reproduces the one-shot decode of Mimi's causal decoder only: refuse others."""
    made = config.latent_stride * math.prod(config.upsampling_ratios)
    problems = [why for wrong, why in (
        (config.sampling_rate != made * config.frame_rate,
         f"sampling_rate / frame_rate must be the {made} samples the decoder makes per frame"),
        (not config.use_causal_conv, "use_causal_conv must be true"),
        (config.trim_right_ratio != 1.0, "trim_right_ratio must be 1.0 (transposed convolutions trimmed on the right)"),
        (config.pad_mode != "constant", "pad_mode must be 'constant' (zeros start a stream, as they pad a one-shot "
                                        "decode)"),
        (config.audio_channels != 1, "audio_channels must be 1 (mono)"),
        (not config.sliding_window, "sliding_window must be set (without it a stream's state would grow without "
                                    "bound)"),
    ) if wrong]
    if problems:
        raise ValueError(f"{source}: unsupported Mimi config: {'; '.join(problems)}")

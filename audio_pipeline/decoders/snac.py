"""SNAC audio decoder (the Orpheus layout: SNAC 24 kHz, 3 codebooks, 7 codes per frame).

Code layout
    One frame is 7 codes: ``[c0[i], c1[2i], c2[4i], c2[4i+1], c1[2i+1], c2[4i+2], c2[4i+3]]``
    (codebook 0 at 1/4 of the latent rate, codebook 1 at 1/2, codebook 2 at the latent rate).
    :func:`codes_to_codebooks` / :func:`codebooks_to_codes` convert both ways.

Noise
    The published decoders inject Gaussian noise after every upsampling stage (``noise: true`` in
    config.json): one standard-normal value per (stream, time step), times a learned projection of
    the signal. The reference draws it from torch's global RNG on every call. Here the source is
    explicit, three ways:

    * positional (the default; ``noise_seed`` an int, default 0): the noise of stage ``k`` at
      sample ``n`` of that stage's rate, counted from the stream's frame 0, is entry
      ``n mod len`` of a fixed table of standard-normal values drawn once from
      ``torch.Generator().manual_seed(noise_seed)`` (:data:`NOISE_PERIOD_FRAMES` frames long per
      stage). So decoding is reproducible, ``decode_batch`` equals per-item ``decode``, and a window
      decoded with ``frame_offset=a`` (its first frame's index in the stream) sees exactly the
      noise the one-shot decode saw at the same frames: frames more than
      ``receptive_field_frames`` inside the window reproduce the one-shot audio. The tables are
      drawn in float32 on the CPU, so the noise does not depend on the device.
    * ``decode(codes, generator=g)``: stage by stage, ``torch.randn((1, 1, T), generator=g)``,
      the reference's draws. With ``g`` freshly seeded with ``s`` the result equals the reference
      decode after ``torch.manual_seed(s)`` (CPU generators share one algorithm).
    * ``noise_seed: None``: torch's global RNG, exactly like the reference package.

    ``noise_scale`` multiplies the noise (default 1); 0 turns it off and touches no RNG.

Receptive field
    :func:`receptive_field_frames` propagates the span of latent steps that feed one output frame
    backwards through every layer of the decoder (exact index arithmetic for each convolution,
    transposed convolution and residual unit; a local-attention window adds ``window - 1`` steps on
    each side, conservatively), converts latent steps to frames (4 latent steps per frame) and
    returns the farthest frame reached on either side. For the 24 kHz checkpoint this is 3.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.registry import register_audio_decoder
from audio_pipeline.decoders.snac_layers import (
    RESIDUAL_DILATIONS,
    RESIDUAL_KERNEL,
    NoiseFn,
    ResidualQuantizer,
    SNACAnalysis,
    SNACSynthesis,
    checkpoint_key_map,
    ignored_checkpoint_keys,
    upsample_unpadded,
)

log = logging.getLogger(__name__)

__all__ = [
    "SNAC_24KHZ_CONFIG",
    "SNACDecoder",
    "codebooks_to_codes",
    "codes_to_codebooks",
    "receptive_field_frames",
]

#: ``config.json`` of the published 24 kHz SNAC (hubertsiuzdak/snac_24khz) used by Orpheus.
SNAC_24KHZ_CONFIG: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}

#: Defaults of keys a config.json may leave out (those of the reference constructor).
_MODEL_DEFAULTS: dict[str, Any] = {
    "sampling_rate": 44100, "encoder_dim": 64, "encoder_rates": [3, 3, 7, 7], "latent_dim": None,
    "decoder_dim": 1536, "decoder_rates": [7, 7, 3, 3], "attn_window_size": 32,
    "codebook_size": 4096, "codebook_dim": 8, "vq_strides": [8, 4, 2, 1], "noise": True,
    "depthwise": True,
}
#: Settings accepted in the ``config`` argument of :meth:`SNACDecoder.load`.
_RUNTIME_DEFAULTS: dict[str, Any] = {"noise_seed": 0, "noise_scale": 1.0, "with_encoder": False,
                                      "max_batch_frames": "auto", "cuda_graphs": False,
                                      "cuda_graph_max_frames": 32}
#: CPU default of ``max_batch_frames``: measured on a 2-core x86 host with the 24 kHz model, the
#: cost per frame is flat up to ~32 frames per call and grows beyond (memory-bound activations).
_CPU_MAX_BATCH_FRAMES = 32

_VQ_STRIDES = [4, 2, 1]
#: Frame slot -> codebook, and the slots of each codebook in order.
FRAME_SLOT_CODEBOOK = (0, 1, 2, 2, 1, 2, 2)
_CODEBOOK_SLOTS = ((0,), (1, 4), (2, 3, 5, 6))
TOKENS_PER_FRAME = 7
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# --------------------------------------------------------------------------------------------
# interleave


def codes_to_codebooks(codes: torch.Tensor) -> list[torch.Tensor]:
    """Frame-major codes ``(..., 7F)`` -> ``[c0 (..., F), c1 (..., 2F), c2 (..., 4F)]``."""
    if codes.shape[-1] % TOKENS_PER_FRAME:
        raise ValueError(f"code count {codes.shape[-1]} is not a multiple of {TOKENS_PER_FRAME}")
    frames = codes.reshape(*codes.shape[:-1], -1, TOKENS_PER_FRAME)
    # Slots stacked one by one, not indexed with a list: a list index is copied to the device on
    # every call, which a CUDA graph cannot hold (snac_graphs.py).
    return [torch.stack([frames[..., slot] for slot in slots], dim=-1).reshape(*codes.shape[:-1], -1)
            for slots in _CODEBOOK_SLOTS]


def codebooks_to_codes(codebooks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[c0 (..., F), c1 (..., 2F), c2 (..., 4F)]`` -> frame-major codes ``(..., 7F)``."""
    if len(codebooks) != 3:
        raise ValueError(f"expected 3 codebooks, got {len(codebooks)}")
    c0, c1, c2 = codebooks
    n = c0.shape[-1]
    lead = c0.shape[:-1]
    if c1.shape != (*lead, 2 * n) or c2.shape != (*lead, 4 * n):
        raise ValueError(f"codebook lengths must be F, 2F, 4F; got shapes "
                         f"{tuple(c0.shape)}, {tuple(c1.shape)}, {tuple(c2.shape)}")
    out = torch.empty(*lead, n, TOKENS_PER_FRAME, dtype=c0.dtype, device=c0.device)
    for book, slots in zip((c0, c1, c2), _CODEBOOK_SLOTS):
        out[..., list(slots)] = book.reshape(*lead, n, len(slots))
    return out.reshape(*lead, n * TOKENS_PER_FRAME)


# --------------------------------------------------------------------------------------------
# configuration


def _normalize_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Fills defaults and checks that the model fits the 7-code, 3-codebook frame layout."""
    unknown = sorted(k for k in raw if k not in _MODEL_DEFAULTS and not k.startswith("_"))
    if unknown:
        log.warning("%s: ignoring unknown SNAC config keys %s", source, unknown)
    cfg = {**_MODEL_DEFAULTS, **{k: v for k, v in raw.items() if k in _MODEL_DEFAULTS}}

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"{source}: SNAC config {key!r} = {cfg.get(key)!r}: {why}")

    if list(cfg["vq_strides"] or []) != _VQ_STRIDES:
        raise bad("vq_strides", f"the 7-code frame layout needs exactly 3 codebooks with strides {_VQ_STRIDES}")
    for key in ("encoder_rates", "decoder_rates"):
        rates = cfg[key]
        if not isinstance(rates, (list, tuple)) or not rates or not all(isinstance(r, int) and r > 0 for r in rates):
            raise bad(key, "must be a non-empty list of positive integers")
    for key in ("sampling_rate", "encoder_dim", "decoder_dim", "codebook_size", "codebook_dim"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] <= 0:
            raise bad(key, "must be a positive integer")
    if cfg["latent_dim"] is None:
        cfg["latent_dim"] = cfg["encoder_dim"] * 2 ** len(cfg["encoder_rates"])
    elif not isinstance(cfg["latent_dim"], int) or cfg["latent_dim"] <= 0:
        raise bad("latent_dim", "must be a positive integer or null")
    if math.prod(cfg["decoder_rates"]) != math.prod(cfg["encoder_rates"]):
        raise bad("decoder_rates", f"their product must equal the hop length prod(encoder_rates) = "
                                   f"{math.prod(cfg['encoder_rates'])}")
    if cfg["decoder_dim"] % 2 ** len(cfg["decoder_rates"]):
        raise bad("decoder_dim", f"must be divisible by 2**len(decoder_rates) = {2 ** len(cfg['decoder_rates'])}")
    window = cfg["attn_window_size"]
    if window is not None:
        if not isinstance(window, int) or window <= 0:
            raise bad("attn_window_size", "must be a positive integer or null")
        for key, width in (("decoder_dim", cfg["decoder_dim"]), ("encoder_dim", cfg["latent_dim"])):
            if width % 64:
                raise bad(key, f"with attention the attended width ({width}) must be a multiple of 64")
    for key in ("noise", "depthwise"):
        if not isinstance(cfg[key], bool):
            raise bad(key, "must be true or false")
    return cfg


def receptive_field_frames(config: dict[str, Any]) -> int:
    """Frames on either side of a frame that can influence its audio (see the module docstring)."""
    cfg = _normalize_config(config, "receptive_field_frames")
    hop = math.prod(cfg["decoder_rates"])
    frame_latents = cfg["vq_strides"][0]
    spf = hop * frame_latents
    frame = 10_000  # far from the edges, where zero padding would clip the span
    lo, hi = frame * spf, (frame + 1) * spf - 1  # output samples of that frame

    def same_conv(lo: int, hi: int, kernel: int, dilation: int = 1) -> tuple[int, int]:
        pad = (kernel - 1) * dilation // 2  # out[o] reads in[o - pad + j * dilation], j < kernel
        return lo - pad, hi - pad + (kernel - 1) * dilation

    def residual_stack(lo: int, hi: int) -> tuple[int, int]:
        for d in reversed(RESIDUAL_DILATIONS):
            lo, hi = same_conv(lo, hi, RESIDUAL_KERNEL, d)
        return lo, hi

    lo, hi = same_conv(lo, hi, 7)  # output conv
    for s in reversed(cfg["decoder_rates"]):
        lo, hi = residual_stack(lo, hi)
        kernel, pad = 2 * s, math.ceil(s / 2)  # out[o] += in[i] * w[k] with o = i * s + k - pad
        lo, hi = -((-(lo + pad - kernel + 1)) // s), (hi + pad) // s
    if cfg["attn_window_size"] is not None:
        lo, hi = lo - (cfg["attn_window_size"] - 1), hi + (cfg["attn_window_size"] - 1)
    lo, hi = same_conv(lo, hi, 7)  # entry conv (depthwise or not, same span)
    return max(frame - lo // frame_latents, hi // frame_latents - frame)


# --------------------------------------------------------------------------------------------
# checkpoint files


def _resolve_files(weights: str | Path) -> tuple[Path, Path]:
    """(weights file, config.json) for a directory or a weights file."""
    path = Path(weights)
    if path.is_dir():
        for name in _WEIGHT_FILES:
            if (path / name).is_file():
                weights_file = path / name
                break
        else:
            raise FileNotFoundError(f"no SNAC weights in {path} (looked for {', '.join(_WEIGHT_FILES)})")
        config_file = path / "config.json"
    elif path.is_file():
        weights_file, config_file = path, path.parent / "config.json"
    else:
        raise FileNotFoundError(f"SNAC weights not found: {path}")
    if not config_file.is_file():
        raise FileNotFoundError(f"SNAC config.json not found: {config_file}")
    return weights_file, config_file


def _read_tensors(path: Path, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (only ``wanted`` keys when given and cheap to select)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys() if wanted is None or k in wanted}
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    if wanted is not None:
        state = {k: v for k, v in state.items() if k in wanted}
    return state


def _weight_norm_names(key: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The (g, v) key pairs a weight-normed ``...weight`` key may be stored as."""
    base, _, leaf = key.rpartition(".")
    return ((f"{base}.{leaf}_g", f"{base}.{leaf}_v"),
            (f"{base}.parametrizations.{leaf}.original0", f"{base}.parametrizations.{leaf}.original1"))


def _all_stored_names(key: str, weight_normed: bool) -> list[str]:
    names = [key]
    if weight_normed:
        for g, v in _weight_norm_names(key):
            names += [g, v]
    return names


def _fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g * v / ||v||`` with the norm over every dim but 0 (the layout torch's weight norm uses)."""
    g, v = g.float(), v.float()
    try:  # the same kernel torch's weight norm runs, so folded weights are bit-equal to its output
        return torch._weight_norm(v, g, 0)
    except (AttributeError, RuntimeError):  # pragma: no cover
        return v * (g / torch.linalg.vector_norm(v, dim=tuple(range(1, v.dim())), keepdim=True))


def _translate(state: dict[str, torch.Tensor], key_map: dict[str, tuple[str, bool]], source: Path,
               consumed: set[str]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> our state dict (weight norm folded); raises listing missing keys."""
    out, missing = {}, []
    for ours, (theirs, weight_normed) in key_map.items():
        if theirs in state:
            out[ours] = state[theirs].float()
            consumed.add(theirs)
            continue
        if weight_normed:
            for g, v in _weight_norm_names(theirs):
                if g in state and v in state:
                    out[ours] = _fold_weight_norm(state[g], state[v])
                    consumed.update((g, v))
                    break
            else:
                missing.append(theirs + (" (or its weight-norm g/v pair)" if weight_normed else ""))
                continue
        else:
            missing.append(theirs)
    if missing:
        raise ValueError(f"{source}: {len(missing)} SNAC tensors missing, e.g. {missing[:4]}")
    return out


# --------------------------------------------------------------------------------------------
# noise


#: Length of the positional noise tables, in frames (43.7 s at 24 kHz); the noise repeats after it.
NOISE_PERIOD_FRAMES = 512


def _positional_noise(tables: list[torch.Tensor], frames: int, offsets: Sequence[int] | torch.Tensor,
                      scale: float) -> NoiseFn:
    """Noise for a batch of ``frames``-frame streams whose first frames are ``offsets`` (a sequence,
    or a (batch, 1) long tensor on the tables' device: what a CUDA graph reads its offsets from)."""

    # One index product for the whole batch (a stream-by-stream loop costs a few small kernels per
    # stream and stage: at 160 streams a quarter of the decoder thread's time on a GPU).
    if isinstance(offsets, torch.Tensor):
        firsts = offsets
    else:
        firsts = torch.tensor(list(offsets), dtype=torch.long, device=tables[0].device)[:, None]

    def draw(stage: int, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = tables[stage]
        per_frame = length // frames
        steps = torch.arange(length, device=table.device)[None, :]
        index = (steps + firsts * per_frame) % table.numel()
        n = table[index][:, None].to(dtype)
        return n * scale if scale != 1.0 else n

    return draw


def _stream_noise(generators: list[torch.Generator], scale: float) -> NoiseFn:
    """Noise for a batch whose item b draws from ``generators[b]`` (same values as alone)."""

    def draw(stage: int, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        parts = [torch.randn((1, 1, length), generator=g, device=g.device) for g in generators]
        n = torch.cat(parts).to(device=device, dtype=dtype)
        return n * scale if scale != 1.0 else n

    return draw


def _global_noise(scale: float) -> NoiseFn:
    def draw(stage: int, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        n = torch.randn((batch, 1, length), device=device, dtype=dtype)
        return n * scale if scale != 1.0 else n

    return draw


# --------------------------------------------------------------------------------------------
# the decoder


@register_audio_decoder
class SNACDecoder(AudioDecoder):
    """SNAC codes (7 per frame, 3 codebooks) -> waveform; optional waveform -> codes (encode)."""

    name = "snac"
    tokens_per_frame = TOKENS_PER_FRAME
    #: Block-causal decoding keeps per-stream cached activations of every convolution (see
    #: decode_blocks). Checkpoints with windowed attention (the 32/44 kHz models) cannot: their
    #: instances say False.
    supports_block_causal = True
    supports_encoding = True
    #: The positional noise depends on a frame's index in its stream.
    takes_frame_offsets = True

    def __init__(self, model_config: dict[str, Any], quantizer: ResidualQuantizer, synthesis: SNACSynthesis,
                 *, device: torch.device, dtype: torch.dtype, noise_seed: int | None = 0,
                 noise_scale: float = 1.0, weights_file: Path | None = None,
                 analysis: SNACAnalysis | None = None, max_batch_frames: int | None = None,
                 cuda_graphs: bool = False, cuda_graph_max_frames: int = 32):
        self.model_config = model_config
        self.quantizer, self.synthesis, self._analysis = quantizer, synthesis, analysis
        self.device, self.dtype = device, dtype
        self.noise_seed, self.noise_scale = noise_seed, float(noise_scale)
        self.weights_file = weights_file
        self.max_batch_frames = max_batch_frames
        self._encoder_lock = threading.Lock()
        self._noise_tables: list[torch.Tensor] | None = None
        self.sample_rate = model_config["sampling_rate"]
        self.hop_length = math.prod(model_config["encoder_rates"])
        self.samples_per_frame = self.hop_length * model_config["vq_strides"][0]
        self.codebook_size = model_config["codebook_size"]
        self.has_noise = bool(model_config["noise"])
        self.attn_window_size = model_config["attn_window_size"]
        self.receptive_field_frames = receptive_field_frames(model_config)
        self.supports_block_causal = synthesis.attention is None
        #: Captured batched decodes (snac_graphs.py), or None: eager calls.
        self.graphs = None
        if cuda_graphs:
            from audio_pipeline.decoders.snac_graphs import SNACGraphs

            self.graphs = SNACGraphs(self, max_frames=cuda_graph_max_frames)

    @classmethod
    def check_streaming_settings(cls, *, block_causal: bool = False, prepend_causal: bool = False,
                                 weights: str | None = None) -> None:
        """As AudioDecoder's; also reads the checkpoint's config.json when ``weights`` is given, since
        a checkpoint with windowed attention cannot decode block-causally."""
        super().check_streaming_settings(block_causal=block_causal, prepend_causal=prepend_causal)
        if not (block_causal or prepend_causal) or not weights:
            return
        try:
            _, config_file = _resolve_files(weights)
            window = json.loads(config_file.read_text()).get("attn_window_size", _MODEL_DEFAULTS["attn_window_size"])
        except (OSError, ValueError, AttributeError):
            return  # loading reports unreadable weights, with the details
        if window is not None:
            fields = [f for f, on in (("block_causal", block_causal), ("prepend_prompt_speech_tokens_causal",
                                                                       prepend_causal)) if on]
            raise ValueError(f"{'=true and '.join(fields)}=true is not supported by audio_decoder 'snac' with the "
                             f"checkpoint {weights}: its windowed attention (attn_window_size {window}) cannot be "
                             "decoded block-causally")

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, weights: str | Path, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             with_encoder: bool | None = None) -> "SNACDecoder":
        """Loads ``weights`` (a directory with config.json and model.safetensors or
        pytorch_model.bin, or a weights file with config.json beside it).

        ``config`` holds runtime settings: ``noise_seed`` (int, or None for torch's global RNG;
        default 0), ``noise_scale`` (default 1.0; 0 disables noise), ``with_encoder`` (build the
        encoder now; otherwise it is built on the first :meth:`encode`), ``max_batch_frames``
        (frames per batched decoder call in :meth:`decode_batch`; ``"auto"``: 32 on CPU,
        unlimited elsewhere; None: unlimited), ``cuda_graphs`` (true: :meth:`decode_batch` replays
        CUDA graphs, snac_graphs.py, on a CUDA device with positional noise or none; default false:
        through the server on an H200 it did not serve more streams), ``cuda_graph_max_frames``
        (longest window, in frames, a graph is captured for; default 32).
        """
        settings = dict(_RUNTIME_DEFAULTS)
        for key, value in (config or {}).items():
            if key not in _RUNTIME_DEFAULTS:
                raise ValueError(f"unknown SNAC decoder setting {key!r}; accepted: {', '.join(_RUNTIME_DEFAULTS)}")
            settings[key] = value
        if settings["noise_seed"] is not None and (not isinstance(settings["noise_seed"], int)
                                                   or isinstance(settings["noise_seed"], bool)):
            raise ValueError(f"noise_seed must be an integer or None, got {settings['noise_seed']!r}")
        if not isinstance(settings["noise_scale"], (int, float)) or settings["noise_scale"] < 0:
            raise ValueError(f"noise_scale must be a non-negative number, got {settings['noise_scale']!r}")
        if with_encoder is None:
            with_encoder = bool(settings["with_encoder"])
        device = torch.device(device)
        max_batch_frames = settings["max_batch_frames"]
        if max_batch_frames == "auto":
            max_batch_frames = _CPU_MAX_BATCH_FRAMES if device.type == "cpu" else None
        elif max_batch_frames is not None and (not isinstance(max_batch_frames, int)
                                               or isinstance(max_batch_frames, bool) or max_batch_frames <= 0):
            raise ValueError(f"max_batch_frames must be a positive integer, None or 'auto', got {max_batch_frames!r}")
        graphs = settings["cuda_graphs"]
        if not isinstance(graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {graphs!r}")
        positional = settings["noise_seed"] is not None or settings["noise_scale"] == 0
        if graphs and (device.type != "cuda" or not positional):
            raise ValueError("cuda_graphs=true needs the decoder on a CUDA device and positional noise (an integer "
                             f"noise_seed) or none; here: device {device.type}, noise_seed {settings['noise_seed']!r}")
        max_frames = settings["cuda_graph_max_frames"]
        if not isinstance(max_frames, int) or isinstance(max_frames, bool) or max_frames <= 0:
            raise ValueError(f"cuda_graph_max_frames must be a positive integer, got {max_frames!r}")

        weights_file, config_file = _resolve_files(weights)
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file}: expected a JSON object")
        model_config = _normalize_config(raw, str(config_file))

        with torch.device("meta"):
            quantizer, synthesis = _build_decoding(model_config)
            analysis = _build_analysis(model_config)
        decode_map = {**{f"q.{k}": v for k, v in checkpoint_key_map(quantizer).items()},
                      **{f"s.{k}": v for k, v in checkpoint_key_map(synthesis).items()}}
        encode_map = checkpoint_key_map(analysis)
        known = {n for m in (decode_map, encode_map) for k, wn in m.values() for n in _all_stored_names(k, wn)}
        known |= ignored_checkpoint_keys(synthesis) | ignored_checkpoint_keys(analysis)

        state = _read_tensors(weights_file)
        unexpected = sorted(k for k in state if k not in known)
        if unexpected:
            raise ValueError(f"{weights_file}: {len(unexpected)} unexpected tensors for this SNAC config "
                             f"({config_file.name}), e.g. {unexpected[:4]}")
        consumed: set[str] = set()
        ours = _translate(state, decode_map, weights_file, consumed)
        _assign(quantizer, {k[2:]: v for k, v in ours.items() if k.startswith("q.")}, weights_file)
        _assign(synthesis, {k[2:]: v for k, v in ours.items() if k.startswith("s.")}, weights_file)
        if with_encoder:
            _assign(analysis, _translate(state, encode_map, weights_file, consumed), weights_file)
        else:
            analysis = None
        del state

        for module in (quantizer, synthesis, analysis):
            if module is not None:
                module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        return cls(model_config, quantizer, synthesis, device=device, dtype=dtype,
                   noise_seed=settings["noise_seed"], noise_scale=settings["noise_scale"],
                   weights_file=weights_file, analysis=analysis, max_batch_frames=max_batch_frames,
                   cuda_graphs=graphs, cuda_graph_max_frames=max_frames)

    # ---- decoding ------------------------------------------------------------------------

    def _validate(self, codes: torch.Tensor) -> torch.Tensor:
        moved = self.codes_on_device(codes, lambda pos: (
            f"frame {pos // TOKENS_PER_FRAME}, slot {pos % TOKENS_PER_FRAME}, "
            f"codebook {FRAME_SLOT_CODEBOOK[pos % TOKENS_PER_FRAME]}"))
        if self.attn_window_size is not None:
            latents = codes.numel() // TOKENS_PER_FRAME * self.model_config["vq_strides"][0]
            if latents % self.attn_window_size:
                raise ValueError(f"this SNAC model attends over windows of {self.attn_window_size} latent "
                                 f"steps; {codes.numel() // TOKENS_PER_FRAME} frames give {latents} steps")
        return moved

    def _validate_all(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """The streams' codes, checked as ``_validate`` checks each (the same errors), where they are:
        streams of one length on one device are checked as one tensor (one range check for the lot,
        not a few small operations per stream), and the caller moves each run to the device once."""
        groups: dict[tuple, list[int]] = {}
        for i, codes in enumerate(batch):
            if not isinstance(codes, torch.Tensor) or codes.dim() != 1 or codes.is_floating_point() \
                    or codes.is_complex() or codes.dtype == torch.bool:
                return [self._validate(c) for c in batch]  # the stream-by-stream check names the fault
            groups.setdefault((codes.numel(), codes.device), []).append(i)
        for members in groups.values():
            together = torch.stack([batch[i] for i in members])
            if together.numel() == 0 or together.shape[1] % TOKENS_PER_FRAME or \
                    bool(((together < 0) | (together >= self.codebook_size)).any()):
                for i in members:  # one of them is at fault: the stream-by-stream check says where
                    self._validate(batch[i])
            if self.attn_window_size is not None:
                self._validate(batch[members[0]])  # the window rule depends on the length alone
        return list(batch)

    def noise_tables(self) -> list[torch.Tensor]:
        """The positional noise tables, one per upsampling stage (built on first use)."""
        if self._noise_tables is None:
            gen = torch.Generator().manual_seed(self.noise_seed if self.noise_seed is not None else 0)
            per_frame, tables = self.model_config["vq_strides"][0], []
            for rate in self.model_config["decoder_rates"]:
                per_frame *= rate
                tables.append(torch.randn(NOISE_PERIOD_FRAMES * per_frame, generator=gen).to(self.device))
            self._noise_tables = tables
        return self._noise_tables

    def _noise(self, frames: int, offsets: Sequence[int],
               generators: Sequence[torch.Generator] | None) -> NoiseFn | None:
        if not self.has_noise or self.noise_scale == 0:
            return None
        if generators is not None:
            return _stream_noise(list(generators), self.noise_scale)
        if self.noise_seed is None:
            return _global_noise(self.noise_scale)
        return _positional_noise(self.noise_tables(), frames, offsets, self.noise_scale)

    def _synthesize(self, stacked: torch.Tensor, noise: NoiseFn | None) -> torch.Tensor:
        """(B, 7F) validated codes on the device -> (B, F * samples_per_frame) float32 audio there."""
        z = self.quantizer.from_codes(codes_to_codebooks(stacked))
        return self.synthesis(z, noise)[:, 0].float().clamp_(-1.0, 1.0)

    def _decode_stacked(self, stacked: torch.Tensor, noise: NoiseFn | None) -> torch.Tensor:
        """(B, 7F) validated codes -> (B, F * samples_per_frame) float32 CPU audio."""
        return self._synthesize(stacked, noise).cpu()

    def decode_rows(self, codes: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
        """(B, 7F) checked codes and (B, 1) first-frame offsets, both on the device -> (B, F *
        samples_per_frame) float32 audio on the device, with positional noise (or none) whose
        offsets come from a tensor. snac_graphs.py captures it."""
        noise = None
        if self.has_noise and self.noise_scale != 0:
            noise = _positional_noise(self.noise_tables(), codes.shape[1] // TOKENS_PER_FRAME, firsts,
                                      self.noise_scale)
        return self._synthesize(codes, noise)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, *, frame_offset: int = 0,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Decodes frame-major codes (7 per frame) into ``frames * samples_per_frame`` samples.

        ``frame_offset``: index in its stream of the first frame (positions the default noise);
        ``generator``: draw the noise from it instead. See the module docstring.
        """
        codes = self._validate(codes)
        _check_offsets([frame_offset])
        noise = self._noise(codes.numel() // TOKENS_PER_FRAME, [frame_offset],
                            None if generator is None else [generator])
        return self._decode_stacked(codes[None], noise)[0]

    @torch.inference_mode()
    def decode_batch(self, batch: list[torch.Tensor], *, frame_offsets: Sequence[int] | None = None,
                     generators: Sequence[torch.Generator] | None = None) -> list[torch.Tensor]:
        """Decodes independent streams; streams of equal length run as one batch.

        Result ``i`` equals ``decode(batch[i])`` (up to float rounding of batched kernels): each
        stream gets its own noise. Padding unequal lengths would not be exact (the convolutions
        see the padding), so streams are grouped by length instead. A group is split into runs
        of at most ``max_batch_frames`` frames in total (never splitting a stream); by default
        32 on CPU, where larger calls cost more per frame, and unlimited on accelerators.
        """
        if generators is not None and len(generators) != len(batch):
            raise ValueError(f"need one generator per stream: {len(batch)} streams, {len(generators)} generators")
        if frame_offsets is None:
            frame_offsets = [0] * len(batch)
        elif len(frame_offsets) != len(batch):
            raise ValueError(f"need one frame offset per stream: {len(batch)} streams, {len(frame_offsets)} offsets")
        _check_offsets(frame_offsets)
        checked = self._validate_all(batch)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for members in self._runs(checked):
            offsets = [frame_offsets[i] for i in members]
            stacked = torch.stack([checked[i] for i in members])
            audio = None
            if self.graphs is not None and generators is None:
                audio = self.graphs.decode(stacked, offsets)
            if audio is None:
                noise = self._noise(stacked.shape[1] // TOKENS_PER_FRAME, offsets,
                                    None if generators is None else [generators[i] for i in members])
                audio = self._decode_stacked(stacked.to(device=self.device, dtype=torch.long), noise)
            for row, i in enumerate(members):
                out[i] = audio[row]
        return out  # type: ignore[return-value]

    def _runs(self, checked: list[torch.Tensor]) -> list[list[int]]:
        """Indices of ``checked`` grouped into batched calls: equal lengths only (padding would
        change the audio), at most ``max_batch_frames`` frames per call (never splitting an input)."""
        groups: dict[int, list[int]] = {}
        for i, codes in enumerate(checked):
            groups.setdefault(codes.numel(), []).append(i)
        runs: list[list[int]] = []
        for length, members in groups.items():
            per_run = len(members)
            if self.max_batch_frames is not None:
                per_run = max(1, self.max_batch_frames // (length // TOKENS_PER_FRAME))
            runs += [members[i: i + per_run] for i in range(0, len(members), per_run)]
        return runs

    # ---- block-causal decoding -------------------------------------------------------------

    def init_state(self) -> None:
        """A stream's state before its first block: nothing cached (zeros, like a one-shot start)."""
        return None

    @torch.inference_mode()
    def decode_blocks(self, blocks: list[torch.Tensor], states: list[Any], *,
                      frame_offsets: Sequence[int] | None = None) -> list[tuple[torch.Tensor, Any]]:
        """Decodes each stream's next block on top of its state; returns (block audio, new state).

        The state caches, for every convolution, the inputs it saw last (its left padding's worth),
        so a block sees its past exactly as computed when that past was a block of its own, and
        never sees the future (zeros stand in, as at the end of a one-shot decode). Decoding a
        whole sequence as one block from the initial state equals ``decode``.
        ``frame_offsets``: index of each block's first frame in its stream (places the noise).
        """
        if not self.supports_block_causal:
            raise ValueError("block_causal: this SNAC checkpoint has windowed attention; block-causal "
                             "decoding is not supported for it")
        if frame_offsets is None:
            frame_offsets = [0] * len(blocks)
        _check_offsets(list(frame_offsets))
        if len(states) != len(blocks) or len(frame_offsets) != len(blocks):
            raise ValueError(f"need one state and one frame offset per block: {len(blocks)} blocks, "
                             f"{len(states)} states, {len(frame_offsets)} offsets")
        checked = self._validate_all(blocks)
        out: list[tuple[torch.Tensor, Any] | None] = [None] * len(blocks)
        for members in self._runs(checked):
            frames = checked[members[0]].numel() // TOKENS_PER_FRAME
            noise = self._noise(frames, [frame_offsets[i] for i in members], None)
            stacked = torch.stack([checked[i] for i in members]).to(device=self.device, dtype=torch.long)
            z = self.quantizer.from_codes(codes_to_codebooks(stacked))
            audio, layer_states = _synthesis_blocks(self.synthesis, z, [states[i] for i in members], noise)
            audio = audio[:, 0].float().clamp_(-1.0, 1.0).cpu()
            for row, i in enumerate(members):
                # clone: a view would keep the whole batch's activations alive with the state
                out[i] = (audio[row], [None if t is None else t[row].clone() for t in layer_states])
        return out  # type: ignore[return-value]

    # ---- encoding (voice cloning) ----------------------------------------------------------

    def _encoder(self) -> SNACAnalysis:
        with self._encoder_lock:
            if self._analysis is None:
                if self.weights_file is None:
                    raise RuntimeError("this SNAC decoder was built without weights to load an encoder from")
                with torch.device("meta"):
                    analysis = _build_analysis(self.model_config)
                key_map = checkpoint_key_map(analysis)
                wanted = {n for k, wn in key_map.values() for n in _all_stored_names(k, wn)}
                state = _read_tensors(self.weights_file, wanted)
                _assign(analysis, _translate(state, key_map, self.weights_file, set()), self.weights_file)
                self._analysis = analysis.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
            return self._analysis

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """1-D waveform at ``sample_rate`` -> frame-major codes (1-D long, CPU).

        The waveform is right-padded with zeros to whole frames (and whole attention windows),
        like the reference; the last frame therefore covers the padding too.
        """
        self.check_waveform(waveform)
        analysis = self._encoder()
        unit = self.hop_length * math.lcm(self.model_config["vq_strides"][0], self.attn_window_size or 1)
        length = waveform.numel()
        x = torch.nn.functional.pad(waveform.to(self.device, self.dtype), (0, -length % unit))
        codes = self.quantizer.quantize(analysis(x[None, None]))
        return codebooks_to_codes([c[0] for c in codes]).cpu()


def _gather_state(states: list[Any], layer: int) -> list[torch.Tensor | None]:
    return [None if state is None else state[layer] for state in states]


def _stream_conv(conv, x: torch.Tensor, past: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 'same'-padded convolution over a block: cached inputs on the left, zeros on the right."""
    pad = conv.padding
    if pad == 0:
        return conv(x), None
    left = torch.stack([p if p is not None else x.new_zeros(x.shape[1], pad) for p in past])
    full = torch.cat([left, x], dim=2)
    y = F.conv1d(F.pad(full, (0, pad)), conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)
    return y, full[:, :, full.shape[2] - pad:]


def _stream_upsample(conv, x: torch.Tensor, past: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stride-s transposed convolution (kernel 2s) over a block: the previous block's last input
    column still reaches into this block's first outputs; the next block's first one is unseen."""
    stride, pad = conv.stride, conv.padding
    left = torch.stack([p if p is not None else x.new_zeros(x.shape[1], 1) for p in past])
    full = torch.cat([left, x], dim=2)
    if conv.upsamples_by_matmul:
        y = upsample_unpadded(full, conv.weight, stride)
        y = y + conv.bias[:, None] if conv.bias is not None else y
    else:
        y = F.conv_transpose1d(full, conv.weight, conv.bias, stride, 0, 0, conv.groups)
    start = stride + pad
    return y[:, :, start:start + x.shape[2] * stride], x[:, :, -1:]


def _synthesis_blocks(synthesis: SNACSynthesis, z: torch.Tensor, states: list[Any],
                      noise: NoiseFn | None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """SNACSynthesis.forward for a batch of blocks, each on its stream's cached state."""
    new: list[torch.Tensor | None] = []

    def past() -> list[torch.Tensor | None]:
        return _gather_state(states, len(new))

    for conv in synthesis.entry:
        z, state = _stream_conv(conv, z, past())
        new.append(state)
    for stage in synthesis.stages:
        x, state = _stream_upsample(stage.up, stage.act(z), past())
        new.append(state)
        if stage.noise is not None:
            x = stage.noise(x, noise)
        for unit in stage.residuals:
            y, state = _stream_conv(unit.conv1, unit.act1(x), past())
            new.append(state)
            x = x + unit.conv2(unit.act2(y))
        z = x
    wave, state = _stream_conv(synthesis.to_wave, synthesis.final_act(z), past())
    new.append(state)
    return torch.tanh(wave), new


def _check_offsets(offsets: Sequence[int]) -> None:
    for off in offsets:
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ValueError(f"frame offsets must be non-negative integers, got {off!r}")


def _build_decoding(cfg: dict[str, Any]) -> tuple[ResidualQuantizer, SNACSynthesis]:
    quantizer = ResidualQuantizer(cfg["latent_dim"], cfg["codebook_size"], cfg["codebook_dim"], cfg["vq_strides"])
    synthesis = SNACSynthesis(cfg["latent_dim"], cfg["decoder_dim"], cfg["decoder_rates"], noise=cfg["noise"],
                              depthwise=cfg["depthwise"], attn_window_size=cfg["attn_window_size"])
    return quantizer, synthesis


def _build_analysis(cfg: dict[str, Any]) -> SNACAnalysis:
    analysis = SNACAnalysis(cfg["encoder_dim"], cfg["encoder_rates"], depthwise=cfg["depthwise"],
                            attn_window_size=cfg["attn_window_size"])
    if analysis.out_dim != cfg["latent_dim"]:
        raise ValueError(f"SNAC config 'latent_dim' = {cfg['latent_dim']} must equal "
                         f"encoder_dim * 2**len(encoder_rates) = {analysis.out_dim}")
    return analysis


def _assign(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    expected = module.state_dict()
    for key, t in tensors.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ValueError(f"{source}: tensor for {key} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected[key].shape)} for this config")
    module.load_state_dict(tensors, strict=True, assign=True)

"""Qwen3-TTS speaker encoder in plain torch: the ECAPA-TDNN x-vector extractor of the Base checkpoints
(voice cloning), with its log-mel front end.

Only Base checkpoints (``tts_model_type`` "base") carry its weights, as ``speaker_encoder.*`` in
``model.safetensors``; CustomVoice and VoiceDesign checkpoints have a ``speaker_encoder_config`` in
their config.json but no weights, and :func:`load_speaker_encoder` refuses them.

Front end (:func:`log_mel_spectrogram`): 24 kHz mono, reflect padding of (n_fft - hop) / 2 = 384
samples each side, STFT (n_fft 1024, hop 256, periodic Hann window of 1024, no centring), magnitude
``sqrt(re^2 + im^2 + 1e-9)``, a Slaney mel filterbank of 128 bands over 0..12 kHz (librosa's default
``htk=False, norm="slaney"``, computed here by :func:`slaney_mel_filterbank`), then
``log(clamp(x, 1e-5))``. It always runs in float32; the encoder casts the mels to its own dtype.

Encoder (:class:`Qwen3TTSSpeakerEncoder`), ECAPA-TDNN without batch norm. Every "TDNN" is a Conv1d
with "same" reflect padding followed by ReLU:

* ``blocks.0``: TDNN mel_dim -> enc_channels[0];
* ``blocks.1..n-2``: SE-Res2Net blocks: ``tdnn1`` (k1), a Res2Net (channels split in
  ``enc_res2net_scale`` chunks: chunk 0 as it is, chunk 1 through ``blocks.0``, chunk i through
  ``blocks.{i-1}`` after adding the previous chunk's output), ``tdnn2`` (k1), squeeze-excitation
  (time mean -> conv1 -> ReLU -> conv2 -> sigmoid, scaling the channels), plus the block's input;
* ``mfa``: TDNN over the concatenated outputs of the SE-Res2Net blocks;
* ``asp``: attentive statistics pooling: [x, mean, std over time] -> ``asp.tdnn`` -> tanh ->
  ``asp.conv`` -> softmax over time; the attention-weighted mean and std
  (``sqrt(clamp(., 1e-12))``, as is the global std) are concatenated;
* ``fc``: Conv1d k1 -> enc_dim, the x-vector.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from audio_pipeline.models.weights import checkpoint_files, load_strict, read_config_json

SAMPLE_RATE = 24000
N_FFT = 1024
HOP_LENGTH = 256
WIN_LENGTH = 1024
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0
MAG_EPS = 1e-9      # added under the magnitude's square root
LOG_FLOOR = 1e-5    # mel energies are clamped to this before the log
STAT_EPS = 1e-12    # variances are clamped to this before the square root

WEIGHT_PREFIX = "speaker_encoder."

# The reference config class's defaults, for keys a config.json leaves out.
CONFIG_DEFAULTS: dict[str, Any] = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}


# ----------------------------------------------------------------------------------------------
# Mel front end

def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (Auditory Toolbox): linear, 3 mels per 200 Hz, below 1 kHz; logarithmic
    above (27 mels per factor of 6.4)."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    mels = hz / f_sp
    log_region = hz >= min_log_hz
    return np.where(log_region, min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_hz_to_mel_slaney`."""
    mels = np.asarray(mels, dtype=np.float64)
    f_sp = 200.0 / 3.0
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    hz = mels * f_sp
    log_region = mels >= min_log_mel
    return np.where(log_region, min_log_hz * np.exp(logstep * (np.maximum(mels, min_log_mel) - min_log_mel)), hz)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """Triangular mel filters, float32 [n_mels, n_fft // 2 + 1], as ``librosa.filters.mel`` with its
    defaults (``htk=False``, ``norm="slaney"``): band edges equally spaced on Slaney's mel scale
    from ``fmin`` to ``fmax`` (default sample_rate / 2), each triangle spanning its two neighbours'
    centres with a peak of 1, then scaled by 2 / (bandwidth in Hz) so that every filter has unit
    area over frequency. The rounding follows librosa's: the triangles are rounded to float32
    before the area scaling, which is applied in float64 and rounded again.
    """
    if fmax is None:
        fmax = sample_rate / 2.0
    if not 0.0 <= fmin < fmax:
        raise ValueError(f"mel filterbank: need 0 <= fmin < fmax, got fmin {fmin}, fmax {fmax}")
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)                      # [n_fft//2 + 1]
    edges_mel = np.linspace(_hz_to_mel_slaney(np.float64(fmin)), _hz_to_mel_slaney(np.float64(fmax)), n_mels + 2)
    edges_hz = _mel_to_hz_slaney(edges_mel)                                       # [n_mels + 2]
    widths = np.diff(edges_hz)                                                    # [n_mels + 1]
    offsets = edges_hz[:, None] - fft_freqs[None, :]                              # [n_mels + 2, bins]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    triangles = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return (triangles * area_norm[:, None]).astype(np.float32)


@lru_cache(maxsize=8)
def _front_end_filterbank(device: torch.device) -> torch.Tensor:
    """The front end's float32 filterbank [128, 513] on ``device`` (shared: never written to)."""
    return torch.from_numpy(slaney_mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS, FMIN, FMAX)).to(device)


def _check_sample_rate(sample_rate: int) -> None:
    if sample_rate != SAMPLE_RATE:
        raise ValueError(f"the Qwen3-TTS speaker encoder takes {SAMPLE_RATE} Hz audio, got {sample_rate} Hz: "
                         f"resample the reference audio to {SAMPLE_RATE} Hz first")


def _as_waveform(waveform: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(waveform, np.ndarray):
        waveform = torch.from_numpy(np.ascontiguousarray(waveform))
    if not isinstance(waveform, torch.Tensor):
        raise TypeError(f"waveform must be a torch.Tensor or numpy array, got {type(waveform).__name__}")
    if waveform.dim() not in (1, 2):
        raise ValueError(f"waveform must be mono, [samples] or [batch, samples]; got shape {tuple(waveform.shape)}")
    if not waveform.is_floating_point():
        raise ValueError(f"waveform must be floating point in [-1, 1], got {waveform.dtype}")
    return waveform.float()


def log_mel_spectrogram(waveform: torch.Tensor | np.ndarray, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """The speaker encoder's float32 log-mel spectrogram of 24 kHz mono audio in [-1, 1]:
    [samples] -> [128, frames], [batch, samples] -> [batch, 128, frames], with
    frames = (samples + 768 - 1024) // 256 + 1. ValueError for another sample rate or audio of
    384 samples or fewer (the reflect padding needs more)."""
    _check_sample_rate(sample_rate)
    waveform = _as_waveform(waveform)
    single = waveform.dim() == 1
    batch = waveform.unsqueeze(0) if single else waveform
    pad = (N_FFT - HOP_LENGTH) // 2
    if batch.shape[-1] <= pad:
        raise ValueError(f"audio too short for the speaker encoder: {batch.shape[-1]} samples, "
                         f"need more than {pad}")
    padded = F.pad(batch.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(WIN_LENGTH, dtype=torch.float32, device=batch.device)
    spec = torch.stft(padded, N_FFT, hop_length=HOP_LENGTH, win_length=WIN_LENGTH, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(spec.real.square() + spec.imag.square() + MAG_EPS)       # [B, bins, frames]
    bank = _front_end_filterbank(batch.device)
    mel = torch.log(torch.clamp(torch.matmul(bank, magnitude), min=LOG_FLOOR))
    return mel[0] if single else mel


# ----------------------------------------------------------------------------------------------
# ECAPA-TDNN

class TDNN(nn.Module):
    """Conv1d with "same" reflect padding, then ReLU (parameters ``conv.weight``, ``conv.bias``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation,
                              padding="same", padding_mode="reflect")

    @property
    def right_padding(self) -> int:
        total = self.conv.dilation[0] * (self.conv.kernel_size[0] - 1)
        return total - total // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Hierarchical residual convolutions over ``scale`` channel groups (``blocks.{0..scale-2}``)."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        if channels % scale:
            raise ValueError(f"speaker encoder: {channels} channels do not split into enc_res2net_scale {scale}")
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.chunk(self.scale, dim=1)
        outputs = [groups[0]]
        previous: torch.Tensor | None = None
        for index, block in enumerate(self.blocks, start=1):
            previous = block(groups[index] if previous is None else groups[index] + previous)
            outputs.append(previous)
        return torch.cat(outputs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time mean: conv1 -> ReLU -> conv2 -> sigmoid."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """tdnn1 (k1) -> Res2Net -> tdnn2 (k1) -> squeeze-excitation, plus the input."""

    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int,
                 kernel_size: int, dilation: int):
        super().__init__()
        if in_channels != out_channels:
            raise ValueError(f"speaker encoder: an SE-Res2Net block's residual needs equal channels, "
                             f"got {in_channels} -> {out_channels}")
        self.tdnn1 = TDNN(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2Net(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TDNN(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitation(out_channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of x [B, C, T] over time under weights summing to 1 over T ([B, 1 or C, T])."""
    mean = (weights * x).sum(dim=2)
    variance = (weights * (x - mean.unsqueeze(2)).square()).sum(dim=2)
    return mean, torch.sqrt(variance.clamp(min=STAT_EPS))


class AttentiveStatsPool(nn.Module):
    """Attentive statistics pooling: [B, C, T] -> [B, 2C] (weighted mean, then weighted std)."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[2]
        uniform = torch.full((x.shape[0], 1, frames), 1.0 / frames, dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, uniform)   # population std (divides by T)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, frames),
                             std.unsqueeze(2).expand(-1, -1, frames)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1)


class Qwen3TTSSpeakerEncoder(nn.Module):
    """The ECAPA-TDNN x-vector extractor of Qwen3-TTS Base checkpoints.

    Built from the checkpoint's ``speaker_encoder_config`` dict (missing keys take the reference
    config's defaults); parameter names are the checkpoint's without the ``speaker_encoder.``
    prefix. ``forward`` takes log-mels [B, mel_dim, frames] and returns [B, enc_dim];
    :meth:`embed` takes a 24 kHz waveform and returns its x-vector [enc_dim] (in the module's dtype).
    """

    def __init__(self, config: Mapping[str, Any]):
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **dict(config)}
        channels = list(cfg["enc_channels"])
        kernels = list(cfg["enc_kernel_sizes"])
        dilations = list(cfg["enc_dilations"])
        if not (len(channels) == len(kernels) == len(dilations)) or len(channels) < 3:
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations need the "
                             f"same length (at least 3), got {len(channels)}, {len(kernels)}, {len(dilations)}")
        if int(cfg["mel_dim"]) != N_MELS:
            raise ValueError(f"speaker_encoder_config: mel_dim {cfg['mel_dim']} is not supported "
                             f"(the front end makes {N_MELS} mel bands)")
        if int(cfg["sample_rate"]) != SAMPLE_RATE:
            raise ValueError(f"speaker_encoder_config: sample_rate {cfg['sample_rate']} is not supported "
                             f"(the front end is for {SAMPLE_RATE} Hz)")
        self.config = cfg
        self.mel_dim = int(cfg["mel_dim"])
        self.enc_dim = int(cfg["enc_dim"])
        self.sample_rate = int(cfg["sample_rate"])

        self.blocks = nn.ModuleList([TDNN(self.mel_dim, channels[0], kernels[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(SERes2NetBlock(channels[i - 1], channels[i], int(cfg["enc_res2net_scale"]),
                                              int(cfg["enc_se_channels"]), kernels[i], dilations[i]))
        aggregated = sum(channels[1:-1])
        self.mfa = TDNN(aggregated, channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatsPool(channels[-1], int(cfg["enc_attention_channels"]))
        self.fc = nn.Conv1d(channels[-1] * 2, self.enc_dim, 1)
        # Reflect padding needs more frames than any TDNN pads on one side.
        tdnns = [m for m in self.modules() if isinstance(m, TDNN)]
        self.min_frames = max(t.right_padding for t in tdnns) + 1

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mels [B, mel_dim, frames] -> x-vectors [B, enc_dim]."""
        if mels.dim() != 3 or mels.shape[1] != self.mel_dim:
            raise ValueError(f"speaker encoder: expected mels [batch, {self.mel_dim}, frames], got {tuple(mels.shape)}")
        if mels.shape[2] < self.min_frames:
            raise ValueError(f"audio too short for the speaker encoder: {mels.shape[2]} mel frames, "
                             f"need at least {self.min_frames} (about {self.min_samples} samples)")
        x = mels
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        pooled = self.asp(x).unsqueeze(2)
        return self.fc(pooled).squeeze(2)

    @property
    def min_samples(self) -> int:
        """The fewest samples :meth:`embed` accepts."""
        # frames = (samples + 2 * 384 - 1024) // 256 + 1 = samples // 256 for samples > 384
        return max(self.min_frames * HOP_LENGTH, (N_FFT - HOP_LENGTH) // 2 + 1)

    def _param(self) -> torch.Tensor:
        return self.fc.weight

    def mel_spectrogram(self, waveform_24k: torch.Tensor | np.ndarray, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """float32 log-mels [128, frames] of a 24 kHz mono waveform ([batch, samples] gives a batch),
        computed on the module's device."""
        waveform = _as_waveform(waveform_24k).to(self._param().device)
        return log_mel_spectrogram(waveform, sample_rate)

    @torch.no_grad()
    def embed(self, waveform_24k: torch.Tensor | np.ndarray, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """The x-vector [enc_dim] of a 24 kHz mono waveform in [-1, 1] (a [batch, samples] input gives
        [batch, enc_dim]); ValueError for another sample rate or too short audio."""
        mels = self.mel_spectrogram(waveform_24k, sample_rate)
        single = mels.dim() == 2
        if single:
            mels = mels.unsqueeze(0)
        vectors = self(mels.to(self._param().dtype))
        return vectors[0] if single else vectors


# ----------------------------------------------------------------------------------------------
# Loading

def load_speaker_encoder(model_dir: str | Path, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> Qwen3TTSSpeakerEncoder:
    """The speaker encoder of a Qwen3-TTS Base checkpoint directory: config.json's
    ``speaker_encoder_config`` and the ``speaker_encoder.*`` tensors of its safetensors (stored bf16,
    cast to ``dtype``), in eval mode on ``device``. ValueError for a checkpoint without a speaker
    encoder (CustomVoice, VoiceDesign) or whose tensors do not fit the config."""
    model_dir = Path(model_dir)
    data = read_config_json(model_dir, "Qwen3-TTS")
    if not isinstance(data, dict):
        raise ValueError(f"{model_dir}/config.json: not a JSON object")
    model_type = data.get("tts_model_type")
    if model_type is not None and model_type != "base":
        raise ValueError(f"{model_dir}: a Qwen3-TTS {model_type!r} checkpoint has no speaker encoder "
                         f"(voice cloning needs a Base checkpoint)")
    config = data.get("speaker_encoder_config")
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir}/config.json has no speaker_encoder_config: this checkpoint has no "
                         f"speaker encoder (voice cloning needs a Qwen3-TTS Base checkpoint)")
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(WEIGHT_PREFIX):
                    tensors[key[len(WEIGHT_PREFIX):]] = f.get_tensor(key).to(dtype=dtype)
    if not tensors:
        raise ValueError(f"{model_dir}: no {WEIGHT_PREFIX}* tensors in the checkpoint: it has no speaker "
                         f"encoder (voice cloning needs a Qwen3-TTS Base checkpoint)")
    encoder = Qwen3TTSSpeakerEncoder(config).to(dtype=dtype)
    load_strict(encoder, tensors, "Qwen3-TTS speaker encoder")
    return encoder.to(device=device).eval().requires_grad_(False)

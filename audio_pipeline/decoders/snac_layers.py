"""Networks of the SNAC codec (multi-scale neural audio codec), inference only.

The module tree here is the project's own; the published checkpoints use a different one
(``encoder.block.N...``, ``decoder.model.N...``, ``quantizer.quantizers.N...`` with weight-normed
convolutions). Every module that owns tensors records where they live in a checkpoint
(``ckpt_prefix`` plus :attr:`CheckpointLeaf.CKPT_NAMES`), and :func:`checkpoint_key_map` walks a
tree to produce the ``our key -> checkpoint key`` translation used for loading and saving.

Weight norm is folded away at load time: convolutions hold plain weights.

Architecture facts (needed to be numerically equal to the published models):

* activation: Snake, ``x + 1/(alpha + 1e-9) * sin(alpha * x)^2`` with a per-channel ``alpha``;
* residual unit: Snake, conv k7 (dilation d, "same" padding 3d, optionally depthwise), Snake,
  conv 1x1, plus the skip connection; dilations 1, 3, 9 per stage;
* decoder stage: Snake, transposed conv (kernel 2s, stride s, padding ceil(s/2), output padding
  s % 2, so T -> T * s exactly), optional noise injection, three residual units;
* encoder stage: three residual units, Snake, strided conv (kernel 2s, stride s, padding ceil(s/2));
* noise injection: ``x + n * conv1x1(x)`` with ``n`` one standard-normal value per (item, time)
  shared across channels;
* local attention: pre-LayerNorm, non-overlapping windows, 64-dim heads, rotary position
  embedding inside each window, residual;
* quantizer: per level a 1x1 projection down to ``codebook_dim``, a codebook (cosine nearest
  neighbour when encoding), a 1x1 projection back up; a level with stride s works on s-step
  averages and repeats its output s times.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

#: The decoder's noise: ``(stage, batch, length, device, dtype) -> (batch, 1, length)`` tensor
#: (``stage``: index of the upsampling stage asking), or None for no noise at all.
NoiseFn = Callable[[int, int, int, torch.device, torch.dtype], torch.Tensor]

ATTENTION_HEAD_DIM = 64
RESIDUAL_DILATIONS = (1, 3, 9)
RESIDUAL_KERNEL = 7


# --------------------------------------------------------------------------------------------
# checkpoint bookkeeping


class CheckpointLeaf(nn.Module):
    """A module whose own tensors map onto checkpoint keys ``f"{ckpt_prefix}.{CKPT_NAMES[name]}"``.

    Names in :attr:`WEIGHT_NORMED` are stored weight-normed in the published checkpoints
    (``weight_g``/``weight_v`` or ``parametrizations.weight.original0``/``original1``);
    :attr:`IGNORED` lists checkpoint suffixes that may be present and carry nothing we need.
    """

    CKPT_NAMES: dict[str, str] = {}
    WEIGHT_NORMED: frozenset[str] = frozenset()
    IGNORED: tuple[str, ...] = ()

    def __init__(self, ckpt_prefix: str):
        super().__init__()
        self.ckpt_prefix = ckpt_prefix


def checkpoint_key_map(root: nn.Module) -> dict[str, tuple[str, bool]]:
    """``{our state-dict key: (checkpoint key, weight_normed)}`` for every tensor under ``root``."""
    mapping: dict[str, tuple[str, bool]] = {}
    for name, module in root.named_modules():
        if not isinstance(module, CheckpointLeaf):
            continue
        for ours, theirs in module.CKPT_NAMES.items():
            key = f"{name}.{ours}" if name else ours
            mapping[key] = (f"{module.ckpt_prefix}.{theirs}", ours in module.WEIGHT_NORMED)
    return mapping


def ignored_checkpoint_keys(root: nn.Module) -> set[str]:
    """Checkpoint keys that may be present under ``root`` and are not loaded (e.g. rotary tables)."""
    return {f"{m.ckpt_prefix}.{s}" for m in root.modules() if isinstance(m, CheckpointLeaf)
            for s in m.IGNORED}


# --------------------------------------------------------------------------------------------
# leaves


class Snake(CheckpointLeaf):
    """Periodic activation with a learned per-channel frequency."""

    CKPT_NAMES = {"alpha": "alpha"}

    def __init__(self, channels: int, ckpt_prefix: str):
        super().__init__(ckpt_prefix)
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha
        if torch.is_grad_enabled():
            return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
        # Same arithmetic with one temporary instead of four (these tensors are the largest ones).
        return torch.mul(x, alpha).sin_().pow_(2).mul_((alpha + 1e-9).reciprocal()).add_(x)


class Conv(CheckpointLeaf):
    """1-D convolution (or transposed convolution) with plain weights; weight norm is folded."""

    WEIGHT_NORMED = frozenset({"weight"})

    def __init__(self, in_ch: int, out_ch: int, kernel: int, ckpt_prefix: str, *, stride: int = 1,
                 padding: int = 0, dilation: int = 1, groups: int = 1, bias: bool = True,
                 transposed: bool = False, output_padding: int = 0):
        super().__init__(ckpt_prefix)
        if in_ch % groups or out_ch % groups:
            raise ValueError(f"{ckpt_prefix}: channels {in_ch}->{out_ch} not divisible by groups {groups}")
        self.transposed = transposed
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.output_padding = output_padding
        self.kernel = kernel
        shape = (in_ch, out_ch // groups, kernel) if transposed else (out_ch, in_ch // groups, kernel)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(out_ch)) if bias else None
        self.CKPT_NAMES = {"weight": "weight", **({"bias": "bias"} if bias else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            if self.upsamples_by_matmul:
                full = upsample_unpadded(x, self.weight, self.stride)
                end = full.shape[-1] - self.padding + self.output_padding
                y = full[:, :, self.padding:end]
                return y + self.bias[:, None] if self.bias is not None else y
            return F.conv_transpose1d(x, self.weight, self.bias, self.stride, self.padding,
                                      self.output_padding, self.groups, self.dilation)
        return F.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    @property
    def upsamples_by_matmul(self) -> bool:
        """Whether :func:`upsample_unpadded` computes this transposed convolution (SNAC's shape)."""
        return (self.transposed and self.kernel == 2 * self.stride and self.groups == 1 and self.dilation == 1
                and self.output_padding <= self.padding)

    def fan_in(self) -> int:
        return self.weight.shape[1] * self.kernel


def upsample_unpadded(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """``conv_transpose1d(x, weight, stride=stride)`` for a kernel of ``2 * stride``, no bias or padding:
    (B, out, (T + 1) * stride).

    Written as one matrix product and an overlap-add of two halves: PyTorch's CPU kernel for
    transposed convolutions takes ~10x longer on the short inputs of streaming chunks.
    """
    batch, channels, steps = x.shape
    out_channels = weight.shape[1]
    columns = torch.matmul(x.transpose(1, 2), weight.reshape(channels, out_channels * 2 * stride))
    columns = columns.view(batch, steps, out_channels, 2 * stride)
    out = x.new_zeros(batch, steps + 1, out_channels, stride)
    out[:, :steps] = columns[..., :stride]
    out[:, 1:] += columns[..., stride:]
    return out.permute(0, 2, 1, 3).reshape(batch, out_channels, (steps + 1) * stride)


class NoiseInjection(CheckpointLeaf):
    """``x + n * P x``: ``n`` is external standard-normal noise, ``P`` a learned 1x1 map."""

    CKPT_NAMES = {"proj": "linear.weight"}
    WEIGHT_NORMED = frozenset({"proj"})

    def __init__(self, channels: int, stage: int, ckpt_prefix: str):
        super().__init__(ckpt_prefix)
        self.stage = stage
        self.proj = nn.Parameter(torch.empty(channels, channels, 1))

    def forward(self, x: torch.Tensor, noise: NoiseFn | None) -> torch.Tensor:
        if noise is None:
            return x
        n = noise(self.stage, x.shape[0], x.shape[-1], x.device, x.dtype)
        return x + n * F.conv1d(x, self.proj)


class WindowedSelfAttention(CheckpointLeaf):
    """Pre-norm self-attention inside non-overlapping windows, rotary positions per window."""

    CKPT_NAMES = {"norm_weight": "norm.weight", "norm_bias": "norm.bias",
                  "qkv": "to_qkv.weight", "out": "to_out.weight"}
    IGNORED = ("rel_pos.inv_freq",)  # a deterministic table; recomputed here

    def __init__(self, dim: int, window: int, ckpt_prefix: str):
        super().__init__(ckpt_prefix)
        if dim % ATTENTION_HEAD_DIM:
            raise ValueError(f"attention needs a width that is a multiple of {ATTENTION_HEAD_DIM}, got {dim}")
        self.dim, self.window, self.heads = dim, window, dim // ATTENTION_HEAD_DIM
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.norm_bias = nn.Parameter(torch.zeros(dim))
        self.qkv = nn.Parameter(torch.empty(3 * dim, dim))
        self.out = nn.Parameter(torch.empty(dim, dim))

    def _rotary(self, t: torch.Tensor) -> torch.Tensor:
        d = ATTENTION_HEAD_DIM
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=t.device).float() / d))
        angle = torch.arange(self.window, device=t.device).float()[:, None] * inv_freq[None, :]
        angle = torch.cat((angle, angle), dim=-1).to(t.dtype)
        first, second = t[..., : d // 2], t[..., d // 2:]
        turned = torch.cat((-second, first), dim=-1)
        return t * angle.cos() + turned * angle.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        if t % self.window:
            raise ValueError(f"local attention needs a length that is a multiple of the window "
                             f"{self.window}, got {t}")
        h = F.layer_norm(x.transpose(1, 2), (c,), self.norm_weight, self.norm_bias)
        q, k, v = F.linear(h, self.qkv).chunk(3, dim=-1)

        def windows(z: torch.Tensor) -> torch.Tensor:  # (b, t, c) -> (b, heads, n_win, window, d)
            return z.reshape(b, t // self.window, self.window, self.heads, ATTENTION_HEAD_DIM).permute(0, 3, 1, 2, 4)

        q, k, v = windows(q), windows(k), windows(v)
        q, k = self._rotary(q), self._rotary(k)
        o = F.scaled_dot_product_attention(q, k, v)
        o = o.permute(0, 2, 3, 1, 4).reshape(b, t, c)
        return F.linear(o, self.out).transpose(1, 2) + x


class Codebook(CheckpointLeaf):
    """The code vectors of one quantizer level."""

    CKPT_NAMES = {"vectors": "codebook.weight"}

    def __init__(self, size: int, dim: int, ckpt_prefix: str):
        super().__init__(ckpt_prefix)
        self.vectors = nn.Parameter(torch.empty(size, dim))


# --------------------------------------------------------------------------------------------
# composite blocks


class DilatedResidual(nn.Module):
    """``x + conv1x1(snake(conv_k7_dilated(snake(x))))``."""

    def __init__(self, channels: int, dilation: int, groups: int, ckpt_prefix: str):
        super().__init__()
        pad = (RESIDUAL_KERNEL - 1) * dilation // 2
        self.act1 = Snake(channels, f"{ckpt_prefix}.block.0")
        self.conv1 = Conv(channels, channels, RESIDUAL_KERNEL, f"{ckpt_prefix}.block.1",
                          dilation=dilation, padding=pad, groups=groups)
        self.act2 = Snake(channels, f"{ckpt_prefix}.block.2")
        self.conv2 = Conv(channels, channels, 1, f"{ckpt_prefix}.block.3")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.act2(self.conv1(self.act1(x))))
        return x + y if torch.is_grad_enabled() else y.add_(x)


def _residual_stack(channels: int, groups: int, ckpt_prefix: str, first_index: int) -> nn.ModuleList:
    return nn.ModuleList(
        DilatedResidual(channels, d, groups, f"{ckpt_prefix}.block.{first_index + i}")
        for i, d in enumerate(RESIDUAL_DILATIONS))


class UpStage(nn.Module):
    """Decoder stage: Snake, x``stride`` transposed conv, optional noise, residual stack."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, noise: bool, groups: int, ckpt_prefix: str,
                 stage: int = 0):
        super().__init__()
        self.act = Snake(in_ch, f"{ckpt_prefix}.block.0")
        self.up = Conv(in_ch, out_ch, 2 * stride, f"{ckpt_prefix}.block.1", stride=stride,
                       padding=math.ceil(stride / 2), output_padding=stride % 2, transposed=True)
        self.noise = NoiseInjection(out_ch, stage, f"{ckpt_prefix}.block.2") if noise else None
        self.residuals = _residual_stack(out_ch, groups, ckpt_prefix, 3 if noise else 2)

    def forward(self, x: torch.Tensor, noise: NoiseFn | None) -> torch.Tensor:
        x = self.up(self.act(x))
        if self.noise is not None:
            x = self.noise(x, noise)
        for unit in self.residuals:
            x = unit(x)
        return x


class DownStage(nn.Module):
    """Encoder stage: residual stack, Snake, /``stride`` strided conv doubling the width."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int, ckpt_prefix: str):
        super().__init__()
        self.residuals = _residual_stack(in_ch, groups, ckpt_prefix, 0)
        self.act = Snake(in_ch, f"{ckpt_prefix}.block.3")
        self.down = Conv(in_ch, out_ch, 2 * stride, f"{ckpt_prefix}.block.4", stride=stride,
                         padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.residuals:
            x = unit(x)
        return self.down(self.act(x))


# --------------------------------------------------------------------------------------------
# networks


class SNACSynthesis(nn.Module):
    """Latent (``latent_dim`` x T) -> waveform (1 x T * prod(rates)) in (-1, 1)."""

    def __init__(self, latent_dim: int, channels: int, rates: Iterable[int], *, noise: bool,
                 depthwise: bool, attn_window_size: int | None, ckpt_prefix: str = "decoder.model"):
        super().__init__()
        rates = list(rates)
        idx = 0
        self.entry = nn.ModuleList()
        if depthwise:
            self.entry.append(Conv(latent_dim, latent_dim, 7, f"{ckpt_prefix}.0", padding=3, groups=latent_dim))
            self.entry.append(Conv(latent_dim, channels, 1, f"{ckpt_prefix}.1"))
            idx = 2
        else:
            self.entry.append(Conv(latent_dim, channels, 7, f"{ckpt_prefix}.0", padding=3))
            idx = 1
        self.attention = None
        if attn_window_size is not None:
            self.attention = WindowedSelfAttention(channels, attn_window_size, f"{ckpt_prefix}.{idx}")
            idx += 1
        self.stages = nn.ModuleList()
        width = channels
        for stage, stride in enumerate(rates):
            out = width // 2
            self.stages.append(UpStage(width, out, stride, noise, out if depthwise else 1, f"{ckpt_prefix}.{idx}",
                                       stage))
            width, idx = out, idx + 1
        self.final_act = Snake(width, f"{ckpt_prefix}.{idx}")
        self.to_wave = Conv(width, 1, 7, f"{ckpt_prefix}.{idx + 1}", padding=3)  # tanh follows: no params

    def forward(self, z: torch.Tensor, noise: NoiseFn | None = None) -> torch.Tensor:
        for conv in self.entry:
            z = conv(z)
        if self.attention is not None:
            z = self.attention(z)
        for stage in self.stages:
            z = stage(z, noise)
        return torch.tanh(self.to_wave(self.final_act(z)))


class SNACAnalysis(nn.Module):
    """Waveform (1 x L) -> latent (``encoder_dim * 2**len(rates)`` x L / prod(rates))."""

    def __init__(self, width: int, rates: Iterable[int], *, depthwise: bool,
                 attn_window_size: int | None, ckpt_prefix: str = "encoder.block"):
        super().__init__()
        self.entry = Conv(1, width, 7, f"{ckpt_prefix}.0", padding=3)
        self.stages = nn.ModuleList()
        idx = 1
        for stride in rates:
            self.stages.append(DownStage(width, 2 * width, stride, width if depthwise else 1, f"{ckpt_prefix}.{idx}"))
            width, idx = 2 * width, idx + 1
        self.attention = None
        if attn_window_size is not None:
            self.attention = WindowedSelfAttention(width, attn_window_size, f"{ckpt_prefix}.{idx}")
            idx += 1
        self.exit = Conv(width, width, 7, f"{ckpt_prefix}.{idx}", padding=3, groups=width if depthwise else 1)
        self.out_dim = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.entry(x)
        for stage in self.stages:
            x = stage(x)
        if self.attention is not None:
            x = self.attention(x)
        return self.exit(x)


class QuantizerLevel(nn.Module):
    """One residual level: project down, look up / search the codebook, project up, repeat."""

    def __init__(self, latent_dim: int, size: int, dim: int, stride: int, ckpt_prefix: str):
        super().__init__()
        self.stride = stride
        self.down = Conv(latent_dim, dim, 1, f"{ckpt_prefix}.in_proj")
        self.up = Conv(dim, latent_dim, 1, f"{ckpt_prefix}.out_proj")
        self.codebook = Codebook(size, dim, ckpt_prefix)

    def from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) codes -> (B, latent, T * stride)."""
        z = self.up(F.embedding(codes, self.codebook.vectors).transpose(1, 2))
        return _repeat_steps(z, self.stride)

    def quantize(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, latent, T) -> (its quantized approximation, (B, T / stride) codes)."""
        x = F.avg_pool1d(residual, self.stride, self.stride) if self.stride > 1 else residual
        projected = self.down(x)
        b, d, t = projected.shape
        flat = F.normalize(projected.transpose(1, 2).reshape(b * t, d))
        book = F.normalize(self.codebook.vectors)
        # Squared distance between unit vectors, written out term by term (including the row
        # constant) so that near-ties resolve exactly as in the published implementation.
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].reshape(b, t)
        chosen = F.embedding(codes, self.codebook.vectors).transpose(1, 2)
        # The training-time straight-through form: its rounding feeds the next level's residual.
        chosen = projected + (chosen - projected)
        z = self.up(chosen)
        return _repeat_steps(z, self.stride), codes


def _repeat_steps(z: torch.Tensor, times: int) -> torch.Tensor:
    """Each time step ``times`` times in a row (``repeat_interleave`` on the last dimension), as a
    view expanded and copied once: no repeat count goes through the host, so a CUDA graph can hold it."""
    if times == 1:
        return z
    return z.unsqueeze(-1).expand(*z.shape, times).reshape(*z.shape[:-1], z.shape[-1] * times)


class ResidualQuantizer(nn.Module):
    def __init__(self, latent_dim: int, size: int, dim: int, strides: Iterable[int],
                 ckpt_prefix: str = "quantizer.quantizers"):
        super().__init__()
        self.levels = nn.ModuleList(QuantizerLevel(latent_dim, size, dim, s, f"{ckpt_prefix}.{i}")
                                    for i, s in enumerate(strides))

    def from_codes(self, codes: list[torch.Tensor]) -> torch.Tensor:
        total = None
        for level, c in zip(self.levels, codes):
            z = level.from_codes(c)
            total = z if total is None else total + z
        return total

    def quantize(self, z: torch.Tensor) -> list[torch.Tensor]:
        residual, codes = z, []
        for level in self.levels:
            q, c = level.quantize(residual)
            residual = residual - q
            codes.append(c)
        return codes

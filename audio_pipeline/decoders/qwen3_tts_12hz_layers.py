"""The Qwen3-TTS 12 Hz speech tokenizer's decoder network, layer by layer (module names are the
checkpoint's), with the state every causal layer hands from one block of a stream to the next
(:class:`StreamPass`); decoders/qwen3_tts_12hz.py loads it and streams with it."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# one batched forward over streams


class StreamPass:
    """One forward over a batch of streams' blocks: their states in, their new states out.

    Blocks are right-padded to the longest; ``frames`` says how many are each row's own. A layer
    reading ``rate`` positions per frame takes each row's new state at ``frames * rate``.
    """

    def __init__(self, convs: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                 kept: torch.Tensor, frames: torch.Tensor):
        self.convs, self.new_convs = convs, [None] * len(convs)
        #: Per layer (B, kv_heads, longest kept, head_dim), each row's keys left-padded; ``kept`` counts them.
        self.keys, self.values, self.kept = keys, values, kept
        self.new_keys: list[torch.Tensor | None] = [None] * len(keys)
        self.new_values: list[torch.Tensor | None] = [None] * len(keys)
        self.frames = frames

    def ends(self, rate: int) -> torch.Tensor:
        return self.frames * rate


def _rows_tail(x: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
    """Row ``b`` of the (B, C, T) ``x``'s ``width`` columns before ``ends[b]``: (B, C, width)."""
    index = (ends[:, None] - width + torch.arange(width, device=x.device))[:, None, :]
    return x.gather(2, index.expand(x.shape[0], x.shape[1], width))


# --------------------------------------------------------------------------------------------
# layers (module names are the checkpoint's)


class _SnakeBeta(nn.Module):
    """``x + sin(x * a)^2 / b``, per channel, with ``a``, ``b`` stored as logarithms."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        #: (a, 1 / b) as the forward uses them, once the weights are final (:meth:`freeze`).
        self._scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.alpha.exp()[None, :, None], 1.0 / (self.beta.exp()[None, :, None] + 1e-9)

    def freeze(self) -> None:
        """Computes the scales once: a decoder call runs some thirty of these layers, and their
        kernel launches are what a small block's call costs on a GPU."""
        with torch.no_grad():
            self._scales = self.scales()

    def forward(self, x: torch.Tensor, run: StreamPass | None = None) -> torch.Tensor:
        alpha, inverse_beta = self._scales or self.scales()
        return x + inverse_beta * torch.sin(x * alpha).pow(2)


class CausalConv(nn.Module):
    """A stride-1 convolution padded on the left only; in a stream, the inputs it saw last are the padding."""

    def __init__(self, cin: int, cout: int, kernel: int, *, rate: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.history, self.rate = (kernel - 1) * dilation, rate
        self.slot = -1  # its place in the state (set by the network; none without history)

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        if not self.history:
            return self.conv(x)
        full = torch.cat([run.convs[self.slot], x], dim=2)
        run.new_convs[self.slot] = _rows_tail(full, run.ends(self.rate) + self.history, self.history)
        return self.conv(full)


class _CausalTransposedConv(nn.Module):
    """A transposed convolution trimmed on the right by ``kernel - stride``; in a stream, what it
    trims is the start of the next block's samples, carried in the state."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, *, rate: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride)
        self.overlap, self.stride, self.rate = kernel - stride, stride, rate
        self.slot = -1

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        emitted = x.shape[2] * self.stride
        if not self.overlap:
            return self.conv(x)
        ends = run.ends(self.rate)
        # a padded input would reach the row's carry: zero it (the bias is added once per sample anyway)
        real = torch.arange(x.shape[2], device=x.device)[None, :] < ends[:, None]
        y = self.conv(x * real[:, None, :].to(x.dtype))
        y = torch.cat([y[:, :, :self.overlap] + run.convs[self.slot], y[:, :, self.overlap:]], dim=2)
        run.new_convs[self.slot] = (_rows_tail(y, ends * self.stride + self.overlap, self.overlap)
                                    - self.conv.bias[None, :, None])
        return y[:, :, :emitted]


class _ConvNeXt(nn.Module):
    def __init__(self, dim: int, *, rate: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, rate=rate, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(self.dwconv(x, run).transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2)


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, *, rate: int):
        super().__init__()
        self.act1, self.act2 = _SnakeBeta(dim), _SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, rate=rate, dilation=dilation)
        self.conv2 = CausalConv(dim, dim, 1, rate=rate)

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), run)), run)


class _DecoderBlock(nn.Module):
    """SnakeBeta, a transposed convolution upsampling ``r`` times, residual units dilated 1, 3, 9."""

    def __init__(self, cin: int, cout: int, r: int, *, rate: int):
        super().__init__()
        self.block = nn.ModuleList([_SnakeBeta(cin), _CausalTransposedConv(cin, cout, 2 * r, r, rate=rate),
                                    *(_ResidualUnit(cout, d, rate=rate * r) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, run)
        return x


class _Quantizer(nn.Module):
    """Codes -> latents: codebook 0 and the sum of the others, each through its own projection.

    The checkpoint stores each codebook as ``embedding_sum`` and ``cluster_usage`` (EMA
    statistics); ``embeddings`` holds their quotient, computed once at load.
    """

    def __init__(self, codebooks: int, size: int, dim: int):
        super().__init__()
        self.embeddings = nn.Parameter(torch.zeros(codebooks, size, dim // 2))
        self.first_proj = nn.Conv1d(dim // 2, dim, 1, bias=False)
        self.rest_proj = nn.Conv1d(dim // 2, dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, codebooks, T) -> (B, dim, T)."""
        picked = torch.stack([F.embedding(codes[:, k], table) for k, table in enumerate(self.embeddings)], dim=1)
        picked = picked.transpose(2, 3)  # (B, codebooks, dim / 2, T)
        return self.first_proj(picked[:, 0]) + self.rest_proj(picked[:, 1:].sum(dim=1))


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the rotate-half form."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, hidden) after the cached (B, kv_heads, K, head_dim) keys / values (unrotated);
        cos / sin at positions 0 .. K + T - 1. Returns (output, all keys, all values), unrotated."""
        batch, steps, _ = x.shape
        q = self.q_proj(x).view(batch, steps, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        keys, values = torch.cat([past_keys, k], dim=2), torch.cat([past_values, v], dim=2)
        q, k_rot = _rotate(q, cos[-steps:], sin[-steps:]), _rotate(keys, cos, sin)
        group = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, k_rot.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                             attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, -1)), keys, values


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(hidden, eps), _RMSNorm(hidden, eps)
        self.self_attn = _Attention(hidden, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    bool(cfg.get("attention_bias", False)))
        self.mlp = _MLP(hidden, cfg["intermediate_size"])
        self.self_attn_layer_scale, self.mlp_layer_scale = _LayerScale(hidden), _LayerScale(hidden)


class _Transformer(nn.Module):
    """Pre-norm transformer over frames; a frame attends to itself and the ``window - 1`` before it."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, latent = cfg["hidden_size"], cfg["latent_dim"]
        self.input_proj, self.output_proj = nn.Linear(latent, hidden), nn.Linear(hidden, latent)
        self.layers = nn.ModuleList(_TransformerLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = _RMSNorm(hidden, cfg["rms_norm_eps"])
        self.window, self.head_dim, self.theta = cfg["sliding_window"], cfg["head_dim"], float(cfg["rope_theta"])

    def forward(self, x: torch.Tensor, run: StreamPass) -> torch.Tensor:
        """x (B, latent, T) -> (B, latent, T), each row after its ``run.kept`` cached frames."""
        steps, cached = x.shape[2], run.keys[0].shape[2]
        device = x.device
        positions = torch.arange(cached + steps, device=device)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)
        angles = positions[:, None].float() * inv_freq[None, :]
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(x.dtype) for f in (torch.cos, torch.sin))
        ago = positions[cached:, None] - positions[None, :]  # query position - key position
        cached_from = (cached - run.kept)[:, None, None]  # each row's first real cached key
        mask = ((ago >= 0) & (ago < self.window))[None] & (positions[None, None, :] >= cached_from)
        h = self.input_proj(x.transpose(1, 2))
        for i, layer in enumerate(self.layers):
            attended, run.new_keys[i], run.new_values[i] = layer.self_attn(
                layer.input_layernorm(h), run.keys[i], run.values[i], cos, sin, mask[:, None])
            h = h + layer.self_attn_layer_scale(attended)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return self.output_proj(self.norm(h)).transpose(1, 2)


class DecoderNet(nn.Module):
    """The speech tokenizer's decoder (its module names, but for the quantizer: see _Quantizer)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        latent, ratios, rates = cfg["latent_dim"], list(cfg["upsampling_ratios"]), list(cfg["upsample_rates"])
        self.quantizer = _Quantizer(cfg["num_quantizers"], cfg["codebook_size"], cfg["codebook_dim"])
        self.pre_conv = CausalConv(cfg["codebook_dim"], latent, 3, rate=1)
        self.pre_transformer = _Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([_CausalTransposedConv(latent, latent, f, f, rate=math.prod(ratios[:i])),
                           _ConvNeXt(latent, rate=math.prod(ratios[:i + 1]))]) for i, f in enumerate(ratios))
        up, dim = math.prod(ratios), cfg["decoder_dim"]
        blocks = [_DecoderBlock(dim // 2 ** i, dim // 2 ** (i + 1), r, rate=up * math.prod(rates[:i]))
                  for i, r in enumerate(rates)]
        out_dim, self.samples_per_frame = dim // 2 ** len(rates), up * math.prod(rates)
        self.decoder = nn.ModuleList([CausalConv(latent, dim, 7, rate=up), *blocks, _SnakeBeta(out_dim),
                                      CausalConv(out_dim, 1, 7, rate=self.samples_per_frame)])
        #: The layers with a place in the state, in order.
        self.stateful = [m for m in self.modules() if getattr(m, "history", 0) or getattr(m, "overlap", 0)]
        for slot, layer in enumerate(self.stateful):
            layer.slot = slot

    def freeze(self) -> None:
        """Precomputes what depends on the weights alone; call once they are loaded and placed."""
        for module in self.modules():
            if isinstance(module, _SnakeBeta):
                module.freeze()

    def forward(self, codes: torch.Tensor, run: StreamPass) -> torch.Tensor:
        """(B, codebooks, T) codes -> (B, T * samples_per_frame) audio in [-1, 1]."""
        x = self.pre_transformer(self.pre_conv(self.quantizer(codes), run), run)
        for transposed, convnext in self.upsample:
            x = convnext(transposed(x, run), run)
        for layer in self.decoder:
            x = layer(x, run)
        return x[:, 0].clamp(-1.0, 1.0)

    def lookback_frames(self) -> int:
        """Frames before a frame that reach its audio: the dependencies of its first sample, traced
        back through every layer to the frames."""
        first = 10 ** 9  # the first sample of a frame far from the start (no clamping at 0)
        index = first * self.samples_per_frame

        def back(layer: nn.Module, i: int) -> int:
            if isinstance(layer, CausalConv):
                return i - layer.history
            if isinstance(layer, _CausalTransposedConv):  # output i gets input j where 0 <= i - j * s < k
                return -((layer.overlap + layer.stride - 1 - i) // layer.stride)
            if isinstance(layer, (_ResidualUnit, _ConvNeXt)):
                return back(layer.conv1 if isinstance(layer, _ResidualUnit) else layer.dwconv, i)
            if isinstance(layer, _DecoderBlock):
                for sub in reversed(layer.block):
                    i = back(sub, i)
            return i  # activations

        for layer in reversed(self.decoder):
            index = back(layer, index)
        for transposed, convnext in reversed(self.upsample):
            index = back(transposed, back(convnext, index))
        index -= len(self.pre_transformer.layers) * (self.pre_transformer.window - 1)
        return first - back(self.pre_conv, index)


# --------------------------------------------------------------------------------------------
# checkpoint files

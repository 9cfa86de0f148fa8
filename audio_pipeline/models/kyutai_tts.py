"""Kyutai TTS (delayed streams modeling) in plain torch: the backbone, its text head, the depth
transformer and the conditions, with parameter names as the published checkpoint has them.

One backbone position per 80 ms frame. Its input is the sum of the text stream's embedding (two
text streams multiplexed in one id: ``(second + 1) * (text_card + 1) + first``, each embedded and
projected by its own matrix), one embedding per audio codebook (id -1: a zero embedding; ``card``:
the start id) and the conditions summed in (the ``control`` and, for a model trained with CFG
distillation, ``cfg`` lookup tables). Each layer: RMSNorm (float32), self-attention with
interleaved rotary pairs over a window of ``context`` positions, a LayerNorm and cross-attention
to the voice (its keys and values computed once per request), RMSNorm and a gated feed-forward.
The backbone's head gives the text logits; the depth transformer then produces every codebook of
the frame in turn, starting from the text token fed back, with its own weights per codebook
(``depformer_weights_per_step_schedule`` maps codebooks to weight sets) and a causal attention over
the frame's codebooks only.

The layers take the attention from their caller (``attend(layer, q, k, v)``, [T, heads, head_dim]
in and out), so the same code runs over any cache (the engine's paged one applies the window).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.checkpoints.kyutai_tts_config import DsmConfig
from audio_pipeline.layouts.dsm_text import ZERO  # the id embedded as exactly zero


class FloatRMSNorm(nn.Module):
    """RMSNorm with its scale stored as [1, 1, dim] (``alpha``), computed in float32 (rms_norm_f32,
    eps 1e-8) or in the input's dtype (rms_norm, eps 1e-5)."""

    def __init__(self, dim: int, eps: float, in_float32: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))
        self.eps = eps
        self.in_float32 = in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.in_float32:
            x = x.float()
        var = self.eps + x.pow(2).mean(-1, keepdim=True)
        return (x * (self.alpha.view(-1).to(var) * torch.rsqrt(var))).to(dtype)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "rms_norm_f32":
        return FloatRMSNorm(dim, 1e-8, True)
    if kind == "rms_norm":
        return FloatRMSNorm(dim, 1e-5, False)
    return nn.LayerNorm(dim, eps=1e-8 if kind == "layer_norm_f32" else 1e-5)


class DsmEmbedding(nn.Module):
    """An embedding whose id -1 is a zero vector; optionally low-rank (a projection after the
    table) or demultiplexing two streams from one id (each its own output projection)."""

    def __init__(self, num: int, dim: int, *, low_rank: int | None = None, demux: bool = False):
        super().__init__()
        self.num = num
        self.weight = nn.Parameter(torch.empty(num, low_rank or dim))
        self.demux = demux
        self.low_rank = nn.Linear(low_rank, dim, bias=False) if low_rank else None
        if demux:
            self.out1 = nn.Linear(low_rank or dim, dim, bias=False)
            self.out2 = nn.Linear(low_rank or dim, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        zero = ids == ZERO
        ids = ids.clamp(min=0)
        if self.demux:
            first = F.embedding(ids % self.num, self.weight)
            second = ids // self.num - 1
            out = self.out1(first)
            extra = self.out2(F.embedding(second.clamp(min=0), self.weight))
            out = out + torch.where((second < 0)[..., None], torch.zeros_like(extra), extra)
            return torch.where(zero[..., None], torch.zeros_like(out), out)
        out = F.embedding(ids, self.weight)
        out = torch.where(zero[..., None], torch.zeros_like(out), out)
        return self.low_rank(out) if self.low_rank is not None else out


class Gating(nn.Module):
    """Gated feed-forward: ``linear_out(act(a) * b)`` with ``[a, b] = linear_in(x)``."""

    def __init__(self, dim: int, feedforward: int, activation: str):
        super().__init__()
        hidden = (21 * dim) // 8 if feedforward == 4 * dim else (2 * feedforward) // 3
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.activation = getattr(F, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x)
        h = h.view(*h.shape[:-1], 2, -1)
        return self.linear_out(self.activation(h[..., 0, :]) * h[..., 1, :])


def interleaved_rotary(x: torch.Tensor, positions: torch.Tensor, max_period: float) -> torch.Tensor:
    """Rotates consecutive pairs (2i, 2i + 1) of each head of x ([T, heads, D]) by position x
    frequency i, computed in float32 (the published convention; transformers' rotate_half pairs i
    with i + D/2 instead)."""
    dim = x.shape[-1]
    freqs = torch.exp(torch.arange(dim // 2, device=x.device, dtype=torch.float32)
                      * (-math.log(max_period) * 2 / dim))
    angles = positions.float()[:, None, None] * freqs
    cos, sin = angles.cos(), angles.sin()
    pairs = x.view(*x.shape[:-1], dim // 2, 2)
    real, imag = pairs[..., 0].float(), pairs[..., 1].float()
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return out.to(x.dtype).view(x.shape)


class SelfAttention(nn.Module):
    """Self-attention with one fused input projection (queries, keys, values) and one output
    projection per weight set (the depth transformer's steps; the backbone has one)."""

    def __init__(self, dim: int, heads: int, kv_repeat: int = 1, weight_sets: int = 1):
        super().__init__()
        self.heads = heads
        self.kv_heads = heads // kv_repeat
        self.head_dim = dim // heads
        out = dim + 2 * self.kv_heads * self.head_dim
        self.in_projs = nn.ModuleList(nn.Linear(dim, out, bias=False) for _ in range(weight_sets))
        self.out_projs = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(weight_sets))

    def qkv(self, x: torch.Tensor, weights: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        projected = self.in_projs[weights](x)
        dim = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        q = projected[:, :dim].view(tokens, self.heads, self.head_dim)
        k = projected[:, dim:dim + kv].view(tokens, self.kv_heads, self.head_dim)
        v = projected[:, dim + kv:].view(tokens, self.kv_heads, self.head_dim)
        return q, k, v

    def out(self, attended: torch.Tensor, weights: int = 0) -> torch.Tensor:
        return self.out_projs[weights](attended.reshape(attended.shape[0], -1))


class CrossAttention(nn.Module):
    """Attention of the backbone's positions to the voice's condition vectors (no mask, no
    positions): queries from the first third of ``in_proj_weight``, keys and values from the rest."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def keys_values(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, dim] -> keys and values [heads, S, head_dim] (once per request)."""
        dim = self.heads * self.head_dim
        kv = F.linear(source, self.in_proj_weight[dim:])
        kv = kv.view(source.shape[0], 2, self.heads, self.head_dim).permute(1, 2, 0, 3)
        return kv[0], kv[1]

    def forward(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [T, dim]; ``attend(q)``: each position's attention over its request's keys and values
        ([T, heads, head_dim] in and out)."""
        dim = self.heads * self.head_dim
        q = F.linear(x, self.in_proj_weight[:dim]).view(x.shape[0], self.heads, self.head_dim)
        return self.out_proj(attend(q).reshape(x.shape[0], dim))


def cross_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of queries [T, heads, head_dim] over one source's keys and values [heads, S, head_dim]."""
    # [T, heads, 1, D] queries, each over the same [heads, S, D] keys and values
    return F.scaled_dot_product_attention(q[:, :, None], keys[None], values[None])[:, :, 0]


class BackboneLayer(nn.Module):
    def __init__(self, config: DsmConfig, index: int):
        super().__init__()
        self.index = index
        self.max_period = config.max_period
        self.norm1 = make_norm(config.norm, config.dim)
        self.self_attn = SelfAttention(config.dim, config.num_heads, config.kv_repeat)
        if config.cross_attention:
            self.norm_cross = nn.LayerNorm(config.dim, eps=1e-5)
            self.cross_attention = CrossAttention(config.dim, config.num_heads)
        else:
            self.cross_attention = None
        self.norm2 = make_norm(config.norm, config.dim)
        self.gating = Gating(config.dim, int(config.hidden_scale * config.dim), config.gating)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Callable, cross: Callable) -> torch.Tensor:
        h = self.norm1(x[None])[0]
        q, k, v = self.self_attn.qkv(h)
        q = interleaved_rotary(q, positions, self.max_period)
        k = interleaved_rotary(k, positions, self.max_period)
        x = x + self.self_attn.out(attend(self.index, q, k, v))
        if self.cross_attention is not None:
            x = x + self.cross_attention(self.norm_cross(x), lambda q: cross(self.index, q))
        return x + self.gating(self.norm2(x[None])[0])


class DepthLayer(nn.Module):
    """A layer of the depth transformer: shared norms, per-step weight sets for the attention's
    projections and the feed-forward."""

    def __init__(self, config: DsmConfig):
        super().__init__()
        sets = config.depformer_weights
        self.norm1 = make_norm(config.norm, config.depformer_dim)
        self.self_attn = SelfAttention(config.depformer_dim, config.depformer_num_heads, 1, sets)
        self.norm2 = make_norm(config.norm, config.depformer_dim)
        self.gating = nn.ModuleList(Gating(config.depformer_dim, config.depformer_dim_feedforward,
                                           config.depformer_gating) for _ in range(sets))


class Transformer(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class LutCondition(nn.Module):
    """A lookup-table condition: a value's row (or the padding row for none), projected, or the
    learnt padding vector for none."""

    def __init__(self, spec: dict, out_dim: int):
        super().__init__()
        lut = spec["lut"]
        self.n_bins = int(lut["n_bins"])
        self.values = {str(v): i for i, v in enumerate(lut.get("possible_values") or [])}
        self.embed = nn.Embedding(self.n_bins + 1, int(lut["dim"]))
        self.output_proj = nn.Linear(int(lut["dim"]), out_dim, bias=False)
        self.learnt_padding = nn.Parameter(torch.empty(1, 1, out_dim))

    def forward(self, value: str | None) -> torch.Tensor:
        """[1, out_dim]."""
        if value is None:
            return self.learnt_padding[0]
        if value not in self.values:
            raise ValueError(f"{value!r} is not one of {sorted(self.values)}")
        row = torch.tensor([self.values[value]], device=self.embed.weight.device)
        return self.output_proj(self.embed(row))


class TensorCondition(nn.Module):
    """A tensor condition (the voice's speaker embeddings): projected where present, the learnt
    padding vector elsewhere."""

    def __init__(self, spec: dict, out_dim: int):
        super().__init__()
        dim = int(spec["tensor"]["dim"])
        self.output_proj = nn.Linear(dim, out_dim, bias=False)
        self.learnt_padding = nn.Parameter(torch.empty(1, 1, out_dim))

    def forward(self, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tensor [S, dim], mask [S] -> [S, out_dim]."""
        projected = self.output_proj(tensor.to(self.output_proj.weight.dtype))
        keep = mask.to(projected.dtype)[:, None]
        return projected * keep + self.learnt_padding[0] * (1 - keep)


class ConditionProvider(nn.Module):
    def __init__(self, config: DsmConfig):
        super().__init__()
        self.conditioners = nn.ModuleDict({
            name: (LutCondition(spec, config.dim) if spec["type"] == "lut" else TensorCondition(spec, config.dim))
            for name, spec in config.conditioners.items()})


def sin_embedding(length: int, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal positions [length, dim]: cosines then sines of position / period^(i / (dim/2 - 1))."""
    half = dim // 2
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    phase = positions / (torch.tensor(max_period) ** (torch.arange(half, dtype=torch.float32) / (half - 1)))
    return torch.cat([phase.cos(), phase.sin()], dim=-1)


class DsmModel(nn.Module):
    """The whole language model of a Kyutai TTS checkpoint."""

    #: The voice slots of a speaker condition (the reference's max_speakers).
    MAX_SPEAKERS = 5

    def __init__(self, config: DsmConfig):
        super().__init__()
        self.config = config
        dim, card = config.dim, config.card
        self.emb = nn.ModuleList(DsmEmbedding(card + 1, dim) for _ in range(config.n_q))
        self.text_emb = DsmEmbedding(config.text_card + 1, dim, demux=config.demux_second_stream)
        self.text_linear = nn.Linear(dim, config.text_card, bias=False)
        self.transformer = Transformer([BackboneLayer(config, i) for i in range(config.num_layers)])
        self.out_norm = make_norm(config.norm, dim)
        inputs = config.depformer_weights if config.depformer_multi_linear else 1
        self.depformer_in = nn.ModuleList(nn.Linear(dim, config.depformer_dim, bias=False) for _ in range(inputs))
        low_rank = config.depformer_low_rank
        self.depformer_emb = nn.ModuleList(DsmEmbedding(card + 1, config.depformer_dim, low_rank=low_rank)
                                           for _ in range(config.n_q - 1))
        self.depformer_text_emb = DsmEmbedding(config.text_card + 1, config.depformer_dim, low_rank=low_rank,
                                               demux=config.demux_second_stream)
        self.depformer = Transformer([DepthLayer(config) for _ in range(config.depformer_num_layers)])
        self.linears = nn.ModuleList(nn.Linear(config.depformer_dim, card, bias=False) for _ in range(config.n_q))
        self.condition_provider = ConditionProvider(config)

    # --- conditions ------------------------------------------------------------------------------

    def condition_sum(self, values: dict[str, str | None]) -> torch.Tensor:
        """The vector summed into every position's input ([dim]): the fuser's ``sum`` conditions,
        each given its value (None: absent, as in guidance's null half)."""
        total = None
        for name in self.config.fuser.get("sum", []):
            vector = self.condition_provider.conditioners[name](values.get(name))[0]
            total = vector if total is None else total + vector
        if total is None:
            return torch.zeros(self.config.dim, device=self.text_linear.weight.device)
        return total

    def cross_source(self, speakers: list[torch.Tensor], frames: int | None = None) -> torch.Tensor:
        """The cross-attention source ([S, dim]) of up to MAX_SPEAKERS speaker embeddings (each
        [dim_in, frames], as a voice file's ``speaker_wavs[0]``), each in a slot as long as the
        first one (a longer one cut, a shorter one's rest padding: the published voices are all
        one length); none: the null condition of guidance, every slot padding, ``frames`` long."""
        conditioner = self.condition_provider.conditioners["speaker_wavs"]
        dim_in = conditioner.output_proj.in_features
        frames = speakers[0].shape[-1] if speakers else frames
        tensor = torch.zeros(self.MAX_SPEAKERS, frames, dim_in)
        mask = torch.zeros(self.MAX_SPEAKERS, frames, dtype=torch.bool)
        for index, speaker in enumerate(speakers):
            kept = min(frames, speaker.shape[-1])
            tensor[index, :kept] = speaker[:, :kept].float().t()
            mask[index, :kept] = True
        device = self.text_linear.weight.device
        source = conditioner(tensor.view(-1, dim_in).to(device), mask.view(-1).to(device))
        if self.config.fuser.get("cross_attention_pos_emb", False):
            scale = float(self.config.fuser.get("cross_attention_pos_emb_scale", 1.0))
            source = source + scale * sin_embedding(source.shape[0], source.shape[1]).to(source)
        return source

    def cross_keys_values(self, source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cross-attention keys and values ([heads, S, head_dim]) of one request's source."""
        source = source.to(self.text_linear.weight.dtype)
        return [layer.cross_attention.keys_values(source) for layer in self.transformer.layers]

    # --- backbone ---------------------------------------------------------------------------------

    def embed(self, text: torch.Tensor, codes: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, dim] of text ids [T] (multiplexed), codes [T, n_q] and each
        position's summed conditions [T, dim]."""
        x = None
        for k, table in enumerate(self.emb):
            e = table(codes[:, k])
            x = e if x is None else x + e
        x = x + self.text_emb(text)
        return x + condition.to(x.dtype)

    def forward(self, text: torch.Tensor, codes: torch.Tensor, condition: torch.Tensor, positions: torch.Tensor,
                attend: Callable, cross: Callable) -> torch.Tensor:
        """Hidden states after the final norm ([T, dim]). ``attend(layer, q, k, v)``: the
        self-attention; ``cross(layer, q)``: each position's cross-attention over its request's
        voice (queries and outputs [T, heads, head_dim])."""
        x = self.embed(text, codes, condition)
        for layer in self.transformer.layers:
            x = layer(x, positions, attend, cross)
        return self.out_norm(x[None])[0]

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text_linear(hidden).float()

    # --- depth transformer ------------------------------------------------------------------------

    def depth_frame(self, hidden: torch.Tensor, text: torch.Tensor, choose: Callable[[int, torch.Tensor], torch.Tensor],
                    codebooks: int | None = None) -> torch.Tensor:
        """Codes [B, codebooks] of B frames from their backbone hidden states ([B, dim]) and the
        text ids fed back ([B]); ``choose(k, logits)`` picks codebook k's codes ([B]) from its
        logits ([B, card] float32), k = 0, 1, ... in order. ``codebooks``: fewer than n_q."""
        config = self.config
        count = codebooks or config.n_q
        schedule = config.depformer_schedule
        keys: list[list[torch.Tensor]] = [[] for _ in self.depformer.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.depformer.layers]
        previous = text
        chosen = []
        for k in range(count):
            weights = schedule[k]
            projection = self.depformer_in[weights if config.depformer_multi_linear else 0]
            token = self.depformer_text_emb(previous) if k == 0 else self.depformer_emb[k - 1](previous)
            x = projection(hidden) + token
            for index, layer in enumerate(self.depformer.layers):
                h = layer.norm1(x[None])[0]
                q, key, value = layer.self_attn.qkv(h, weights)
                keys[index].append(key)
                values[index].append(value)
                # [B, heads, k + 1, head_dim]: this frame's codebooks so far (causal, no positions)
                attended = F.scaled_dot_product_attention(
                    q[:, :, None], torch.stack(keys[index], dim=2), torch.stack(values[index], dim=2))
                x = x + layer.self_attn.out(attended[:, :, 0], weights)
                x = x + layer.gating[weights](layer.norm2(x[None])[0])
            logits = self.linears[k](x).float()
            previous = choose(k, logits)
            chosen.append(previous)
        return torch.stack(chosen, dim=1)


def split_fused_projections(state: dict[str, torch.Tensor], model: DsmModel) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the module's names: a self-attention's fused
    ``in_proj_weight`` / ``out_proj.weight`` (all weight sets stacked, as published) split into
    ``in_projs.{i}`` / ``out_projs.{i}``; the cross-attention keeps its ``in_proj_weight``, and a
    cross-attention's ``out_projs.0`` becomes ``out_proj``."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if ".self_attn.in_proj_weight" in key or ".self_attn.out_proj.weight" in key:
            prefix = key.split(".self_attn.")[0]
            attention = model.get_submodule(prefix + ".self_attn")
            kind = "in_projs" if key.endswith("in_proj_weight") else "out_projs"
            parts = tensor.view(len(attention.in_projs), -1, tensor.shape[-1])
            for index in range(parts.shape[0]):
                out[f"{prefix}.self_attn.{kind}.{index}.weight"] = parts[index]
        elif ".cross_attention.in_projs.0.weight" in key:
            out[key.replace("in_projs.0.weight", "in_proj_weight")] = tensor
        elif ".cross_attention.out_projs.0.weight" in key:
            out[key.replace("out_projs.0.weight", "out_proj.weight")] = tensor
        else:
            out[key] = tensor
    return out


def random_dsm_model(config: DsmConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> DsmModel:
    """A model of ``config`` with drawn weights (a benchmark's: real shapes, noise): norms at one,
    the rest normal with std 0.02 (embeddings 1, so that each stream counts), on ``device``."""
    with torch.device("meta"):
        model = DsmModel(config)
    model.to_empty(device=device).to(dtype)
    model.condition_provider.float()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("alpha") or (name.endswith(".weight") and parameter.dim() == 1):
                parameter.fill_(1.0)
            elif name.endswith(".bias"):
                parameter.zero_()
            else:
                std = 1.0 if isinstance(model.get_submodule(name.rpartition(".")[0]), DsmEmbedding) else 0.02
                parameter.normal_(0.0, std, generator=generator)
    return model.eval().requires_grad_(False)


def load_dsm_model(model_dir, config: DsmConfig, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> DsmModel:
    """The language model of a checkpoint directory (``config.moshi_name``), every tensor checked;
    the conditions stay in float32 (they are computed once per request)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from audio_pipeline.models.weights import load_strict

    path = Path(model_dir) / config.moshi_name
    if not path.is_file():
        raise FileNotFoundError(f"the language model's weights {path} are missing (config.json moshi_name)")
    with torch.device("meta"):
        model = DsmModel(config)
    model.to_empty(device=device).to(dtype)
    model.condition_provider.float()
    state = split_fused_projections(load_file(str(path)), model)
    # Extra heads (unused by speech generation) are not built.
    state = {k: v for k, v in state.items() if not k.startswith("extra_heads.")}
    load_strict(model, state, path.name)
    return model.eval().requires_grad_(False)

"""Llama-family decoder-only LM in plain torch, run over a ragged batch of sequences with KV caches.

Llama, Qwen2 and Qwen3 checkpoints (``model_type`` llama, qwen2 or qwen3): the same blocks, but
Qwen2's query, key and value projections carry biases and its output projection does not, and
Qwen3 normalizes each head's query and key (an RMSNorm over the head, before the rotation).
Parameter names follow the Hugging Face checkpoint layout, so a safetensors state dict loads as is.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.models.prompt_precision import project


class AttentionBatch(Protocol):
    """Where a step's new tokens belong and how they attend: the KV cache's view of one step."""

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Stores the new tokens' keys/values of ``layer``; returns their causal attention output
        ([T, heads, head_dim] from query [T, heads, head_dim] and keys/values [T, kv_heads, head_dim])."""

    #: The [start, end) row ranges of the step that are prompt positions, whose products may run in
    #: model.prompt_dtype (models/prompt_precision.py); empty: none, or all rows in the model's dtype.
    prompt_rows: tuple[tuple[int, int], ...]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        #: torch's rms_norm (one kernel on CUDA) instead of the spelled-out form (see fuse_layers).
        self.fused = False
        #: The native decode kernels' rms_norm, where they run this norm (models/native_layers.py).
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x, self.weight, self.eps)
        if self.fused:
            # One kernel on CUDA (it normalizes in float32 and rounds once, after the weight) where
            # the spelled-out form below launches four: a sixth of a fused decode step's kernels.
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def concatenated_linear(*parts: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the outputs of ``parts`` side by side (weights and biases
    concatenated, on their device and dtype)."""
    first = parts[0]
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(first.in_features, weight.shape[0], bias=first.bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused.requires_grad_(False)


def transformer_view(config_class: type, source, vocab_size: int, **fields):
    """A ``config_class`` (transformers' LlamaConfig, Qwen3Config) carrying the transformer fields
    of ``source`` (a nested config of a composite checkpoint: CSM's backbone or depth decoder,
    Qwen3-TTS's talker or code predictor), what DecoderLayer and the RoPE read; ``fields`` add to
    them or replace them."""
    heads = source.num_attention_heads
    rope = getattr(source, "rope_parameters", None)
    return config_class(**{
        "vocab_size": vocab_size, "hidden_size": source.hidden_size, "intermediate_size": source.intermediate_size,
        "num_hidden_layers": source.num_hidden_layers, "num_attention_heads": heads,
        "num_key_value_heads": getattr(source, "num_key_value_heads", None) or heads,
        "head_dim": getattr(source, "head_dim", None) or source.hidden_size // heads,
        "hidden_act": getattr(source, "hidden_act", "silu"), "max_position_embeddings": source.max_position_embeddings,
        "rms_norm_eps": source.rms_norm_eps, "rope_parameters": dict(rope) if rope else None,
        "attention_bias": bool(getattr(source, "attention_bias", False)),
        "mlp_bias": bool(getattr(source, "mlp_bias", False)),
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **fields})


def rope_inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the config's RoPE variant (default, llama3, ...)."""
    params = getattr(config, "rope_parameters", None) or {
        **(getattr(config, "rope_scaling", None) or {}), "rope_theta": getattr(config, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        # On the CPU, also where the module is being built on the meta device: a meta arange runs
        # torch's Python reference kernels, whose first use imports sympy (~25 MiB resident).
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    # Scaled variants: transformers' own parameter formulas, so every published variant matches.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r} in the model config")
    with torch.device("cpu"):  # also when the module is being built on the meta device
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def projection_biases(config) -> tuple[bool, bool]:
    """Whether the (query, key, value) projections and the output projection carry biases.

    Qwen2 fixes it in its architecture (its config has no switch): q/k/v yes, output no. A Llama
    config's ``attention_bias`` sets all four.
    """
    if getattr(config, "model_type", None) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


#: Architectures whose attention normalizes each head's query and key (``q_norm``, ``k_norm``).
QK_NORM_MODEL_TYPES = {"qwen3"}


def has_qk_norm(config) -> bool:
    """Whether the config's attention normalizes queries and keys per head (Qwen3's layers)."""
    return getattr(config, "model_type", None) in QK_NORM_MODEL_TYPES


def check_supported(config) -> None:
    """ValueError naming the config field this implementation does not run."""
    if getattr(config, "use_sliding_window", False):
        # Every layer here attends over the whole sequence; a windowed layer would see less.
        raise ValueError("use_sliding_window: sliding-window attention is not supported (the model config "
                         "sets use_sliding_window=true)")


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos and sin ([T, head_dim] each, in ``dtype``) of ``positions`` ([T])."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        qkv_bias, output_bias = projection_biases(config)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=output_bias)
        self.qkv_proj: nn.Linear | None = None
        self.q_norm = self.k_norm = None
        if has_qk_norm(config):
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def fuse(self) -> None:
        """The query, key and value projections as one product (fuse_layers)."""
        self.qkv_proj = concatenated_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        tokens = x.shape[0]
        rows = getattr(batch, "prompt_rows", ())
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.qkv_proj is not None and self.q_norm is None:
            # Fused: the queries and keys sit side by side in the product, so one rotation covers
            # both (the same elementwise operations, half the kernels); q and k are views of it.
            qkv = project(self.qkv_proj, x, rows)
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, :heads * self.head_dim].view(tokens, heads, self.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, heads * self.head_dim:].view(tokens, self.num_kv_heads, self.head_dim)
        else:
            if self.qkv_proj is not None:
                q, k, v = project(self.qkv_proj, x, rows).split(
                    [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                     self.num_kv_heads * self.head_dim], dim=-1)
            else:
                q, k, v = project(self.q_proj, x, rows), project(self.k_proj, x, rows), project(self.v_proj, x, rows)
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            v = v.view(tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = batch.attend(self.layer, q, k, v)
        return project(self.o_proj, out.reshape(tokens, self.num_heads * self.head_dim), rows)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """The gate and up projections as one product (fuse_layers)."""
        self.gate_up_proj = concatenated_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, prompt_rows: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """``prompt_rows``: the rows whose products may run in model.prompt_dtype (AttentionBatch)."""
        if self.gate_up_proj is not None:
            gate, up = project(self.gate_up_proj, x, prompt_rows).chunk(2, dim=-1)
            return project(self.down_proj, F.silu(gate) * up, prompt_rows)
        gate, up = project(self.gate_proj, x, prompt_rows), project(self.up_proj, x, prompt_rows)
        return project(self.down_proj, F.silu(gate) * up, prompt_rows)


def fuse_layers(module: nn.Module) -> int:
    """Fuses every Llama block inside ``module`` for fewer, larger kernels (model.fuse_layers): the
    q/k/v projections become one product, the MLP's gate/up another, and RMSNorm runs as torch's
    rms_norm. The results equal the unfused module's up to float rounding. Returns the blocks fused."""
    count = 0
    for sub in list(module.modules()):
        if isinstance(sub, Attention) and sub.qkv_proj is None:
            sub.fuse()
            count += 1
        elif isinstance(sub, MLP) and sub.gate_up_proj is None:
            sub.fuse()
        elif isinstance(sub, RMSNorm):
            sub.fused = True
    return count


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        #: The layer on the native decode kernels (models/native_layers.py), where it runs there.
        self.native = None

    def forward(self, x, cos, sin, batch):
        if self.native is not None:
            return self.native(x, cos, sin, batch)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x), getattr(batch, "prompt_rows", ()))


class LlamaBackbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; ``forward`` runs new tokens of many sequences in one flat batch."""

    def __init__(self, config):
        super().__init__()
        check_supported(config)
        self.config = config
        self.model = LlamaBackbone(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.head_dim = self.model.layers[0].self_attn.head_dim
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2), persistent=False)
        self.rope_scaling = 1.0
        self.reset_rotary()

    def tie_weights(self) -> None:
        """Shares the embedding with the output projection when the config says so."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rotary(self, device: torch.device | None = None) -> None:
        """(Re)computes the RoPE frequencies, e.g. after building the module on the meta device."""
        inv_freq, self.rope_scaling = rope_inverse_frequencies(self.config, self.head_dim)
        self.inv_freq = inv_freq.to(device or self.inv_freq.device)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.inv_freq, self.rope_scaling, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, hidden] of ``input_ids`` (a subclass may add more inputs)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                **inputs) -> torch.Tensor:
        """Hidden states (after the final norm) of every token in ``input_ids`` ([T] -> [T, hidden]);
        ``inputs`` go to :meth:`embed`."""
        x = self.embed(input_ids, **inputs)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

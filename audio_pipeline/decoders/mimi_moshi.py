"""Mimi as Kyutai's own checkpoints store it (the codec file a Kyutai TTS directory names in
``mimi_name``): its configuration and tensor names, translated to those of transformers' Mimi
modules, which decoders/mimi.py runs.

The configuration is the directory's ``mimi_config_name`` file where it names one, else the
codec Kyutai publishes (SEANet 64 filters, 512 channels, ratios 8, 6, 5, 4; 32 codebooks of 2048;
an 8-layer transformer, 8 heads, context 250). Tensor names: ``encoder.model.N`` /
``decoder.model.N`` are the SEANet layers, ``*_transformer.transformer.layers.N`` the transformer
layers (one fused input projection), ``quantizer.rvq_first`` / ``rvq_rest`` the semantic and
acoustic quantizers. The attention rotates consecutive pairs of each head while transformers'
rotates halves, so each head's query and key rows are reordered (pairs to halves), which gives the
same attention.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

#: The published codec's configuration, in the same layout as a ``mimi_config_name`` file.
PUBLISHED_CONFIG: dict[str, Any] = {
    "sample_rate": 24000, "channels": 1, "frame_rate": 12.5,
    "seanet": {"dimension": 512, "n_filters": 64, "n_residual_layers": 1, "ratios": [8, 6, 5, 4], "kernel_size": 7,
               "residual_kernel_size": 3, "last_kernel_size": 3, "dilation_base": 2, "causal": True,
               "pad_mode": "constant", "compress": 2, "true_skip": True, "activation": "ELU", "norm": "none"},
    "quantizer": {"dimension": 256, "n_q": 32, "bins": 2048, "input_dimension": 512, "output_dimension": 512},
    "transformer": {"d_model": 512, "num_heads": 8, "num_layers": 8, "causal": True, "layer_scale": 0.01,
                    "context": 250, "max_period": 10000, "gating": "none", "norm": "layer_norm",
                    "positional_embedding": "rope", "dim_feedforward": 2048},
}


def read_moshi_config(directory: Path, config_name: str | None) -> dict[str, Any]:
    """The codec's configuration (see the module docstring)."""
    if config_name is None:
        return PUBLISHED_CONFIG
    path = directory / config_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} (config.json mimi_config_name) is missing")
    return json.loads(path.read_text())


def transformers_config(moshi: dict[str, Any], source: Path) -> dict[str, Any]:
    """The same codec as a transformers MimiConfig dict; ValueError for what the two differ in."""
    seanet, quantizer, transformer = moshi["seanet"], moshi["quantizer"], moshi["transformer"]
    problems = [why for wrong, why in (
        (seanet.get("activation", "ELU") != "ELU", "seanet.activation must be ELU"),
        (seanet.get("norm", "none") != "none", "seanet.norm must be none"),
        (transformer.get("gating", "none") != "none", "transformer.gating must be none"),
        (transformer.get("norm", "layer_norm") != "layer_norm", "transformer.norm must be layer_norm"),
        (transformer.get("positional_embedding", "rope") != "rope", "transformer.positional_embedding must be rope"),
        (quantizer.get("input_dimension", seanet["dimension"]) != seanet["dimension"],
         "quantizer.input_dimension must equal seanet.dimension"),
    ) if wrong]
    if problems:
        raise ValueError(f"{source}: unsupported Mimi config: {'; '.join(problems)}")
    dim = int(seanet["dimension"])
    heads = int(transformer["num_heads"])
    return {
        "model_type": "mimi", "sampling_rate": int(moshi["sample_rate"]), "frame_rate": float(moshi["frame_rate"]),
        "audio_channels": int(moshi.get("channels", 1)), "hidden_size": dim, "num_filters": int(seanet["n_filters"]),
        "num_residual_layers": int(seanet["n_residual_layers"]), "upsampling_ratios": list(seanet["ratios"]),
        "kernel_size": int(seanet["kernel_size"]), "last_kernel_size": int(seanet["last_kernel_size"]),
        "residual_kernel_size": int(seanet["residual_kernel_size"]),
        "dilation_growth_rate": int(seanet["dilation_base"]), "use_causal_conv": bool(seanet["causal"]),
        "pad_mode": seanet["pad_mode"], "compress": int(seanet["compress"]), "trim_right_ratio": 1.0,
        "use_conv_shortcut": not seanet.get("true_skip", True),
        "codebook_size": int(quantizer["bins"]), "codebook_dim": int(quantizer["dimension"]),
        "num_quantizers": int(quantizer["n_q"]), "num_semantic_quantizers": 1,
        "vector_quantization_hidden_dimension": int(quantizer["dimension"]), "upsample_groups": dim,
        "num_hidden_layers": int(transformer["num_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": int(transformer["d_model"]) // heads,
        "intermediate_size": int(transformer["dim_feedforward"]), "sliding_window": int(transformer["context"]),
        "rope_theta": float(transformer.get("max_period", 10000)),
        "layer_scale_initial_scale": float(transformer.get("layer_scale") or 0.01), "norm_eps": 1e-5,
        "hidden_act": "gelu", "max_position_embeddings": 8000,
    }


_RENAMES = (
    (re.compile(r"^(encoder|decoder)\.model\.(\d+)\.(?:conv\.conv|convtr\.convtr)\."), r"\1.\1_seanet.layers.\2.conv."),
    (re.compile(r"^(encoder|decoder)\.model\.(\d+)\.block\.(\d+)\.conv\.conv\."), r"\1.\1_seanet.layers.\2.block.\3.conv."),
    (re.compile(r"^(encoder|decoder)\.model\.(\d+)\.shortcut\.conv\.conv\."), r"\1.\1_seanet.layers.\2.shortcut.conv."),
    (re.compile(r"^(encoder|decoder)_transformer\.transformer\.layers\.(\d+)\."), r"\1.\1_transformer.layers.\2."),
    (re.compile(r"^downsample\.conv\.conv\.conv\."), "encoder.downsample.conv."),
    (re.compile(r"^upsample\.convtr\.convtr\.convtr\."), "decoder.upsample.conv."),
    (re.compile(r"^quantizer\.rvq_first\."), "quantizer.semantic_residual_vector_quantizer."),
    (re.compile(r"^quantizer\.rvq_rest\."), "quantizer.acoustic_residual_vector_quantizer."),
)
_LAYER_PARTS = {"norm1.": "input_layernorm.", "norm2.": "post_attention_layernorm.", "linear1.": "mlp.fc1.",
                "linear2.": "mlp.fc2.", "layer_scale_1.": "self_attn_layer_scale.",
                "layer_scale_2.": "mlp_layer_scale.", "self_attn.out_proj.": "self_attn.o_proj.",
                "self_attn.out_projs.0.": "self_attn.o_proj."}
_CODEBOOK_PARTS = {"_codebook._initialized": "codebook.initialized", "_codebook.cluster_usage": "codebook.cluster_usage",
                   "_codebook.embedding_sum": "codebook.embed_sum"}


def _pairs_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection reordered within each head from (r0, i0, r1, i1, ...) to
    (r0, r1, ..., i0, i1, ...)."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def transformers_tensors(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """The codec's tensors under transformers' MimiModel names (see the module docstring);
    ValueError naming a tensor it does not know."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key
        for pattern, replacement in _RENAMES:
            name, hits = pattern.subn(replacement, name)
            if hits:
                break
        else:
            raise ValueError(f"{key} is not a tensor of Kyutai's Mimi layout")
        if "_transformer.layers." in name:
            head, _, rest = name.partition("_transformer.layers.")
            index, _, part = rest.partition(".")
            prefix = f"{head}_transformer.layers.{index}."
            if part in ("self_attn.in_proj_weight", "self_attn.in_projs.0.weight"):
                q, k, v = tensor.chunk(3, dim=0)
                out[prefix + "self_attn.q_proj.weight"] = _pairs_to_halves(q, heads)
                out[prefix + "self_attn.k_proj.weight"] = _pairs_to_halves(k, heads)
                out[prefix + "self_attn.v_proj.weight"] = v
                continue
            for theirs, ours in _LAYER_PARTS.items():
                if part.startswith(theirs):
                    part = ours + part[len(theirs):]
                    break
            name = prefix + part
        elif ".vq.layers." in name:
            head, _, rest = name.partition(".vq.layers.")
            index, _, part = rest.partition(".")
            name = f"{head}.layers.{index}.{_CODEBOOK_PARTS.get(part, part)}"
        out[name] = tensor
    return out

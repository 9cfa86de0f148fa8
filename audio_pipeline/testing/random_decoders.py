"""Audio decoders with random weights, written as their checkpoints are: the tiny shapes tests
decode with on a CPU, and the published shapes benchmarks time. The audio is noise; the layout,
the rates and the cost are the real decoder's.

``save_random_<decoder>_checkpoint(path, seed=..., **config)`` writes a directory that
``load_audio_decoder(<decoder>, path)`` loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from audio_pipeline.decoders.snac import SNAC_24KHZ_CONFIG

__all__ = [
    "TINY_MIMI_CONFIG",
    "TINY_NEUCODEC_CONFIG",
    "TINY_SNAC_CONFIG",
    "save_random_causal_checkpoint",
    "save_random_mimi_checkpoint",
    "save_random_neucodec_checkpoint",
    "save_random_qwen3_tts_12hz_checkpoint",
    "save_random_snac_checkpoint",
]

#: SNAC 24 kHz's rates and codebooks, narrow layers: fast on CPU (tests, builtin:tiny-orpheus).
TINY_SNAC_CONFIG: dict[str, Any] = {**SNAC_24KHZ_CONFIG, "encoder_dim": 8, "decoder_dim": 32}

#: A Mimi small enough for tests on CPU: the real rates (24 kHz, 1920 samples per frame), narrow
#: layers, 8 codebooks of 16 codes, a 16-step attention window (8 frames) that short tests cross,
#: transformer weights drawn wide enough (std 0.2) that attention changes the audio.
TINY_MIMI_CONFIG: dict[str, Any] = {
    "hidden_size": 32, "num_filters": 4, "num_hidden_layers": 2, "intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 2, "codebook_size": 16, "codebook_dim": 16,
    "num_quantizers": 8, "vector_quantization_hidden_dimension": 16, "upsample_groups": 32,
    "sliding_window": 16, "initializer_range": 0.2,
}

#: A NeuCodec small enough for tests on CPU: the real rates, frame and codebook (65,536 codes),
#: narrow layers, a two-layer semantic model. 64 wide, not 32: the decoder's group norms (32
#: groups) need two channels a group to normalize a one-frame input.
TINY_NEUCODEC_CONFIG: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "encoder_hidden_size": 4, "quantization_dim": 96,
    "semantic_model_config": {
        "model_type": "wav2vec2-bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "output_hidden_size": 32, "conv_depthwise_kernel_size": 3,
        "feature_projection_input_dim": 160},
}


# --------------------------------------------------------------------------------------------
# causal-conv


def save_random_causal_checkpoint(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Writes a randomly initialised causal-conv decoder (config.json + model.safetensors) to ``path``."""
    from safetensors.torch import save_file

    from audio_pipeline.decoders.causal_conv import DEFAULT_CONFIG, CausalConvDecoder

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**DEFAULT_CONFIG, **overrides}
    torch.manual_seed(seed)
    decoder = CausalConvDecoder(config, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        decoder.embed.weight.normal_(0, 1.0)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in decoder.modules.state_dict().items()}, str(path / "model.safetensors"))
    return path


# --------------------------------------------------------------------------------------------
# SNAC


def save_random_snac_checkpoint(path: str | Path, *, seed: int = 0, safetensors: bool = True,
                                **config_overrides: Any) -> Path:
    """Writes ``config.json`` and randomly initialised weights in the published layout
    (weight-normed tensors as ``weight_g``/``weight_v``) to directory ``path``; returns it.

    The config is SNAC_24KHZ_CONFIG (the published 24 kHz SNAC) updated with ``config_overrides``.
    """
    from audio_pipeline.decoders.snac import _build_analysis, _build_decoding, _normalize_config

    path = Path(path)
    raw = {**SNAC_24KHZ_CONFIG, **config_overrides}
    cfg = _normalize_config(raw, "save_random_snac_checkpoint")
    generator = torch.Generator().manual_seed(seed)
    quantizer, synthesis = _build_decoding(cfg)
    analysis = _build_analysis(cfg)
    state: dict[str, torch.Tensor] = {}
    for module in (analysis, quantizer, synthesis):
        randomize_snac_(module, generator)
        state.update(snac_checkpoint_tensors(module))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, str(path / "pytorch_model.bin"))
    return path


def snac_checkpoint_tensors(root: nn.Module, style: str = "legacy") -> dict[str, torch.Tensor]:
    """``root``'s tensors under SNAC checkpoint names; weight-normed ones as g/v (``legacy``:
    ``weight_g``/``weight_v``; ``parametrizations``: ``parametrizations.weight.original0``/``original1``;
    ``plain``: the weight itself)."""
    from audio_pipeline.decoders.snac import _weight_norm_names
    from audio_pipeline.decoders.snac_layers import checkpoint_key_map

    ours = root.state_dict()
    out = {}
    for key, (theirs, weight_normed) in checkpoint_key_map(root).items():
        t = ours[key].detach().float().contiguous()
        if weight_normed and style != "plain":
            (lg, lv), (pg, pv) = _weight_norm_names(theirs)
            g_key, v_key = (lg, lv) if style == "legacy" else (pg, pv)
            out[g_key] = torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())), keepdim=True)
            out[v_key] = t.clone()
        else:
            out[theirs] = t.clone()
    return out


@torch.no_grad()
def randomize_snac_(root: nn.Module, generator: torch.Generator) -> None:
    """Fills every tensor of SNAC's layers like PyTorch's default layer init (uniform
    +-1/sqrt(fan_in)), codebooks standard normal, Snake frequencies 1, LayerNorm identity."""
    from audio_pipeline.decoders.snac_layers import Codebook, Conv, NoiseInjection, Snake, WindowedSelfAttention

    def uniform(t: torch.Tensor, fan_in: int) -> None:
        bound = 1.0 / math.sqrt(fan_in)
        t.copy_(torch.rand(t.shape, generator=generator) * (2 * bound) - bound)

    for module in root.modules():
        if isinstance(module, Conv):
            uniform(module.weight, module.fan_in())
            if module.bias is not None:
                uniform(module.bias, module.fan_in())
        elif isinstance(module, NoiseInjection):
            uniform(module.proj, module.proj.shape[1])
        elif isinstance(module, Snake):
            module.alpha.fill_(1.0)
        elif isinstance(module, WindowedSelfAttention):
            module.norm_weight.fill_(1.0)
            module.norm_bias.zero_()
            uniform(module.qkv, module.dim)
            uniform(module.out, module.dim)
        elif isinstance(module, Codebook):
            module.vectors.copy_(torch.randn(module.vectors.shape, generator=generator))


# --------------------------------------------------------------------------------------------
# Mimi


def save_random_mimi_checkpoint(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Writes a random MimiModel (:data:`TINY_MIMI_CONFIG` updated with ``config_overrides``) to
    directory ``path`` with ``save_pretrained``; returns it.

    transformers starts codebooks at zero (every code would decode alike) and the transformer's
    layer scales at 0.01 (its layers would barely count): here codebooks are standard normal and
    scales 1. The last convolution is scaled down so that the audio (std about 0.1) stays inside
    [-1, 1], where the decoder clamps.
    """
    from transformers import MimiConfig, MimiModel
    from transformers.models.mimi.modeling_mimi import MimiLayerScale

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MimiModel(MimiConfig(**{**TINY_MIMI_CONFIG, **config_overrides}))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("embed_sum"):
                    buffer.normal_()
            for module in model.modules():
                if isinstance(module, MimiLayerScale):
                    module.scale.fill_(1.0)
            last = model.decoder.decoder_seanet.layers[-1].conv
            last.weight.mul_(0.02)
            last.bias.mul_(0.02)
    model.save_pretrained(str(path))
    return Path(path)


# --------------------------------------------------------------------------------------------
# NeuCodec


def save_random_neucodec_checkpoint(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Writes a random NeuCodecModel (:data:`TINY_NEUCODEC_CONFIG` updated with ``config_overrides``)
    to directory ``path`` with ``save_pretrained``; returns it.

    transformers starts the head's biases at zero, where the audio is quiet (std about 0.003): here
    the magnitudes' bias is raised so that it is about 0.1, well inside [-1, 1] where the decoder
    clamps.
    """
    from transformers import NeuCodecConfig, NeuCodecModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = NeuCodecModel(NeuCodecConfig(**{**TINY_NEUCODEC_CONFIG, **config_overrides}))
        head = model.acoustic_decoder.head.linear
        with torch.no_grad():
            head.bias[: head.out_features // 2] = 3.5  # log magnitudes: the first half of the head
    model.save_pretrained(str(path))
    return Path(path)


# --------------------------------------------------------------------------------------------
# Qwen3-TTS-Tokenizer-12Hz


def save_random_qwen3_tts_12hz_checkpoint(path: str | Path, *, seed: int = 0, **decoder_config: Any) -> Path:
    """Writes a speech tokenizer directory with random decoder weights of ``decoder_config``'s shape
    under the checkpoint's names (config.json, model.safetensors; no encoder: it cannot clone), for
    benchmarks of a real shape. The codebooks are drawn as usage-normalised sums."""
    from safetensors.torch import save_file

    from audio_pipeline.decoders.qwen3_tts_12hz import MODEL_TYPE
    from audio_pipeline.decoders.qwen3_tts_12hz_layers import DecoderNet

    cfg = {"attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000,
           "sliding_window": 72, "layer_scale_initial_scale": 0.01, **decoder_config}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    net = DecoderNet(cfg)
    state = {}
    for name, tensor in net.state_dict().items():
        if name.endswith(("alpha", "beta")):
            value = torch.zeros(tensor.shape)
        elif name.endswith(("scale", "gamma")):
            value = torch.full(tensor.shape, 0.1)
        elif name.endswith("norm.weight"):
            value = torch.ones(tensor.shape)
        else:
            value = torch.randn(tensor.shape, generator=generator) * (0.02 if tensor.dim() < 3 else 0.1)
        state[name] = value
    tensors = {}
    embeddings = state.pop("quantizer.embeddings")
    tensors["decoder.quantizer.rvq_first.output_proj.weight"] = state.pop("quantizer.first_proj.weight")
    tensors["decoder.quantizer.rvq_rest.output_proj.weight"] = state.pop("quantizer.rest_proj.weight")
    for k in range(embeddings.shape[0]):
        group, index = ("rvq_first", 0) if k == 0 else ("rvq_rest", k - 1)
        stem = f"decoder.quantizer.{group}.vq.layers.{index}._codebook"
        tensors[f"{stem}.embedding_sum"] = embeddings[k].contiguous()
        tensors[f"{stem}.cluster_usage"] = torch.ones(embeddings.shape[1])
    tensors.update({f"decoder.{name}": value.contiguous() for name, value in state.items()})
    save_file(tensors, str(path / "model.safetensors"))
    rate = net.samples_per_frame
    (path / "config.json").write_text(json.dumps({
        "model_type": MODEL_TYPE, "decode_upsample_rate": rate, "encode_downsample_rate": rate,
        "input_sample_rate": 24000, "output_sample_rate": 24000,
        "encoder_valid_num_quantizers": cfg["num_quantizers"], "decoder_config": cfg, "encoder_config": {}}, indent=2))
    return path

"""Tiny random NeuTTS-style checkpoints for tests, written with transformers' own classes: a Qwen2
backbone (config.json and model.safetensors as Qwen2ForCausalLM saves them)."""

from __future__ import annotations

from pathlib import Path

import torch

#: A Qwen2 small enough for CPU tests; untied like NeuTTS Air (its head is not its embedding).
TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)


def write_tiny_qwen2(path: str | Path, *, vocab_size: int, seed: int = 0, **overrides) -> Path:
    """Writes a random Qwen2ForCausalLM with ``save_pretrained``. transformers starts biases at zero,
    where a missing bias would go unnoticed: here q/k/v biases are drawn like the weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, **{**TINY_QWEN2, **overrides}))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("_proj.bias"):
                    parameter.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return path

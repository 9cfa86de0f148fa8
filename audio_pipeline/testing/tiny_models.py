"""Writes a tiny random Llama with the Orpheus token layout, in Hugging Face format.

Tests serve the tiny model (also ``builtin:tiny-orpheus``): it exercises the whole engine path, but
its random weights produce noise, not speech.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from audio_pipeline.layouts import orpheus
from audio_pipeline.layouts.manifest import MANIFEST_NAME

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": orpheus.MIN_VOCAB_SIZE + 2,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": orpheus.BEGIN_OF_TEXT,
    "eos_token_id": orpheus.END_OF_SPEECH,
    "pad_token_id": orpheus.PAD,
    "torch_dtype": "float32",
}

_LLAMA3_SPECIALS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"}


def _special_token_name(token_id: int) -> str:
    if token_id in _LLAMA3_SPECIALS:
        return _LLAMA3_SPECIALS[token_id]
    if token_id < 128256:
        return f"<|reserved_special_token_{token_id - 128000}|>"
    return f"<custom_token_{token_id - 128256}>"


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level tokenizer whose special ids sit where the Orpheus (Llama 3) tokenizer has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    # Unused ids between the byte symbols and the special tokens keep the special ids in place.
    vocab.update({f"<|unused_{i}|>": i for i in range(len(alphabet), 128000)})
    specials = [_special_token_name(i) for i in range(128000, vocab_size)]
    vocab.update({name: 128000 + i for i, name in enumerate(specials)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", orpheus.BEGIN_OF_TEXT)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": _special_token_name(orpheus.PAD),
        "model_max_length": TINY_LLAMA_CONFIG["max_position_embeddings"],
    }, indent=2))


def random_llama_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Weights drawn like a fresh Llama (normal, std 0.02; norms at one), tied head left out."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    state = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
             "model.norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    if not config.get("tie_word_embeddings"):
        state["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return state


def write_tiny_orpheus_model(path: str | os.PathLike, *, seed: int = 0, with_decoder: bool = True,
                             family: str = "orpheus", **config_overrides) -> Path:
    """Writes config.json, model.safetensors, the tokenizer, a random SNAC decoder and the manifest
    (of ``family``: orpheus, or maya1 with the same tokens and described voices)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_LLAMA_CONFIG, **config_overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_llama_state(config, seed), str(path / "model.safetensors"))
    write_tokenizer(path, config["vocab_size"])
    if family == "maya1":
        from audio_pipeline.layouts.maya1 import PRESET_VOICES

        voices = [{"name": v.name, "language": v.language, "description": v.description} for v in PRESET_VOICES]
    else:
        voices = [{"name": v, "language": "en-US", "description": f"Orpheus preset voice {v}"}
                  for v in orpheus.ORPHEUS_VOICES]
    manifest = {"family": family, "description": "tiny random test model (noise, not speech)",
                "voices": voices, "default_voice": voices[0]["name"]}
    if with_decoder:
        from audio_pipeline.testing.random_decoders import TINY_SNAC_CONFIG, save_random_snac_checkpoint

        save_random_snac_checkpoint(path / "snac", seed=seed, **TINY_SNAC_CONFIG)
        manifest.update(audio_decoder="snac", audio_decoder_weights="snac")
    (path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return path

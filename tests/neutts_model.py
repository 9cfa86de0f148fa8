"""Tiny random NeuTTS-style checkpoints for tests, written with transformers' own classes: a Qwen2
backbone (config.json and model.safetensors as Qwen2ForCausalLM saves them), a byte-level
tokenizer holding NeuTTS's prompt tokens and its 65,536 speech tokens, a random NeuCodec in
``neucodec/``, and the manifest naming the family."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from audio_pipeline.layouts.neutts import SPECIAL_TOKENS, speech_token

#: A Qwen2 small enough for CPU tests; untied like NeuTTS Air (its head is not its embedding).
TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)
#: Qwen's own special tokens, before NeuTTS's.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CODEBOOK = 65536


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


def write_neutts_tokenizer(path: Path, codebook: int = CODEBOOK) -> int:
    """A byte-level BPE tokenizer (no merges) with Qwen's and NeuTTS's special tokens and
    ``<|speech_0|>`` ... at consecutive ids, loadable as Qwen2Tokenizer; returns its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([*QWEN_SPECIALS, *SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(speech_token(code), special=False, normalized=False) for code in range(codebook)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": TINY_QWEN2["max_position_embeddings"]}, indent=2))
    return tokenizer.get_vocab_size()


def write_tiny_neutts_model(path: str | Path, *, seed: int = 0, preset_voice: str | None = None) -> Path:
    """A NeuTTS Air directory as published (config.json, model.safetensors, tokenizer), a random
    NeuCodec in ``neucodec/`` and audio_pipeline.json naming the family and the decoder; with
    ``preset_voice``, a preset voice of that name whose reference (a transcript and random codes)
    the directory ships in ``voices/NAME/``."""
    from audio_pipeline.testing.random_decoders import save_random_neucodec_checkpoint
    from audio_pipeline.layouts.manifest import MANIFEST_NAME

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_neutts_tokenizer(path)
    write_tiny_qwen2(path, vocab_size=vocab_size, seed=seed)
    save_random_neucodec_checkpoint(path / "neucodec", seed=seed)
    manifest = {"family": "neutts", "description": "tiny random NeuTTS-style model (noise, not speech)",
                "audio_decoder": "neucodec", "audio_decoder_weights": "neucodec"}
    if preset_voice:
        entry = path / "voices" / preset_voice
        entry.mkdir(parents=True)
        (entry / "voice.json").write_text(json.dumps({"name": preset_voice, "transcript": "My name is Dave."}))
        np.save(entry / "codes.neucodec.npy", np.random.default_rng(seed).integers(0, CODEBOOK, 40))
        manifest.update(voices=[{"name": preset_voice, "description": "shipped reference"}],
                        default_voice=preset_voice)
    (path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return path

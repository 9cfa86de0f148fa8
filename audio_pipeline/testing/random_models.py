"""Randomly initialised models of real shapes, for benchmarks that need no download.

``write_random_model(path, "orpheus-3b")`` writes a model directory with Orpheus-3B's config (Llama
3.2 3B), the tokenizer layout of the Orpheus family and a random SNAC 24 kHz decoder, and a manifest
that says ``random_weights``: the engine then draws the language model's weights on the device when
it loads (nothing of its 3B parameters is written or read from disk). The speech is noise; the
shapes, and so the serving cost, are the real model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from audio_pipeline.layouts import orpheus
from audio_pipeline.layouts.manifest import MANIFEST_NAME
from audio_pipeline.testing.tiny_models import TINY_LLAMA_CONFIG, write_tokenizer

#: Orpheus-3B (canopylabs' fine-tune of Llama 3.2 3B): its config.json's shape.
ORPHEUS_3B_CONFIG = {
    **TINY_LLAMA_CONFIG,
    "vocab_size": 156940,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}

#: Shapes by name: the real model, and a tiny one for trying the benchmark on a CPU.
RANDOM_SHAPES = {"orpheus-3b": ORPHEUS_3B_CONFIG, "orpheus-tiny": TINY_LLAMA_CONFIG}


def write_random_model(path: str | Path, shape: str, *, seed: int = 0) -> Path:
    """A model directory of ``shape`` (one of RANDOM_SHAPES) whose LM weights are drawn at load."""
    from audio_pipeline.decoders.snac import TINY_SNAC_CONFIG, save_random_snac_checkpoint

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"--random-model: unknown shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = RANDOM_SHAPES[shape]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, config["vocab_size"])
    # The real model's decoder is SNAC 24 kHz at its published size; the tiny shape gets the tiny one.
    save_random_snac_checkpoint(path / "snac", seed=seed, **({} if shape == "orpheus-3b" else TINY_SNAC_CONFIG))
    (path / MANIFEST_NAME).write_text(json.dumps({
        "family": "orpheus", "description": f"random {shape} (noise, real shapes)", "random_weights": True,
        "voices": [{"name": v, "description": f"Orpheus preset voice {v}"} for v in orpheus.ORPHEUS_VOICES],
        "default_voice": orpheus.ORPHEUS_VOICES[0], "audio_decoder": "snac", "audio_decoder_weights": "snac",
    }, indent=2))
    return path

"""A Llama checkpoint's config.json and tokenizer read without transformers, for the project's own
voices (a family that declares ``plain_checkpoint``: the built-in voices).

Importing transformers' configuration and tokenizer machinery costs a server about 77 MiB of
resident memory (transformers 5 pulls much of torch.distributed in with a Llama config), more than
a small voice's weights, KV cache and decoder together. The built-in voices need none of it: the
model code reads a handful of plain fields (with transformers' Llama defaults where a field is
absent), and their layouts read the tokenizer's vocabulary alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: transformers' LlamaConfig defaults for the fields this project's Llama code reads.
LLAMA_DEFAULTS = {
    "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
}


class PlainLlamaConfig:
    """config.json's fields as attributes, with transformers' Llama defaults where absent
    (num_key_value_heads: the heads; head_dim: hidden_size / heads; rope_parameters: rope_theta,
    10,000 where unset, and the default rotation)."""

    def __init__(self, fields: dict[str, Any]):
        values = {**LLAMA_DEFAULTS, **fields}
        for required in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if required not in values:
                raise ValueError(f"config.json: {required} is missing")
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        if not values.get("rope_parameters"):
            values["rope_parameters"] = {"rope_type": "default", "rope_theta": values.get("rope_theta", 10000.0)}
        self.__dict__.update(values)

    @classmethod
    def read(cls, model_dir: str | Path) -> "PlainLlamaConfig":
        return cls(json.loads((Path(model_dir) / "config.json").read_text()))


class VocabularyTokenizer:
    """tokenizer.json through the ``tokenizers`` library: what a vocabulary-only layout reads of
    transformers' tokenizer (``get_vocab()``, ``len()``)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

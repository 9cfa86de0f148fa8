"""A Qwen3-TTS checkpoint's config.json, which transformers does not know (model_type ``qwen3_tts``):
read by the family's layout (its languages, speakers and control ids) and by the model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MODEL_TYPE = "qwen3_tts"


def _namespace(value: Any) -> Any:
    """JSON objects as attribute namespaces (lists and scalars as they are)."""
    if isinstance(value, dict):
        return SimpleNamespace(**{key: _namespace(item) for key, item in value.items()})
    return value


def read_config(model_dir: Path) -> SimpleNamespace:
    """A Qwen3-TTS checkpoint's config.json as a namespace; the talker's transformer fields are
    also at the top level (num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    hidden_size, max_position_embeddings, vocab_size), where the engine's cache sizing reads them."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{model_dir}: not a Qwen3-TTS checkpoint (model_type {data.get('model_type')!r})")
    talker = data.get("talker_config")
    if not isinstance(talker, dict) or not isinstance(talker.get("code_predictor_config"), dict):
        raise ValueError(f"{model_dir}/config.json: talker_config with its code_predictor_config is missing")
    config = _namespace(data)
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                 "max_position_embeddings", "vocab_size", "rms_norm_eps"):
        setattr(config, name, talker.get(name))
    config.speaker_encoder_config = data.get("speaker_encoder_config")  # a plain dict for its own loader
    return config

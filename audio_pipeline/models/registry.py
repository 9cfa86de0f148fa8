"""Which PipelineModel runs a checkpoint: chosen by its config's ``model_type`` (the architecture),
never by the speech family (a family is a layout and a decoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: model_type -> "module:class" of the PipelineModel that runs it; anything else runs as Llama
#: (Llama, Qwen2 and Qwen3 checkpoints; models/llama.py names what it refuses).
PIPELINE_MODELS = {"csm": "audio_pipeline.models.csm_model:CsmPipelineModel",
                   "qwen3_tts": "audio_pipeline.models.qwen3_tts_model:Qwen3TTSPipelineModel",
                   "kyutai_tts": "audio_pipeline.models.kyutai_tts_model:KyutaiPipelineModel"}
#: model_type -> "module:function" reading a config.json that transformers does not know.
CONFIG_READERS = {"qwen3_tts": "audio_pipeline.checkpoints.qwen3_tts_config:read_config",
                  "kyutai_tts": "audio_pipeline.checkpoints.kyutai_tts_config:read_config"}
DEFAULT_PIPELINE_MODEL = "audio_pipeline.models.llama_model:LlamaPipelineModel"
#: A Llama checkpoint whose config has a ``frame_head`` (models/frame_head.py) runs one position per
#: frame with its depth head.
FRAME_HEAD_KEY = "frame_head"
FRAME_LLAMA_MODEL = "audio_pipeline.models.frame_llama:FrameLlamaPipelineModel"


def pipeline_model_class(huggingface_config: Any) -> type:
    """The PipelineModel class for a checkpoint with ``huggingface_config``."""
    import importlib

    target = PIPELINE_MODELS.get(getattr(huggingface_config, "model_type", None), DEFAULT_PIPELINE_MODEL)
    if target == DEFAULT_PIPELINE_MODEL and getattr(huggingface_config, FRAME_HEAD_KEY, None) is not None:
        target = FRAME_LLAMA_MODEL
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def read_model_config(model_dir: Path, *, plain: bool = False) -> Any:
    """The checkpoint's config: transformers' AutoConfig, or this project's reader for a model type
    transformers does not know (CONFIG_READERS); ``plain``: a plain Llama's fields read as they are
    (checkpoints/plain_config.py, the project's own voices)."""
    import importlib

    if plain:
        from audio_pipeline.checkpoints.plain_config import PlainLlamaConfig

        return PlainLlamaConfig.read(model_dir)

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = raw.get("model_type")
    except (OSError, ValueError, AttributeError):
        raw, model_type = None, None
    if model_type is None:  # a Kyutai TTS config.json names no model type: its layout says it
        from audio_pipeline.checkpoints.kyutai_tts_config import MODEL_TYPE, is_kyutai_tts_config

        if is_kyutai_tts_config(raw):
            model_type = MODEL_TYPE
    if model_type in CONFIG_READERS:
        module, name = CONFIG_READERS[model_type].split(":")
        return getattr(importlib.import_module(module), name)(model_dir)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)

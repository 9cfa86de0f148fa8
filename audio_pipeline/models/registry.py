"""Which PipelineModel runs a checkpoint: chosen by its config's ``model_type`` (the architecture),
never by the speech family (a family is a layout and a decoder)."""

from __future__ import annotations

from typing import Any

#: model_type -> "module:class" of the PipelineModel that runs it; anything else runs as Llama
#: (Llama and Qwen2 checkpoints; models/llama.py names what it refuses).
PIPELINE_MODELS = {"csm": "audio_pipeline.models.csm_model:CsmPipelineModel"}
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

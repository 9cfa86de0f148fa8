"""Which PipelineModel runs a checkpoint: chosen by its config's ``model_type`` (the architecture),
never by the speech family (a family is a layout and a decoder)."""

from __future__ import annotations

from typing import Any

#: model_type -> "module:class" of the PipelineModel that runs it; anything else runs as Llama
#: (Llama and Qwen2 checkpoints; models/llama.py names what it refuses).
PIPELINE_MODELS = {"csm": "audio_pipeline.models.csm_model:CsmPipelineModel"}
DEFAULT_PIPELINE_MODEL = "audio_pipeline.models.llama_model:LlamaPipelineModel"


def pipeline_model_class(huggingface_config: Any) -> type:
    """The PipelineModel class for a checkpoint with ``huggingface_config``."""
    import importlib

    target = PIPELINE_MODELS.get(getattr(huggingface_config, "model_type", None), DEFAULT_PIPELINE_MODEL)
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)

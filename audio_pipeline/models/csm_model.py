"""The Sesame CSM PipelineModel: LlamaPipelineModel's paged-cache execution over a CsmSpeechLM.

The config is transformers' CsmConfig, whose top-level transformer fields (num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings) are the backbone's, so
the cache sizing of LlamaPipelineModel (get_kv_params, calculate_max_seq_len, get_num_layers) reads
the backbone as it is. Only the backbone uses the paged cache; the depth decoder keeps a dense
per-frame cache inside ``depth_frame``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from audio_pipeline.models.csm import CsmSpeechLM
from audio_pipeline.models.llama_model import DepthPipelineModel
from audio_pipeline.models.weights import load_safetensors_into

logger = logging.getLogger(__name__)

#: Checkpoint keys of the Mimi codec that CsmForConditionalGeneration stores with the LM (the audio
#: decoder loads them itself).
CODEC_PREFIXES = ("codec_model.",)


class CsmPipelineModel(DepthPipelineModel):
    """CSM's backbone over the paged KV cache; ``forward(tokens, positions, batch, frames=...)``."""

    supports_int8 = False

    def _build_model(self, huggingface_config: Any, model_dir: Path, dtype: torch.dtype, device: torch.device,
                     random_weights: bool) -> torch.nn.Module:
        if random_weights:
            raise NotImplementedError("random_weights is not supported for CSM models")
        with torch.device("meta"):
            model = CsmSpeechLM(huggingface_config)
        load_safetensors_into(model, model_dir, dtype, device, ignore_prefixes=CODEC_PREFIXES)
        return model

    def backbone_layers(self) -> torch.nn.Module:
        return self.model.backbone_model.layers

    def _make_forward(self, compile: bool):
        if compile:
            logger.info("model.compile: the CSM backbone runs eagerly (compile is not supported for CSM yet)")
        return self.model

"""The Qwen3-TTS PipelineModel: LlamaPipelineModel's paged-cache execution over a Qwen3TTSSpeechLM.

Only the talker uses the paged cache (its config's transformer fields are promoted to the top level
by :func:`~audio_pipeline.checkpoints.qwen3_tts_config.read_config`, where the cache sizing reads them); the code
predictor keeps a dense per-frame cache inside ``depth_frame``. A step's inputs beside the codec ids
are the positions' frames, their text-track ids and any raw vectors (a cloned voice's speaker
embedding).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from audio_pipeline.models.llama_model import DepthPipelineModel
from audio_pipeline.models.qwen3_tts import Qwen3TTSSpeechLM
from audio_pipeline.models.weights import load_safetensors_into

logger = logging.getLogger(__name__)

#: Checkpoint keys another loader reads: the speaker encoder (voice cloning).
SPEAKER_PREFIXES = ("speaker_encoder.",)


class Qwen3TTSPipelineModel(DepthPipelineModel):
    """Qwen3-TTS's talker over the paged KV cache; ``forward(tokens, positions, batch, frames=...,
    text_ids=..., vectors=...)``."""

    supports_int8 = False
    module_class = Qwen3TTSSpeechLM

    def _build_model(self, huggingface_config: Any, model_dir: Path, dtype: torch.dtype, device: torch.device,
                     random_weights: bool) -> torch.nn.Module:
        with torch.device("meta"):
            model = Qwen3TTSSpeechLM(huggingface_config)
        if random_weights:
            from audio_pipeline.models.weights import init_random_weights

            init_random_weights(model, dtype, device)
        else:
            load_safetensors_into(model, model_dir, dtype, device, ignore_prefixes=SPEAKER_PREFIXES)
        return model

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: A Base checkpoint's speaker encoder (voice cloning by x-vector); None for the others.
        self.speaker_encoder = None
        if getattr(self.huggingface_config, "tts_model_type", None) == "base" and not kwargs.get("random_weights"):
            from audio_pipeline.models.qwen3_tts_speaker import load_speaker_encoder

            self.speaker_encoder = load_speaker_encoder(self.model_dir, self.devices[0], torch.float32)
            self.speaker_sample_rate = int(self.huggingface_config.speaker_encoder_config.get("sample_rate", 24000))

    def speaker_embedding(self, samples) -> torch.Tensor:
        """The x-vector of a recording (24 kHz), in the talker's width: a Base model's speaker slot."""
        if self.speaker_encoder is None:
            raise NotImplementedError("this Qwen3-TTS checkpoint has no speaker encoder (only Base models clone)")
        return self.speaker_encoder.embed(torch.as_tensor(samples, dtype=torch.float32, device=self.devices[0]))

    def backbone_layers(self) -> torch.nn.Module:
        return self.model.talker.model.layers

    def _make_forward(self, compile: bool):
        if compile:
            logger.info("model.compile: the Qwen3-TTS talker runs eagerly (compile is not supported for it yet)")
        return self.model

"""A Llama that runs one position per audio frame (config.json's ``frame_head``; the built-in
voice's phoneme-lpc-frame layout): a position's input adds its frame's codes to its token, and a
depth head samples one more code of the frame (models/frame_head.py).

The checkpoint is a Hugging Face Llama (``model.*``, a tied or own ``lm_head``) plus the depth
head's ``depth.*`` tensors, so transformers loads its backbone as it is.
"""

from __future__ import annotations

from typing import Callable

import torch

from audio_pipeline.models.frame_head import DepthHead, FrameHeadConfig, frame_embeddings, token_embeddings
from audio_pipeline.models.llama import LlamaForCausalLM
from audio_pipeline.models.llama_model import DepthPipelineModel


class FrameLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.frame_head = FrameHeadConfig.of(config)
        if self.frame_head is None:
            raise ValueError("config.json has no frame_head")
        self.depth = DepthHead(config.hidden_size, self.frame_head, config.rms_norm_eps)
        #: Codes each position carries (its frame's columns).
        self.codes_per_token = self.frame_head.codes
        #: Input ids at or past this stand for a pair of ids (a folded prompt); None: none do.
        self.fold_base = int(self.frame_head.fold["base"]) if self.frame_head.fold else None
        #: :meth:`embed` as one call of the native decode kernels (:meth:`use_native`), else None.
        self.native_embed = None

    def use_native(self, kernel) -> None:
        """Embeds (ids and frames in one call) and runs the depth head's final norm on the native
        decode ``kernel`` (audio_pipeline_kernels/native_decode.py; its blocks: DepthHead.pack)."""
        head, weight = self.frame_head, self.model.embed_tokens.weight
        fold = (-1, 0, 0, 1)
        if head.fold:
            fold = (int(head.fold["base"]), *map(int, head.fold["offsets"]), int(head.fold["sizes"][1]))
        offsets = list(head.code_offsets)
        self.native_embed = lambda ids, frames: kernel.frame_embed(ids, frames, weight, *fold, offsets,
                                                                   head.token_column)
        self.depth.norm.native = kernel.rms_norm

    def embed(self, input_ids: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings of ``input_ids`` ([T]; a fold's pair ids included) with their ``frames``
        ([T, C], -1 where a column holds nothing)."""
        if self.native_embed is not None:
            return self.native_embed(input_ids, frames)
        x = token_embeddings(self.model.embed_tokens, input_ids, self.frame_head)
        if frames is not None:
            x = x + frame_embeddings(self.model.embed_tokens, frames, self.frame_head)
        return x

    def depth_frame(self, hidden: torch.Tensor, token_codes: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[B, C] frames: the token column's codes, the depth column's (``choose(1, logits)``), -1
        elsewhere (the layout's alignment fills those)."""
        head = self.frame_head
        frame = torch.full((hidden.shape[0], head.codes), -1, dtype=torch.long, device=hidden.device)
        frame[:, head.token_column] = token_codes
        logits = self.depth(hidden, token_codes, self.model.embed_tokens).float()
        frame[:, head.depth_column] = choose(1, logits)
        return frame


class FrameLlamaPipelineModel(DepthPipelineModel):
    """LlamaPipelineModel over a FrameLlamaForCausalLM: ``forward(tokens, positions, batch, frames=...)``."""

    module_class = FrameLlamaForCausalLM

    def _attach_native(self, kernel) -> int:
        layers = super()._attach_native(kernel)
        if layers and self.model.model.embed_tokens.weight.dtype == torch.float32:
            self.model.use_native(kernel)
        return layers

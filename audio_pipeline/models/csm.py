"""Sesame CSM (``CsmForConditionalGeneration`` checkpoints) in plain torch: a Llama backbone over the
paged KV cache, and its depth decoder run for a whole batch of frames at once.

A CSM sequence holds text positions and audio positions. A text position embeds its token with
``embed_text_tokens``; an audio position embeds a frame of ``num_codebooks`` codes as the sum over
codebooks k of ``embed_audio_tokens(code_k + k * codebook_size)``. The backbone's ``lm_head`` gives
codebook 0 of the next frame; the depth decoder, a small Llama of its own, then produces codebooks
1..N-1 from the backbone's last hidden state and the codes chosen so far.

Parameter names follow the Hugging Face checkpoint, so its safetensors load as they are (the Mimi
codec, ``codec_model.*``, is loaded elsewhere). The backbone's audio embedding and the depth
decoder's ``embed_tokens`` are one tied parameter, stored under either name.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from audio_pipeline.models.depth_pass import DepthTransformer
from audio_pipeline.models.llama import (AttentionBatch, DecoderLayer, RMSNorm, check_supported,
                                         rope_inverse_frequencies, rotary_cos_sin, transformer_view)


def _llama_view(source, vocab_size: int):
    """A LlamaConfig carrying ``source``'s transformer fields (what DecoderLayer and the RoPE need)."""
    from transformers import LlamaConfig

    return transformer_view(LlamaConfig, source, vocab_size)


def backbone_config(csm_config):
    """The backbone as a LlamaConfig: CsmConfig's top-level transformer fields (its vocab_size is the
    text vocabulary; ``lm_head`` covers codebook 0's ``vocab_size`` codes)."""
    return _llama_view(csm_config, csm_config.text_vocab_size)


def depth_decoder_config(csm_config):
    """The depth decoder as a LlamaConfig (from ``csm_config.depth_decoder_config``)."""
    return _llama_view(csm_config.depth_decoder_config, csm_config.depth_decoder_config.vocab_size)


class CsmAudioEmbeddings(nn.Module):
    def __init__(self, num_codebooks: int, codebook_size: int, hidden_size: int):
        super().__init__()
        self.embed_audio_tokens = nn.Embedding(num_codebooks * codebook_size, hidden_size)


class CsmBackbone(nn.Module):
    def __init__(self, config, num_codebooks: int, codebook_size: int):
        super().__init__()
        self.embed_tokens = CsmAudioEmbeddings(num_codebooks, codebook_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CsmDepthModel(nn.Module):
    def __init__(self, config, num_codebooks: int, backbone_hidden_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(num_codebooks * config.vocab_size, backbone_hidden_size)
        self.inputs_embeds_projector = nn.Linear(backbone_hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CsmCodebooksHead(nn.Module):
    """One output projection per codebook 1..N-1: ``weight[k - 1]`` is [hidden, vocab]."""

    def __init__(self, num_codebooks: int, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_codebooks - 1, hidden_size, vocab_size))


class CsmDepthDecoder(nn.Module):
    def __init__(self, config, num_codebooks: int, backbone_hidden_size: int):
        super().__init__()
        self.model = CsmDepthModel(config, num_codebooks, backbone_hidden_size)
        self.codebooks_head = CsmCodebooksHead(num_codebooks, config.hidden_size, config.vocab_size)


class CsmSpeechLM(nn.Module):
    """CSM's backbone (``forward`` over the paged cache, ``compute_logits`` for codebook 0) and its
    depth decoder (``depth_frame``: codebooks 1..N-1 of a batch of frames)."""

    def __init__(self, csm_config):
        super().__init__()
        self.csm_config = csm_config
        #: The backbone's config (a LlamaConfig view: backbone_config).
        self.config = backbone_config(csm_config)
        self.depth_config = depth_decoder_config(csm_config)
        check_supported(self.config)
        depth = csm_config.depth_decoder_config
        self.num_codebooks = self.codes_per_token = int(csm_config.num_codebooks)
        self.codebook_size = int(csm_config.codebook_size)
        self.depth_vocab_size = int(depth.vocab_size)
        self.text_vocab_size = int(csm_config.text_vocab_size)
        self.tie_codebooks_embeddings = bool(getattr(csm_config, "tie_codebooks_embeddings", True))
        if int(depth.num_codebooks) != self.num_codebooks or int(depth.backbone_hidden_size) != csm_config.hidden_size:
            raise ValueError(f"depth_decoder_config: num_codebooks {depth.num_codebooks} and backbone_hidden_size "
                             f"{depth.backbone_hidden_size} must equal the backbone's ({self.num_codebooks}, "
                             f"{csm_config.hidden_size})")
        if self.tie_codebooks_embeddings and self.depth_vocab_size != self.codebook_size:
            raise ValueError(f"tie_codebooks_embeddings: the depth decoder's vocab_size ({self.depth_vocab_size}) "
                             f"must equal the backbone's codebook_size ({self.codebook_size})")
        self.backbone_model = CsmBackbone(self.config, self.num_codebooks, self.codebook_size)
        self.embed_text_tokens = nn.Embedding(self.text_vocab_size, self.config.hidden_size)
        self.lm_head = nn.Linear(self.config.hidden_size, self.codebook_size, bias=False)
        self.depth_decoder = CsmDepthDecoder(self.depth_config, self.num_codebooks, csm_config.hidden_size)
        self.tie_weights()
        self.head_dim = self.backbone_model.layers[0].self_attn.head_dim
        self.depth_head_dim = self.depth_decoder.model.layers[0].self_attn.head_dim
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2), persistent=False)
        self.register_buffer("depth_inv_freq", torch.empty(self.depth_head_dim // 2), persistent=False)
        self.rope_scaling = 1.0
        self.depth_rope_scaling = 1.0
        self.reset_rotary()

    def tie_weights(self) -> None:
        """Makes the backbone's audio embedding and the depth decoder's embedding one parameter (when
        tie_codebooks_embeddings): the loaded one of the two (a checkpoint stores either name), the
        depth decoder's when both are real tensors (the name transformers saves)."""
        if not self.tie_codebooks_embeddings:
            return
        backbone = self.backbone_model.embed_tokens.embed_audio_tokens
        depth = self.depth_decoder.model.embed_tokens
        if depth.weight.is_meta and not backbone.weight.is_meta:
            depth.weight = backbone.weight
        else:
            backbone.weight = depth.weight

    def reset_rotary(self, device: torch.device | None = None) -> None:
        """(Re)computes both RoPE frequency tables, e.g. after building the module on the meta device."""
        inv_freq, self.rope_scaling = rope_inverse_frequencies(self.config, self.head_dim)
        self.inv_freq = inv_freq.to(device or self.inv_freq.device)
        depth_inv_freq, self.depth_rope_scaling = rope_inverse_frequencies(self.depth_config, self.depth_head_dim)
        self.depth_inv_freq = depth_inv_freq.to(device or self.depth_inv_freq.device)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.inv_freq, self.rope_scaling, dtype)

    # --- backbone --------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings [T, hidden]: a frame's summed codebook embeddings where ``frames[t, 0] >= 0``,
        else the text embedding of ``input_ids[t]``. Ids are clamped into range (no lookup fails)."""
        text = self.embed_text_tokens(input_ids.clamp(0, self.text_vocab_size - 1))
        if frames is None:
            return text
        offsets = torch.arange(self.num_codebooks, device=frames.device) * self.codebook_size
        codes = frames.clamp(0, self.codebook_size - 1) + offsets
        audio = self.backbone_model.embed_tokens.embed_audio_tokens(codes).sum(dim=1)
        return torch.where((frames[:, 0] >= 0)[:, None], audio, text)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                frames: torch.Tensor | None = None) -> torch.Tensor:
        """Backbone hidden states after its final norm ([T] ids, [T] positions, optional [T, N] frames
        -> [T, hidden])."""
        x = self.embed(input_ids, frames)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.backbone_model.layers:
            x = layer(x, cos, sin, batch)
        return self.backbone_model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook 0's logits ([rows, vocab_size] float32)."""
        return self.lm_head(hidden).float()

    # --- depth decoder ---------------------------------------------------------------------------

    @torch.inference_mode()
    def depth_frame(self, backbone_hidden: torch.Tensor, first_codes: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The frames ([B, N] codes) of B sequences, given each one's backbone hidden state ([B, Hb],
        after the backbone's final norm, at the position that produced codebook 0) and codebook 0's
        codes ([B]). ``choose(k, logits)`` picks codebook k's codes ([B]) from its logits ([B, vocab]
        float32), for k = 1 .. N-1 in order.

        Depth positions (RoPE restarting at 0 every frame): 0 is the backbone hidden state, p >= 1
        embeds code p-1 of the frame (offset (p-1) * vocab_size); all go through
        ``inputs_embeds_projector``. The output at position k gives codebook k with head k-1.
        """
        model = self.depth_decoder.model
        heads = self.depth_decoder.codebooks_head.weight
        dtype = model.embed_tokens.weight.dtype
        depth = DepthTransformer(model.inputs_embeds_projector, model.layers, model.norm, self.depth_inv_freq,
                                 self.depth_rope_scaling)
        first = torch.stack((backbone_hidden.to(dtype), model.embed_tokens(first_codes)), dim=1)
        return depth.frame(first, first_codes, self.num_codebooks, choose,
                           logits=lambda k, hidden: (hidden @ heads[k - 1]).float(),
                           embed=lambda k, codes: model.embed_tokens(codes + k * self.depth_vocab_size))

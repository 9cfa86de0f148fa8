"""Qwen3-TTS (``Qwen3TTSForConditionalGeneration`` checkpoints, 12 Hz) in plain torch: the talker
over the paged KV cache, and its code predictor run for a whole batch of frames at once.

The talker is a Qwen3 decoder (each head's query and key RMS-normalized; its "MRoPE" has three
equal position rows, which is plain RoPE). Every position's input is the sum of two tracks:

* the codec track: a codec id's ``codec_embedding`` row (control ids such as pad, bos, a language
  or a preset speaker), or a frame of 16 codes (codebook 0's row of ``codec_embedding`` plus
  codebook j's row of the code predictor's ``codec_embedding[j - 1]``), or a raw vector (a cloned
  voice's speaker embedding, as it is);
* the text track: a text token through ``text_embedding`` and ``text_projection`` (a two-layer
  SiLU MLP), or nothing.

The talker's ``codec_head`` gives codebook 0 of the next frame (or its end, ``codec_eos_token_id``);
the code predictor, a small Qwen3 of its own with a fresh cache every frame, then gives codebooks
1..15 from the talker's hidden state and the codes chosen so far.

transformers does not know the ``qwen3_tts`` model type: the config is read by
checkpoints/qwen3_tts_config.py (:func:`read_config`). Parameter names follow the checkpoint, so its safetensors load as they are
(``speaker_encoder.*`` is read by the speaker encoder, ``speech_tokenizer/`` by the audio decoder).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.models.depth_pass import DepthTransformer
from audio_pipeline.models.llama import (AttentionBatch, DecoderLayer, RMSNorm, check_supported,
                                         rope_inverse_frequencies, rotary_cos_sin, transformer_view)

def qwen3_view(source: SimpleNamespace, vocab_size: int):
    """A Qwen3Config carrying ``source``'s transformer fields (what DecoderLayer and the RoPE read):
    the three equal MRoPE rows of the talker are plain RoPE with its rope_theta."""
    from transformers import Qwen3Config

    return transformer_view(
        Qwen3Config, source, vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": float(getattr(source, "rope_theta", 10000.0))},
        use_sliding_window=bool(getattr(source, "use_sliding_window", False)))


class TextProjection(nn.Module):
    """The text track's projection into the talker's width: fc2(silu(fc1(x)))."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    def __init__(self, config, text_vocab: int, text_hidden: int):
        super().__init__()
        self.text_embedding = nn.Embedding(text_vocab, text_hidden)
        self.codec_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CodePredictorModel(nn.Module):
    def __init__(self, config, depth: int, talker_hidden: int):
        super().__init__()
        #: Codebook j's embedding (j = 1..depth) is ``codec_embedding[j - 1]``, in the talker's width.
        self.codec_embedding = nn.ModuleList(nn.Embedding(config.vocab_size, talker_hidden) for _ in range(depth))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CodePredictor(nn.Module):
    def __init__(self, config, depth: int, talker_hidden: int):
        super().__init__()
        self.model = CodePredictorModel(config, depth, talker_hidden)
        #: ``lm_head[j]`` gives codebook j + 1.
        self.lm_head = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                                     for _ in range(depth))
        # The checkpoint has the projection only where the widths differ.
        self.small_to_mtp_projection = (nn.Linear(talker_hidden, config.hidden_size, bias=True)
                                        if talker_hidden != config.hidden_size else nn.Identity())


class Talker(nn.Module):
    def __init__(self, talker_config: SimpleNamespace):
        super().__init__()
        self.config = qwen3_view(talker_config, talker_config.vocab_size)
        predictor = talker_config.code_predictor_config
        self.depth = int(talker_config.num_code_groups) - 1
        self.predictor_config = qwen3_view(predictor, predictor.vocab_size)
        self.model = TalkerModel(self.config, talker_config.text_vocab_size, talker_config.text_hidden_size)
        self.text_projection = TextProjection(talker_config.text_hidden_size, talker_config.hidden_size)
        self.codec_head = nn.Linear(talker_config.hidden_size, talker_config.vocab_size, bias=False)
        self.code_predictor = CodePredictor(self.predictor_config, self.depth, talker_config.hidden_size)


class Qwen3TTSSpeechLM(nn.Module):
    """The talker (``forward`` over the paged cache, ``compute_logits`` for codebook 0) and its code
    predictor (``depth_frame``: codebooks 1..15 of a batch of frames)."""

    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.qwen3_tts_config = config
        self.talker = Talker(config.talker_config)
        #: The talker's transformer config (a Qwen3Config view).
        self.config = self.talker.config
        check_supported(self.config)
        check_supported(self.talker.predictor_config)
        talker = config.talker_config
        self.num_codebooks = self.codes_per_token = int(talker.num_code_groups)
        self.codebook_size = int(talker.code_predictor_config.vocab_size)
        self.codec_vocab_size = int(talker.vocab_size)
        self.text_vocab_size = int(talker.text_vocab_size)
        self.head_dim = self.talker.model.layers[0].self_attn.head_dim
        self.depth_head_dim = self.talker.code_predictor.model.layers[0].self_attn.head_dim
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2), persistent=False)
        self.register_buffer("depth_inv_freq", torch.empty(self.depth_head_dim // 2), persistent=False)
        self.rope_scaling = 1.0
        self.depth_rope_scaling = 1.0
        self.reset_rotary()

    @property
    def lm_head(self) -> nn.Linear:
        """The output projection the engine's candidate logits slice (codebook 0 and the control ids)."""
        return self.talker.codec_head

    @property
    def model(self) -> TalkerModel:
        return self.talker.model

    def tie_weights(self) -> None:
        """Nothing is tied in a Qwen3-TTS checkpoint."""

    def reset_rotary(self, device: torch.device | None = None) -> None:
        """(Re)computes both RoPE frequency tables, e.g. after building the module on the meta device."""
        inv_freq, self.rope_scaling = rope_inverse_frequencies(self.config, self.head_dim)
        self.inv_freq = inv_freq.to(device or self.inv_freq.device)
        depth_inv_freq, self.depth_rope_scaling = rope_inverse_frequencies(self.talker.predictor_config,
                                                                           self.depth_head_dim)
        self.depth_inv_freq = depth_inv_freq.to(device or self.depth_inv_freq.device)

    # --- the talker ------------------------------------------------------------------------------

    def project_text(self, text_ids: torch.Tensor) -> torch.Tensor:
        """The text track's input embeddings ([N] text ids -> [N, hidden])."""
        return self.talker.text_projection(self.talker.model.text_embedding(text_ids))

    def frame_embeddings(self, frames: torch.Tensor) -> torch.Tensor:
        """The codec track of whole frames ([N, 16] codes -> [N, hidden]): codebook 0 through the
        talker's codec embedding, codebook j through the code predictor's ``codec_embedding[j - 1]``."""
        tables = self.talker.code_predictor.model.codec_embedding
        out = self.talker.model.codec_embedding(frames[:, 0].clamp(0, self.codec_vocab_size - 1))
        for j, table in enumerate(tables, start=1):
            out = out + table(frames[:, j].clamp(0, self.codebook_size - 1))
        return out

    def embed(self, input_ids: torch.Tensor, frames: torch.Tensor | None = None,
              text_ids: torch.Tensor | None = None,
              vectors: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Input embeddings [T, hidden]: the codec track (``input_ids``' codec embedding where >= 0;
        a frame's sum where ``frames[t, 0] >= 0``; ``vectors`` = (rows, values) as they are) plus the
        text track (``text_ids`` where >= 0). Ids are clamped into range (no lookup fails)."""
        codec_ids = input_ids.clamp(0, self.codec_vocab_size - 1)
        x = self.talker.model.codec_embedding(codec_ids) * (input_ids >= 0)[:, None]
        if frames is not None:
            x = torch.where((frames[:, 0] >= 0)[:, None], self.frame_embeddings(frames), x)
        if vectors is not None:
            rows, values = vectors
            x = x.index_copy(0, rows, values.to(x.dtype))
        if text_ids is not None:
            text = self.project_text(text_ids.clamp(0, self.text_vocab_size - 1))
            x = x + text * (text_ids >= 0)[:, None]
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                frames: torch.Tensor | None = None, text_ids: torch.Tensor | None = None,
                vectors: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The talker's hidden states after its final norm ([T] -> [T, hidden])."""
        x = self.embed(input_ids, frames, text_ids, vectors)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.rope_scaling, x.dtype)
        for layer in self.talker.model.layers:
            x = layer(x, cos, sin, batch)
        return self.talker.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The codec head's logits ([rows, vocab] float32)."""
        return self.talker.codec_head(hidden).float()

    # --- the code predictor ----------------------------------------------------------------------

    @torch.inference_mode()
    def depth_frame(self, backbone_hidden: torch.Tensor, first_codes: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The frames ([B, 16] codes) of B sequences from the talker's hidden state at the position
        that produced codebook 0 ([B, hidden], after its final norm) and codebook 0's codes ([B]).
        ``choose(k, logits)`` picks codebook k's codes ([B]) from its logits ([B, vocab] float32),
        k = 1..15 in order.

        Positions restart at 0 every frame: 0 is the talker's hidden state, 1 codebook 0's codec
        embedding, p >= 2 codebook p - 1 through ``codec_embedding[p - 2]``; the output at position
        p gives codebook p with ``lm_head[p - 1]``."""
        predictor = self.talker.code_predictor
        depth = DepthTransformer(predictor.small_to_mtp_projection, predictor.model.layers, predictor.model.norm,
                                 self.depth_inv_freq, self.depth_rope_scaling)
        first = self.talker.model.codec_embedding(first_codes.clamp(0, self.codec_vocab_size - 1))
        return depth.frame(torch.stack((backbone_hidden, first), dim=1), first_codes, self.num_codebooks, choose,
                           logits=lambda k, hidden: predictor.lm_head[k - 1](hidden).float(),
                           embed=lambda k, codes: predictor.model.codec_embedding[k - 1](
                               codes.clamp(0, self.codebook_size - 1)))

"""The Kyutai TTS PipelineModel: the delayed-streams model (models/kyutai_tts.py) over the paged
KV cache, with its sliding attention window.

A step's inputs: each position's token (the text fed back), its frame (the codes sampled at the
position before) and its text-track id, which names the request's condition: its voice and a
dialogue's other voice (the checkpoint's voices in their order, checkpoints/kyutai_tts_config.py)
and guidance (layouts/kyutai_tts.py's ``condition_id``). A condition's summed vector and its voice's cross-attention keys
and values are computed at its first use and kept, ``kept_conditions`` of them at most (the
manifest's layout option; 16 by default).

The streams' start: at position t a stream whose delay d is at least t reads its start id, and a
codebook whose delay plus the audio delay is beyond t - 1 reads zero (the reference zeroes them as
it samples them; they are never heard): the model applies both by position, so the frames it
samples before the audio starts matter nowhere.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from audio_pipeline.checkpoints.kyutai_tts_config import DsmConfig, GenerationOptions, voice_files
from audio_pipeline.layouts.dsm_text import PAD
from audio_pipeline.models.interface import KVCacheParams, PipelineModel
from audio_pipeline.models.kyutai_tts import ZERO, DsmModel, cross_attend, load_dsm_model, random_dsm_model
from audio_pipeline.models.llama_model import DepthPipelineModel, resolve_cache_dtype

logger = logging.getLogger(__name__)

#: The longest generation where max_length is not set: 4096 frames (about five and a half minutes).
DEFAULT_MAX_FRAMES = 4096


class KyutaiSpeechLM(nn.Module):
    """The delayed-streams model as the engine's runner calls it (``options``: the checkpoint's
    generation settings: the codebooks generated, the text's padding bonus, guidance)."""

    def __init__(self, dsm: DsmModel, model_dir: Path, options: GenerationOptions):
        super().__init__()
        self.dsm = dsm
        config = dsm.config
        self.options = options
        self.codes_per_token = options.n_q
        #: Guidance with a doubled batch (a model not distilled for it): each position runs twice,
        #: the second time without conditions or text, over cache layers of its own (after the
        #: model's), and the depth decoder's logits are guided by the two.
        self.doubled = options.doubled(config)
        self.lm_head = dsm.text_linear
        self.voices = [path for _, path in voice_files(model_dir, config)]
        # cfg conditions by index, then none (layouts/kyutai_tts.py's condition_id)
        self.cfg_values = [format(v, ".1f") for v in config.cfg_values] + [None]
        # (condition id, null) -> Condition, least recently used first, options.kept_conditions at
        # most: a step needs each of its rows' conditions, so a batch of more voices than that keeps
        # them all until the step is done.
        self._conditions: OrderedDict[tuple[int, bool], Condition] = OrderedDict()

    def reset_rotary(self, device: torch.device | None = None) -> None:
        """Nothing to do: the rotation is computed from the positions."""

    def condition(self, condition_id: int, null: bool = False) -> "Condition":
        """(the summed conditions [dim], each layer's cross-attention keys and values) of a
        condition id; ``null``: guidance's null condition of its voice (every condition dropped)."""
        key = (condition_id, null)
        known = self._conditions.get(key)
        if known is not None:
            self._conditions.move_to_end(key)
            return known
        from safetensors.torch import load_file

        choices = len(self.cfg_values)
        voices, cfg = divmod(condition_id, choices)
        other, voice = divmod(voices, len(self.voices))
        if not 0 <= other <= len(self.voices):
            raise ValueError(f"condition {condition_id}: no voice {other - 1} (the model has {len(self.voices)})")
        chosen = [voice] + ([other - 1] if other else [])
        values = {"control": "ok"}
        if self.cfg_values[cfg] is not None:
            values["cfg"] = self.cfg_values[cfg]
        dtype = self.dsm.text_linear.weight.dtype
        with torch.inference_mode():
            speakers = [load_file(str(self.voices[index]))["speaker_wavs"][0] for index in chosen]
            if null:
                total = self.dsm.condition_sum({}).to(dtype)
                cross = self.dsm.cross_keys_values(self.dsm.cross_source([], speakers[0].shape[-1]))
            else:
                total = self.dsm.condition_sum(values).to(dtype)
                cross = self.dsm.cross_keys_values(self.dsm.cross_source(speakers))
        self._conditions[key] = known = (total, cross)
        while len(self._conditions) > self.options.kept_conditions:
            self._conditions.popitem(last=False)
        return known

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, frames: torch.Tensor | None = None,
                text_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm ([T] tokens, [T] positions, [T, codes] frames, [T]
        condition ids -> [T, dim]; with a doubled batch [T, 2 dim]: the null pass's beside)."""
        config = self.dsm.config
        tokens = input_ids.shape[0]
        device = input_ids.device
        ids = text_ids.clamp(min=0) if text_ids is not None else torch.zeros_like(input_ids)
        present = ids.tolist()
        # The streams' start ids by position, and a codebook's zero until the audio reaches it;
        # codebooks beyond those generated (layout_options.n_q) read zero.
        codes = torch.full((tokens, config.n_q), ZERO, device=device, dtype=torch.long)
        if frames is not None:
            codes[:, :frames.shape[1]] = frames
        for k in range(config.n_q):
            delay = config.delays[k + 1]
            column = torch.where(positions - 1 < delay + config.audio_delay_steps, torch.full_like(codes[:, k], ZERO),
                                 codes[:, k])
            codes[:, k] = torch.where(positions <= delay, torch.full_like(column, config.card), column)
        start = positions <= config.delays[0]
        text = torch.where(start, torch.full_like(input_ids, config.text_card), input_ids)
        hidden = self._pass(text, codes, positions, present, batch.attend, False)
        if not self.doubled:
            return hidden
        layers = config.num_layers
        null_text = torch.where(start, text, torch.full_like(text, ZERO))  # the null half reads no text

        def attend(layer: int, q, k, v):
            return batch.attend(layers + layer, q, k, v)

        return torch.cat([hidden, self._pass(null_text, codes, positions, present, attend, True)], dim=1)

    def _pass(self, text, codes, positions, present: list[int], attend: Callable, null: bool) -> torch.Tensor:
        conditions = {i: self.condition(i, null) for i in set(present)}
        total = torch.stack([conditions[i][0] for i in present]) if present else None
        groups = {i: torch.tensor([r for r, c in enumerate(present) if c == i], device=text.device)
                  for i in conditions}

        def cross(layer: int, q: torch.Tensor) -> torch.Tensor:
            if len(groups) == 1:
                ((i, _),) = groups.items()
                return cross_attend(q, *conditions[i][1][layer])
            out = torch.empty_like(q)
            for i, rows in groups.items():
                out[rows] = cross_attend(q[rows], *conditions[i][1][layer])
            return out

        return self.dsm(text, codes, total, positions, attend, cross)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The text logits of the conditioned pass (guidance leaves the text alone), with the padding bonus."""
        logits = self.dsm.text_logits(hidden[:, :self.dsm.config.dim])
        if self.options.padding_bonus:
            logits[:, PAD] += self.options.padding_bonus
        return logits

    @torch.inference_mode()
    def depth_frame(self, backbone_hidden: torch.Tensor, tokens: torch.Tensor,
                    choose: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        codebooks = self.codes_per_token
        if not self.doubled:
            return self.dsm.depth_frame(backbone_hidden, tokens, choose, codebooks)
        dim, rows, coef = self.dsm.config.dim, backbone_hidden.shape[0], self.options.cfg_coef
        both = torch.cat([backbone_hidden[:, :dim], backbone_hidden[:, dim:]])

        def guided(k: int, logits: torch.Tensor) -> torch.Tensor:  # both halves go on with the code chosen
            conditional, null = logits[:rows], logits[rows:]
            picked = choose(k, null + (conditional - null) * coef)
            return torch.cat([picked, picked])

        return self.dsm.depth_frame(both, torch.cat([tokens, tokens]), guided, codebooks)[:rows]


#: A condition's summed vector and each layer's cross-attention keys and values.
Condition = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


class KyutaiPipelineModel(DepthPipelineModel):
    """Kyutai TTS over the paged KV cache; ``forward(tokens, positions, batch, frames=..., text_ids=...)``."""

    supports_int8 = False

    def __init__(self, pipeline_config: Any, huggingface_config: Any, model_dir: Path, *,
                 devices: Sequence[torch.device], dtype: torch.dtype, kv_cache_config: Any,
                 random_weights: bool = False):
        # The Llama model's set-up (packed products, fused layers, native decode layers) does not
        # apply to these layers: only what the engine reads is set.
        PipelineModel.__init__(self, pipeline_config, huggingface_config, devices=devices, dtype=dtype,
                               kv_cache_config=kv_cache_config)
        if pipeline_config.model.quantization != "none":
            raise ValueError("model.quantization is not supported for Kyutai TTS models; set model.quantization=none")
        self.model_dir = Path(model_dir)
        self.cache_dtype = resolve_cache_dtype(kv_cache_config, dtype, self.devices[0])
        self.max_seq_len = self.calculate_max_seq_len(pipeline_config, huggingface_config)
        if random_weights:  # a benchmark's model: real shapes, drawn at load
            dsm = random_dsm_model(huggingface_config.dsm, dtype, self.devices[0])
        else:
            dsm = load_dsm_model(model_dir, huggingface_config.dsm, dtype=dtype, device=self.devices[0])
        self.model = KyutaiSpeechLM(dsm, self.model_dir, huggingface_config.options)
        self.packed_linears = False
        self._packed_ranges = {}
        self.prompt_dtype = None
        if pipeline_config.model.compile:
            logger.info("model.compile: the Kyutai TTS model runs eagerly (compile is not supported for it yet)")
        self.forward = self.model

    def backbone_layers(self) -> torch.nn.Module:
        return self.model.dsm.transformer.layers

    def compute_candidate_logits(self, hidden: torch.Tensor, groups: Sequence[tuple[int, int, int]],
                                 order: torch.Tensor, extra_ids: torch.Tensor, width: int) -> torch.Tensor:
        """The text logits (one range: the whole text vocabulary), then the extra ids' (never
        chosen: a text stream stops by its rule)."""
        logits = torch.full((hidden.shape[0], width + extra_ids.shape[1]), float("-inf"), device=hidden.device)
        logits[:, :width] = self.model.text_logits(hidden)[:, :width]
        return logits

    @property
    def codes_per_token(self) -> int:
        return self.model.codes_per_token

    @classmethod
    def calculate_max_seq_len(cls, pipeline_config: Any, huggingface_config: Any) -> int:
        return pipeline_config.max_length or DEFAULT_MAX_FRAMES

    @classmethod
    def get_kv_params(cls, huggingface_config: Any, n_devices: int, kv_cache_config: Any, cache_dtype: torch.dtype, *,
                      device_type: str = "cpu") -> KVCacheParams:
        dsm: DsmConfig = huggingface_config.dsm
        # A doubled batch's null pass keeps its keys and values in layers of its own.
        layers = dsm.num_layers * (2 if huggingface_config.options.doubled(dsm) else 1)
        return KVCacheParams(num_layers=layers, n_kv_heads=dsm.num_heads // dsm.kv_repeat,
                             head_dim=dsm.dim // dsm.num_heads, dtype=cache_dtype,
                             page_size=kv_cache_config.page_size_for(device_type), n_devices=n_devices,
                             window=dsm.context)

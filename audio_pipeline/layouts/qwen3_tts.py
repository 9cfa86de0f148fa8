"""The Qwen3-TTS layout (12 Hz): one talker position per 80 ms frame of 16 codes, two input tracks.

Tracks
    Every position's input is a codec track (a control id of the talker's codec vocabulary, a
    preset speaker's id, a frame of 16 codes, or a cloned voice's speaker vector) plus a text track
    (a text token, projected; or nothing). The prompt ids are the codec track (-1 where a position
    has none); :class:`TrackedPrompt` carries the text track beside them, any raw vectors, and the
    text ids the generated frames add, one per frame (then ``<tts_pad>``).
Prompt (the reference's order)
    An instruction ``<|im_start|>user\\n{instruction}<|im_end|>\\n`` (text only; VoiceDesign's voice
    description, a CustomVoice style); the role ``<|im_start|>assistant\\n`` (text only); the codec
    prefix: think/nothink, think_bos, the language, think_eos, the speaker (a preset's id, a cloned
    voice's vector, or none), pad, each with ``<tts_pad>`` (the last with ``<tts_text_bos>``); then
    the text. Non-streaming text: every text token with the codec pad, ``<tts_text_eod>`` with pad,
    ``<tts_pad>`` with the codec bos; the frames then add ``<tts_pad>``. Streaming text: the first
    text token with the codec bos; each generated frame adds the next text token, then
    ``<tts_text_eod>``, then ``<tts_pad>``. In-context cloning puts the reference's transcript and
    frames before the text (the prompt's codec track holds the reference's frames).
Frames and stop
    The talker samples codebook 0 (token id = code) and the code predictor codebooks 1..15. The
    control ids sit above the codebook in the talker's vocabulary; ``codec_eos_token_id`` ends the
    speech (it is the only one the sampler may choose, after ``min_tokens``).
Voices
    CustomVoice: the preset speakers of ``talker_config.spk_id`` (a dialect speaker switches an auto
    or Chinese language to its dialect). VoiceDesign: a description in words. Base: a reference
    recording (its speaker vector, and with its transcript in context).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Sequence

import torch

from audio_pipeline.layouts.text_track import TextTrack
from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.base import Layout
from audio_pipeline.layouts.registry import Family, register_family
from audio_pipeline.layouts.voice_info import VoiceInfo

#: Model types (config.json ``tts_model_type``) and what their voices are.
CUSTOM_VOICE, VOICE_DESIGN, BASE = "custom_voice", "voice_design", "base"


class TrackedPrompt(list):
    """Prompt ids (the codec track, -1 where a position has none) with its text track beside them
    (``track``: a text id per position, the generated frames' text, raw vectors)."""

    def __init__(self, ids: Sequence[int], track: TextTrack):
        super().__init__(ids)
        self.track = track


@dataclass(frozen=True, kw_only=True)
class Qwen3TTSLayout(Layout):
    """Maps Qwen3-TTS frames to talker positions and builds its two-track prompts."""

    codebook_size: int
    codes_per_token: int = 16
    tokens_per_frame: int = 1
    end_of_speech: int
    model_type: str
    #: Codec control ids (talker vocabulary).
    codec_pad: int
    codec_bos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    languages: dict = field(default_factory=dict)
    speakers: dict = field(default_factory=dict)
    dialects: dict = field(default_factory=dict)
    #: Text-track ids.
    tts_bos: int
    tts_eos: int
    tts_pad: int
    #: Streaming text (each frame reads the next text token) or the whole text in the prompt;
    #: the reference's default per model type.
    streaming_text: bool = False
    #: The language the codec prefix names ("auto": none, the model's choice).
    language: str = "auto"
    #: Models whose size ignores a CustomVoice instruction (the reference drops it on 0.6B).
    ignores_instructions: bool = False
    vocab_size: int = 0
    has_text_track: ClassVar[bool] = True
    takes_language: ClassVar[bool] = True

    @classmethod
    def from_config(cls, config) -> "Qwen3TTSLayout":
        """The layout of a checkpoint with ``config`` (checkpoints/qwen3_tts_config.py's read_config)."""
        talker = config.talker_config
        model_type = getattr(config, "tts_model_type", CUSTOM_VOICE)
        if model_type not in (CUSTOM_VOICE, VOICE_DESIGN, BASE):
            raise ValueError(f"model.model_path: config.json tts_model_type {model_type!r} is not one of "
                             f"{CUSTOM_VOICE}, {VOICE_DESIGN}, {BASE}")
        return cls(
            codebook_size=int(talker.code_predictor_config.vocab_size), codes_per_token=int(talker.num_code_groups),
            end_of_speech=int(talker.codec_eos_token_id), model_type=model_type,
            codec_pad=int(talker.codec_pad_id), codec_bos=int(talker.codec_bos_id), codec_think=int(talker.codec_think_id),
            codec_nothink=int(talker.codec_nothink_id), codec_think_bos=int(talker.codec_think_bos_id),
            codec_think_eos=int(talker.codec_think_eos_id),
            languages=_table(talker, "codec_language_id"), speakers=_table(talker, "spk_id"),
            dialects=_table(talker, "spk_is_dialect"),
            tts_bos=int(config.tts_bos_token_id), tts_eos=int(config.tts_eos_token_id),
            tts_pad=int(config.tts_pad_token_id), streaming_text=model_type == BASE,
            ignores_instructions="0b6" in str(getattr(config, "tts_model_size", "")),
            vocab_size=int(talker.vocab_size))

    # --- capabilities ----------------------------------------------------------------------------

    @property
    def described_voices(self) -> bool:  # type: ignore[override]
        return self.model_type == VOICE_DESIGN

    @property
    def requires_reference(self) -> bool:  # type: ignore[override]
        return self.model_type == BASE

    @property
    def takes_instructions(self) -> bool:  # type: ignore[override]
        """A CustomVoice model speaks its preset voices in the style an instruction asks (not 0.6B)."""
        return self.model_type == CUSTOM_VOICE and not self.ignores_instructions

    @property
    def min_vocab_size(self) -> int:
        return self.end_of_speech + 1

    # --- tokens ----------------------------------------------------------------------------------

    def token_range(self, position: int) -> tuple[int, int]:
        return 0, self.codebook_size

    def token_to_code(self, token_id: int, position: int) -> int:
        if not 0 <= token_id < self.codebook_size:
            raise ValueError(f"token {token_id} is not a code of codebook 0 (expected [0, {self.codebook_size}))")
        return token_id

    def tokens_to_codes(self, token_ids: Sequence[int], first_position: int = 0) -> torch.Tensor:
        return torch.tensor([self.token_to_code(t, 0) for t in token_ids], dtype=torch.long)

    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        """Codebook 0's code of each frame of frame-major ``codes`` (the positions' token ids)."""
        return [int(c) for c in list(codes)[::self.codes_per_token]]

    # --- prompts ---------------------------------------------------------------------------------

    def spoken_languages(self) -> tuple[str, ...]:
        """The languages the checkpoint's codec names (``codec_language_id``: english, chinese, ...,
        and dialects such as beijing_dialect)."""
        return tuple(sorted(self.languages))

    def language_id(self, language: str | None, speaker: str | None) -> int | None:
        """The codec's language id (None: auto), switched to a dialect speaker's dialect where the
        language is auto or Chinese."""
        name = (language or "auto").lower()
        if name != "auto" and name not in self.languages:
            raise InvalidArgument(f"unknown language {language!r}; known: auto, {', '.join(sorted(self.languages))}",
                                  field="language")
        dialect = self.dialects.get(speaker) if speaker else None
        if dialect and name in ("auto", "chinese"):
            return self.languages[dialect]
        return None if name == "auto" else self.languages[name]

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0, *,
                     language: str | None = None, instructions: str | None = None) -> TrackedPrompt:
        """The two-track prompt for ``text`` in ``voice`` (a preset speaker, a description, or the
        ``reference``'s voice), in ``language`` (else the layout's), with ``instructions`` (a
        CustomVoice style, where the model size takes them)."""
        language = language or self.language
        speaker_id, vector, instruction = None, None, instructions
        if self.model_type == VOICE_DESIGN:
            instruction = voice or instructions
            if reference is not None:
                raise InvalidArgument("this model speaks in a described voice and cannot clone a recording: "
                                      "describe the voice instead", field="reference")
        elif self.model_type == CUSTOM_VOICE:
            if reference is not None:
                raise InvalidArgument("this model speaks in its preset voices and cannot clone a recording "
                                      "(a Base checkpoint of it can)", field="reference")
            name = (voice or "").lower()
            if name not in self.speakers:
                raise InvalidArgument(f"unknown speaker {voice!r}; available: {', '.join(sorted(self.speakers))}",
                                      field="voice")
            speaker_id = self.speakers[name]
            if self.ignores_instructions:
                instruction = None
        else:
            if reference is None:
                raise InvalidArgument("this model speaks in the voice of a reference recording: give one "
                                      "with its transcript, or a registered voice", field="reference")
            vector = getattr(reference, "speaker_embedding", None)
            if vector is None:
                raise InvalidArgument("the reference has no speaker embedding (register the voice again)",
                                      field="reference")
            instruction = None
        language_id = self.language_id(language, voice.lower() if speaker_id is not None and voice else None)
        ids, text_ids, vectors = [], [], {}

        def add(codec: int, text_id: int) -> None:
            ids.append(codec)
            text_ids.append(text_id)

        if instruction:
            for token in tokenizer(f"<|im_start|>user\n{instruction}<|im_end|>\n").input_ids:
                add(-1, token)
        words = tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids
        for token in words[:3]:
            add(-1, token)
        prefix = ([self.codec_nothink, self.codec_think_bos, self.codec_think_eos] if language_id is None
                  else [self.codec_think, self.codec_think_bos, language_id, self.codec_think_eos])
        speaker = [speaker_id] if speaker_id is not None else ([-1] if vector is not None else [])
        codec = [*prefix, *speaker, self.codec_pad]  # the codec bos that ends Q comes with the text
        for j, codec_id in enumerate(codec):
            if codec_id == -1:
                vectors[len(ids)] = torch.as_tensor(vector, dtype=torch.float32).reshape(-1)
            add(codec_id, self.tts_pad if j < len(codec) - 1 else self.tts_bos)
        spoken = words[3:-5]
        if not spoken:
            raise InvalidArgument("has nothing to speak", field="text")
        trailing: list[int] = []
        if self.model_type == BASE and reference.transcript:
            trailing = self._in_context(tokenizer, reference, spoken, add)
        elif self.streaming_text:
            add(self.codec_bos, spoken[0])
            trailing = [*spoken[1:], self.tts_eos]
        else:
            for token in spoken:
                add(self.codec_pad, token)
            add(self.codec_pad, self.tts_eos)
            add(self.codec_bos, self.tts_pad)
        return TrackedPrompt(ids, TextTrack(text_ids, trailing, self.tts_pad, vectors))

    def _in_context(self, tokenizer, reference, spoken: list[int], add) -> list[int]:
        """In-context cloning: the reference's transcript and the text on the text track, the codec
        bos and the reference's frames on the codec track (frame positions: the frames travel in
        ``prompt_frames``, their codebook-0 code as the id). Returns the generated frames' text."""
        transcript = tokenizer(f"<|im_start|>assistant\n{reference.transcript}<|im_end|>\n").input_ids[3:-2]
        text = [*transcript, *spoken, self.tts_eos]
        frames = self.reference_frames(reference)
        codec = [self.codec_bos, *frames[:, 0].tolist()]
        if not self.streaming_text:
            for token in text:
                add(self.codec_pad, token)
            for codec_id in codec:
                add(codec_id, self.tts_pad)
            return []
        if len(text) > len(codec):
            for token, codec_id in zip(text, codec):
                add(codec_id, token)
            return text[len(codec):]
        for index, codec_id in enumerate(codec):
            add(codec_id, text[index] if index < len(text) else self.tts_pad)
        return []

    def prompt_frames(self, prompt_ids: Sequence[int], reference=None) -> torch.Tensor | None:
        """In-context cloning: the reference's frames at the positions after the codec bos that
        carries it (the codec track's frame positions); None otherwise."""
        if reference is None or not reference.transcript or self.model_type != BASE:
            return None
        frames = self.reference_frames(reference)
        ids = list(prompt_ids)
        out = torch.full((len(ids), self.codes_per_token), -1, dtype=torch.long)
        start = max(i for i, codec in enumerate(ids) if codec == self.codec_bos) + 1
        out[start:start + frames.shape[0]] = frames
        return out

    def text_track(self, prompt: Sequence[int]) -> TextTrack | None:
        """The text track of ``prompt`` (built by :meth:`build_prompt`)."""
        return prompt.track if isinstance(prompt, TrackedPrompt) else None


def _table(talker, name: str) -> dict:
    """One of the talker config's name -> id tables (empty where the checkpoint has none)."""
    table = getattr(talker, name, None)
    return dict(vars(table)) if table is not None else {}


def _make_layout(model_dir: Path, tokenizer, options) -> Qwen3TTSLayout:
    from audio_pipeline.checkpoints.qwen3_tts_config import read_config

    layout = Qwen3TTSLayout.from_config(read_config(model_dir))
    if "streaming_text" in options:
        if not isinstance(options["streaming_text"], bool):
            raise ValueError(f"{model_dir}: layout_options.streaming_text must be true or false")
        layout = dataclasses.replace(layout, streaming_text=options["streaming_text"])
    if "language" in options:
        language = str(options["language"]).lower()
        if language != "auto" and language not in layout.languages:
            raise ValueError(f"{model_dir}: layout_options.language {options['language']!r} is not one of auto, "
                             f"{', '.join(sorted(layout.languages))}")
        layout = dataclasses.replace(layout, language=language)
    return layout


def _preset_voices(model_dir: Path) -> tuple[VoiceInfo, ...]:
    """A CustomVoice checkpoint's speakers (config.json ``talker_config.spk_id``); none for the others."""
    try:
        talker = json.loads((model_dir / "config.json").read_text())["talker_config"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(VoiceInfo(name, f"Qwen3-TTS preset speaker {name}") for name in sorted(talker.get("spk_id") or {}))


register_family(Family(
    "qwen3-tts", make_layout=_make_layout, detect=lambda config, model_dir: config.get("model_type") == "qwen3_tts",
    preset_voices=_preset_voices,
    # The languages its checkpoint's codec names (Qwen3TTSLayout.spoken_languages), none otherwise.
    languages=(),
    layout_options={"language": "the language the prompt names (auto, english, chinese, ...; default auto)",
                    "streaming_text": "true: each frame reads the next text token (the reference's default for "
                                      "Base models); false: the whole text is in the prompt (its default for "
                                      "CustomVoice and VoiceDesign)"},
    decoder="qwen3-tts-12hz", decoder_weights="speech_tokenizer",
    # The 12 Hz decoder is causal and keeps its state: each chunk's frames are decoded as they come
    # (block-causal), the first after one frame (80 ms of audio), then 2, 4. Counted in codes: 16 a frame.
    streaming={"chunk_size": [16, 32, 64], "block_causal": True},
    # The reference's defaults: temperature 0.9 over the 50 likeliest codes (talker and code
    # predictor alike), a repetition penalty of 1.05 on codebook 0, and at least 2 frames.
    sampling={"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "min_tokens": 2}))

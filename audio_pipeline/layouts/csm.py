"""The CSM layout (Sesame's Conversational Speech Model): a Llama backbone that samples one Mimi
frame per pass, its first code from the backbone and the other codebooks from a depth decoder.

Frames
    One LM position per frame (12.5 frames/s), carrying all ``num_codebooks`` codes (32 for
    CSM-1B). The backbone's output head scores codebook 0's codes (its token ids are the codes
    themselves); the depth decoder samples codebooks 1..N-1 of the same frame. A position's input
    is the sum of its frame's codebook embeddings (text positions embed their token).

Prompt
    Each turn is ``<|begin_of_text|>[{speaker}]{text}<|end_of_text|>``; a turn that was spoken
    (a cloned voice's reference: earlier text and its audio) is followed by one ``<|AUDIO|>``
    position per frame of its audio, then ``<|audio_eos|>`` (a frame of zeros). The prompt ends
    with the turn to speak; the model continues with its audio.

Stop
    A frame whose codes, but the last codebook's, are all ``codebook_eos_token_id`` (0) ends the
    speech (transformers' rule); it is not part of the audio.

Voices
    The speaker id (``0``, ``1``, ...) in the turn's brackets; a reference recording and its
    transcript as an earlier turn make the model continue in that voice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.orpheus import OrpheusLayout
from audio_pipeline.layouts.registry import Family, register_family
from audio_pipeline.layouts.voice_info import VoiceInfo

BEGIN_OF_TEXT, END_OF_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
AUDIO, AUDIO_EOS = "<|AUDIO|>", "<|audio_eos|>"
#: Speakers of a CSM model whose manifest names none.
DEFAULT_SPEAKERS = ("0", "1")
#: The id the engine records for a frame that ends the speech (never a code: codes are >= 0).
STOP = -1


@dataclass(frozen=True, kw_only=True)
class CsmLayout(OrpheusLayout):
    """Maps CSM frames to LM positions and builds conversation prompts."""

    audio_token_base: int = 0
    tokens_per_frame: int = 1
    end_of_speech: int = STOP
    #: Codebooks per frame (32 for CSM-1B): the backbone samples the first, the depth decoder the rest.
    codes_per_token: int = 32
    bos: int
    eos: int
    audio: int
    audio_eos: int
    #: The code that, in every codebook but the last, marks the end of the speech.
    stop_code: int = 0
    stops_by_token: ClassVar[bool] = False

    @classmethod
    def from_config(cls, tokenizer, config) -> "CsmLayout":
        """The layout of a checkpoint with ``config`` (a CsmConfig) and its ``tokenizer``; ValueError
        naming what is missing or inconsistent. Codes are the codec's (``codec_config.codebook_size``,
        2048 for Mimi): the backbone's and depth decoder's extra rows are never sampled."""
        vocab = tokenizer.get_vocab()
        missing = [name for name in (BEGIN_OF_TEXT, END_OF_TEXT, AUDIO, AUDIO_EOS) if name not in vocab]
        if missing:
            raise ValueError(f"model.model_path: the tokenizer has no {', '.join(missing)} token (not a CSM checkpoint?)")
        for name, key in ((AUDIO, "audio_token_id"), (AUDIO_EOS, "audio_eos_token_id")):
            if getattr(config, key, vocab[name]) != vocab[name]:
                raise ValueError(f"model.model_path: config.json {key} is {getattr(config, key)}, the tokenizer's "
                                 f"{name} is {vocab[name]}")
        codec = getattr(config, "codec_config", None)
        codes = int(getattr(codec, "codebook_size", 0) or config.vocab_size)
        return cls(codebook_size=min(codes, int(config.vocab_size)), codes_per_token=int(config.num_codebooks),
                   bos=vocab[BEGIN_OF_TEXT], eos=vocab[END_OF_TEXT], audio=vocab[AUDIO], audio_eos=vocab[AUDIO_EOS],
                   stop_code=int(getattr(config, "codebook_eos_token_id", 0)))

    def check_decoder(self, decoder) -> None:
        """ValueError unless ``decoder`` takes this model's frames (its codebooks and codes)."""
        if decoder.tokens_per_frame != self.codes_per_token:
            raise ValueError(f"audio_decoder: {decoder.name!r} takes {decoder.tokens_per_frame} codebooks per frame; "
                             f"the model samples {self.codes_per_token}")
        if decoder.codebook_size < self.codebook_size:
            raise ValueError(f"audio_decoder: {decoder.name!r} has {decoder.codebook_size} codes per codebook; "
                             f"the model samples {self.codebook_size}")

    def turn(self, tokenizer, text: str, speaker: str) -> list[int]:
        return [self.bos, *tokenizer(f"[{speaker}]{text}", add_special_tokens=False).input_ids, self.eos]

    @staticmethod
    def speaker(voice: str | None) -> str:
        speaker = voice or DEFAULT_SPEAKERS[0]
        if not speaker.isdigit():
            raise InvalidArgument(f"this model's speakers are numbers (0, 1, ...), got {speaker[:40]!r}", field="voice")
        return speaker

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0) -> list[int]:
        speaker = self.speaker(voice)
        if reference is None:
            return self.turn(tokenizer, text, speaker)
        frames = self.reference_frames(reference)
        return [*self.turn(tokenizer, reference.transcript, speaker), *[self.audio] * frames.shape[0], self.audio_eos,
                *self.turn(tokenizer, text, speaker)]

    def prompt_frames(self, prompt_ids: Sequence[int], reference=None) -> torch.Tensor | None:
        """The reference's frames at the ``<|AUDIO|>`` positions, zeros at ``<|audio_eos|>``."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        frames = torch.full((ids.numel(), self.codes_per_token), -1, dtype=torch.long)
        audio = ids == self.audio
        if audio.any():
            if reference is None:
                raise InvalidArgument("the prompt holds audio positions but no reference codes", field="reference")
            codes = self.reference_frames(reference)
            if codes.shape[0] != int(audio.sum()):
                raise InvalidArgument(f"the prompt has {int(audio.sum())} audio positions for {codes.shape[0]} "
                                      "reference frames", field="reference")
            frames[audio] = codes
        frames[ids == self.audio_eos] = self.stop_code
        return frames if (frames[:, 0] >= 0).any() else None

    def ends_speech(self, frame: Sequence[int]) -> bool:
        return all(int(code) == self.stop_code for code in list(frame)[:-1])

    # Generated positions hold codebook 0's code as their token id (token_range: [0, codebook_size));
    # the frame is the context's.
    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        """Codebook 0's code of each frame of frame-major ``codes`` (the positions' token ids)."""
        return [int(c) for c in list(codes)[::self.codes_per_token]]


def _make_layout(model_dir, tokenizer, options) -> CsmLayout:
    from transformers import AutoConfig, AutoTokenizer

    return CsmLayout.from_config(tokenizer or AutoTokenizer.from_pretrained(model_dir),
                                 AutoConfig.from_pretrained(model_dir))


register_family(Family(
    "csm", make_layout=_make_layout, detect=lambda config, model_dir: config.get("model_type") == "csm",
    voices=tuple(VoiceInfo(v, f"CSM speaker {v}") for v in DEFAULT_SPEAKERS), default_voice=DEFAULT_SPEAKERS[0],
    # CSM's Mimi codec is in the checkpoint (``codec_model.*``).
    decoder="mimi", decoder_weights=".", languages=("en",),
    # Mimi is causal and keeps its streaming state: each chunk's frames are decoded as they come
    # (block-causal), the first after 2 frames (160 ms of audio), then 4, 8. Counted in codes: 32
    # per frame for CSM-1B.
    streaming={"chunk_size": [64, 128, 256], "block_causal": True},
    # Sesame's generator: temperature 0.9 over the 50 likeliest codes, backbone and depth decoder
    # alike (here each request's settings act on both).
    sampling={"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}))

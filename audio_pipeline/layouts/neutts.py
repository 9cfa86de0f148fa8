"""The NeuTTS layout (Neuphonic's NeuTTS Air): a Qwen2 speech LM that speaks in the voice of a
reference recording, one NeuCodec code per 20 ms frame.

Prompt (the reference implementation's, for models that read phonemes)
    ``tokenizer.encode("user: Convert the text to speech:<|TEXT_REPLACE|>\\nassistant:<|SPEECH_REPLACE|>")``
    with ``<|TEXT_REPLACE|>`` replaced by ``<|TEXT_PROMPT_START|>``, the ids of the phonemes of the
    reference's transcript and of the text (eSpeak NG's IPA, stress marked, punctuation kept,
    joined by a space), ``<|TEXT_PROMPT_END|>``; and ``<|SPEECH_REPLACE|>`` by
    ``<|SPEECH_GENERATION_START|>`` and the reference's speech tokens, where the prompt ends: the
    model goes on speaking the text in that voice. It stops with ``<|SPEECH_GENERATION_END|>``.

Speech tokens
    ``<|speech_0|>`` ... ``<|speech_{N-1}|>``, consecutive ids in the tokenizer: a code is its
    token's id minus ``<|speech_0|>``'s. N is read from the tokenizer (65,536 for NeuTTS Air, the
    NeuCodec codebook). Orpheus's id arithmetic with one token per frame does the mapping.

Voices
    Cloning only: every request speaks as a reference (one in the request, a registered voice, or
    a preset voice the model directory ships a reference for); the engine refuses one without.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.orpheus import OrpheusLayout
from audio_pipeline.layouts.registry import Family, register_family

CHAT = "user: Convert the text to speech:<|TEXT_REPLACE|>\nassistant:<|SPEECH_REPLACE|>"
TEXT_REPLACE, SPEECH_REPLACE = "<|TEXT_REPLACE|>", "<|SPEECH_REPLACE|>"
TEXT_PROMPT_START, TEXT_PROMPT_END = "<|TEXT_PROMPT_START|>", "<|TEXT_PROMPT_END|>"
SPEECH_GENERATION_START, SPEECH_GENERATION_END = "<|SPEECH_GENERATION_START|>", "<|SPEECH_GENERATION_END|>"
SPECIAL_TOKENS = (TEXT_REPLACE, SPEECH_REPLACE, TEXT_PROMPT_START, TEXT_PROMPT_END, SPEECH_GENERATION_START,
                  SPEECH_GENERATION_END)


def speech_token(code: int) -> str:
    return f"<|speech_{code}|>"


@dataclass(frozen=True, kw_only=True)
class NeuTTSLayout(OrpheusLayout):
    """Maps between LM token ids and NeuCodec codes, and builds cloning prompts."""

    tokens_per_frame: int = 1
    #: The prompt's ids around the phonemes: before ``<|TEXT_PROMPT_START|>``, and between
    #: ``<|TEXT_PROMPT_END|>`` and ``<|SPEECH_GENERATION_START|>``.
    prompt_head: tuple[int, ...]
    prompt_middle: tuple[int, ...]
    text_prompt_start: int
    text_prompt_end: int
    speech_generation_start: int
    #: Every request needs a voice prompt (a reference's transcript and codes).
    requires_reference: ClassVar[bool] = True

    @classmethod
    def from_tokenizer(cls, tokenizer, model_dir: Path) -> "NeuTTSLayout":
        """The layout of the checkpoint in ``model_dir`` with ``tokenizer`` (its own); ValueError
        naming what is missing when it is not a phoneme-reading NeuTTS checkpoint."""
        _check_input_format(Path(model_dir))
        vocab = tokenizer.get_vocab()
        missing = [name for name in (*SPECIAL_TOKENS, speech_token(0)) if name not in vocab]
        if missing:
            raise ValueError(f"model.model_path: the tokenizer of {model_dir} has no {', '.join(missing)} "
                             "token (not a NeuTTS checkpoint?)")
        base = vocab[speech_token(0)]
        count = 0
        while vocab.get(speech_token(count)) == base + count:
            count += 1
        if speech_token(count) in vocab:
            raise ValueError(f"model.model_path: the tokenizer of {model_dir} has {speech_token(count)} at id "
                             f"{vocab[speech_token(count)]}, not {base + count}: speech tokens must have "
                             "consecutive ids")
        ids = tokenizer.encode(CHAT)
        if ids.count(vocab[TEXT_REPLACE]) != 1 or ids.count(vocab[SPEECH_REPLACE]) != 1:
            raise ValueError(f"model.model_path: the tokenizer of {model_dir} does not keep {TEXT_REPLACE} and "
                             f"{SPEECH_REPLACE} whole in the prompt")
        text, speech = ids.index(vocab[TEXT_REPLACE]), ids.index(vocab[SPEECH_REPLACE])
        return cls(audio_token_base=base, codebook_size=count, end_of_speech=vocab[SPEECH_GENERATION_END],
                   prompt_head=tuple(ids[:text]), prompt_middle=tuple(ids[text + 1:speech]),
                   text_prompt_start=vocab[TEXT_PROMPT_START], text_prompt_end=vocab[TEXT_PROMPT_END],
                   speech_generation_start=vocab[SPEECH_GENERATION_START])

    def check_decoder(self, decoder) -> None:
        """ValueError unless ``decoder`` speaks this model's codes: one per frame, as many as its
        speech tokens (every code the decoder encodes a reference to must have a token)."""
        if decoder.codebook_size != self.codebook_size:
            raise ValueError(f"audio_decoder: {decoder.name!r} has {decoder.codebook_size} codes; "
                             f"the model's tokenizer has {self.codebook_size} speech tokens")

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0) -> list[int]:
        from audio_pipeline.text.espeak import ipa_with_punctuation

        if reference is None:
            raise InvalidArgument("this model speaks in the voice of a reference recording: give one with "
                                  "its transcript, or a registered voice", field="reference")
        phonemes = f"{ipa_with_punctuation(reference.transcript)} {ipa_with_punctuation(text)}"
        return [*self.prompt_head, self.text_prompt_start, *tokenizer.encode(phonemes, add_special_tokens=False),
                self.text_prompt_end, *self.prompt_middle, self.speech_generation_start,
                *self.codes_to_tokens(reference.codes.tolist())]


def _check_input_format(model_dir: Path) -> None:
    """Newer NeuTTS checkpoints may read text instead of phonemes (config.json's
    ``neuphonic.input_format``); this layout writes phonemes."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # the engine reports an unreadable config.json itself
    settings = config.get("neuphonic") if isinstance(config, dict) else None
    input_format = settings.get("input_format", "phonemes") if isinstance(settings, dict) else "phonemes"
    if input_format != "phonemes":
        raise ValueError(f"model.model_path: {model_dir} reads {input_format!r} input (config.json "
                         "neuphonic.input_format); the neutts layout writes phonemes only")


def _make_layout(model_dir: Path, tokenizer, options) -> NeuTTSLayout:
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return NeuTTSLayout.from_tokenizer(tokenizer, model_dir)


register_family(Family(
    "neutts", make_layout=_make_layout, languages=("en",),  # NeuTTS Air; a manifest names another model's
    # NeuCodec is not causal: every chunk is decoded after a second of left context (50 frames), the
    # voice's reference codes where the speech has less (rolling), from 15 frames (0.3 s) first, then
    # 25 and 50; a chunk's last frames are decoded without the frames after them, where streamed
    # audio differs most from the whole utterance decoded at once.
    streaming={"chunk_size": [15, 25, 50], "buffer": 50, "prepend_prompt_speech_tokens": "rolling"},
    # The reference draws from the 50 most likely codes at temperature 1, with no nucleus and no
    # repetition penalty.
    sampling={"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}))

"""The Orpheus speech-token layout: prompt format, voice prefixes, LM token ids <-> audio codes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from audio_pipeline.layouts.base import Layout
from audio_pipeline.layouts.registry import Family, register_family
from audio_pipeline.layouts.voice_info import VoiceInfo

BEGIN_OF_TEXT = 128000
END_OF_TEXT = 128009
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_AI = 128262
PAD = 128263
AUDIO_TOKEN_BASE = 128266
CODEBOOK_SIZE = 4096
TOKENS_PER_FRAME = 7
#: Codebook (0, 1 or 2) each of the seven positions of a frame draws from.
FRAME_POSITION_CODEBOOK = (0, 1, 2, 2, 1, 2, 2)
#: Smallest vocabulary that holds every speech token id.
MIN_VOCAB_SIZE = AUDIO_TOKEN_BASE + TOKENS_PER_FRAME * CODEBOOK_SIZE

#: Preset voices of the Orpheus English fine-tunes; the voice name is a text prefix.
ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


@dataclass(frozen=True)
class OrpheusLayout(Layout):
    """Maps between LM token ids and audio codes, and builds prompts."""

    audio_token_base: int = AUDIO_TOKEN_BASE
    codebook_size: int = CODEBOOK_SIZE
    tokens_per_frame: int = TOKENS_PER_FRAME
    end_of_speech: int = END_OF_SPEECH

    @property
    def min_vocab_size(self) -> int:
        """Smallest LM vocabulary that holds every speech token id of this layout."""
        return self.audio_token_base + self.tokens_per_frame * self.codebook_size

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0) -> list[int]:
        """The LM prompt ids for ``text`` spoken by ``voice``.

        With a ``reference`` (a cloned voice: ``.transcript`` and frame-major ``.codes``), the prompt
        first holds one finished exchange, the transcript and the reference's speech tokens, so
        the model continues in that voice; the text then carries no voice prefix.
        """
        if reference is None:
            return self.prompt_ids(tokenizer(self.prompt_text(text, voice)).input_ids)
        example = self.prompt_ids(tokenizer(reference.transcript).input_ids)
        speech = self.codes_to_tokens(reference.codes.tolist())
        return [*example, *speech, END_OF_SPEECH, END_OF_AI, *self.prompt_ids(tokenizer(text).input_ids)]

    def prompt_ids(self, text_ids: Sequence[int]) -> list[int]:
        """The full LM prompt around already tokenized ``"{voice}: {text}"`` ids."""
        return [START_OF_HUMAN, *text_ids, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]

    @staticmethod
    def prompt_text(text: str, voice: str | None) -> str:
        """The text the tokenizer sees: the voice name is a prefix (none for the unnamed voice)."""
        return f"{voice}: {text}" if voice else text

    def token_range(self, position: int) -> tuple[int, int]:
        """Half-open range of the speech-token ids valid at ``position`` of a frame."""
        start = self.audio_token_base + (position % self.tokens_per_frame) * self.codebook_size
        return start, start + self.codebook_size

    def is_valid_token(self, token_id: int, position: int) -> bool:
        """True when ``token_id`` is a speech token of the codebook slot at ``position``."""
        start, end = self.token_range(position)
        return start <= token_id < end

    def token_to_code(self, token_id: int, position: int) -> int:
        """The code of ``token_id`` at frame position ``position``; ValueError when it is not valid there.

        Never shifts the frame phase to make a bad token fit: a wrong token is an error.
        """
        # token_range's arithmetic inline: every sampled token of every row passes here.
        start = self.audio_token_base + (position % self.tokens_per_frame) * self.codebook_size
        code = token_id - start
        if not 0 <= code < self.codebook_size:
            raise ValueError(
                f"token {token_id} is not a speech token for frame position {position % self.tokens_per_frame} "
                f"(expected [{start}, {start + self.codebook_size}))")
        return code

    def tokens_to_codes(self, token_ids: Sequence[int], first_position: int = 0) -> torch.Tensor:
        """Maps speech-token ids (starting at frame position ``first_position``) to codes. Array
        arithmetic, not a call a token: the engine loop maps every decoder window's tokens (at 256
        streams a few thousand a pass)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        count, phase = ids.shape[0], first_position % self.tokens_per_frame
        starts = self._slot_starts(phase + count)[phase:phase + count]
        codes = ids - starts
        if (codes.view(np.uint64) >= self.codebook_size).any():  # below 0 wraps to the top: one comparison
            bad = int(np.flatnonzero((codes < 0) | (codes >= self.codebook_size))[0])
            self.token_to_code(int(ids[bad]), first_position + bad)  # raises, as token_to_code words it
        return torch.from_numpy(codes)

    def _slot_starts(self, length: int) -> np.ndarray:
        """Each position's first token id (slot by slot, frame after frame) for at least ``length``
        positions from a frame's start; kept and grown by doubling."""
        starts = self.__dict__.get("_starts")
        if starts is None or starts.shape[0] < length:
            size = max(length, 2 * (0 if starts is None else starts.shape[0]), 64 * self.tokens_per_frame)
            slots = np.arange(size, dtype=np.int64) % self.tokens_per_frame
            starts = self.__dict__["_starts"] = self.audio_token_base + slots * self.codebook_size
        return starts

    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        """Inverse of tokens_to_codes."""
        return [self.token_range(first_position + i)[0] + int(c) for i, c in enumerate(codes)]


#: SNAC decodes 28 tokens (4 frames) first for early audio, then larger chunks that cost less per token.
STREAMING = {"chunk_size": [28, 56, 112]}

register_family(Family(
    "orpheus", make_layout=lambda model_dir, tokenizer, options: OrpheusLayout(),
    voices=tuple(VoiceInfo(v, f"Orpheus preset voice {v}") for v in ORPHEUS_VOICES), default_voice=ORPHEUS_VOICES[0],
    # The English fine-tunes; a manifest's languages names another's.
    languages=("en",), streaming=STREAMING))

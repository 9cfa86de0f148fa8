"""The "phoneme-lpc-frame" layout: the built-in voice with one LM position, and one backbone
pass, per 20 ms frame (phoneme-lpc has four positions and two passes).

Ids, prompt and decoder frames are phoneme-lpc's (audio_pipeline/layouts/phoneme_lpc.py): the same
vocabulary, the same ``[phoneme, duration]`` prompt (or, with ``layout_options.prompt: folded``,
one position per phoneme whose id stands for both), and 4-code frames ``[phoneme, context,
envelope, prosody]`` for the same vocoders. What changes is what a position holds:

* generated position k samples frame k's envelope (its token id, from the backbone) and prosody
  (from the depth head, given the envelope: audio_pipeline/models/frame_head.py);
* its frame carries, besides those two, the phoneme and context of frame k + 1 (from the
  alignment, so known before the pass): they are the position's input, which is how the
  backbone knows the phoneme of the frame it predicts next. The prompt's last position
  (start of speech) carries frame 0's. After the last frame they are -1 (none);
* the decoder reads a frame's envelope and prosody only (it ignores the alignment columns), so
  it takes the frames as they are.

The end of speech is forced at position ``frames`` as in phoneme-lpc. Per second of audio: 50
positions and 50 backbone passes (phoneme-lpc: 200 and 100).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, Sequence

import numpy as np
import torch

from audio_pipeline.layouts.base import Alignment
from audio_pipeline.layouts.phoneme_lpc import (CODEBOOK_SIZE, CONTEXT, END_OF_SPEECH, ENVELOPE, PHONEME,
                                              PROSODY, SHARED_OPTIONS, TOKENS_PER_FRAME, US_ENGLISH,
                                              PhonemeLPCLayout,
                                              alignment_tokens, layout_factory, prompt_schedule, slot_token,
                                              split_prompt)
from audio_pipeline.layouts.registry import Family, register_family

#: Frame columns (the decoder's order).
COLUMNS = TOKENS_PER_FRAME


def frame_head_config() -> dict:
    """The ``frame_head`` of a phoneme-lpc-frame model's config.json (models/frame_head.py), but
    its size: each column's codebook is its slot's ids."""
    return {"code_offsets": [slot_token(slot, 0) for slot in range(COLUMNS)], "codebook_size": CODEBOOK_SIZE,
            "token_column": ENVELOPE, "depth_column": PROSODY}


class FrameAlignment(Alignment):
    """One request's alignment: the end of speech after its frames, and each frame's phoneme and
    context codes for the frame columns of the position before it. ``edge_pause_frames``: (the
    leading, the trailing) pause frames it speaks."""

    def __init__(self, frames: list[tuple[int, int]], edge_pause_frames: tuple[int, int] = (0, 0)):
        self.frames = frames
        self.edge_pause_frames = edge_pause_frames

    @property
    def tokens(self) -> int:
        """Generated tokens the request makes, end of speech not counted: one per frame."""
        return len(self.frames)

    def forced(self, position: int) -> int | None:
        return END_OF_SPEECH if position == len(self.frames) else None

    def lone_forced(self) -> tuple[int, int]:
        return len(self.frames), END_OF_SPEECH

    def frame_code_table(self) -> np.ndarray:
        """Row p: :meth:`frame_codes` (p), for p up to the end of speech's position."""
        table = np.full((len(self.frames) + 1, COLUMNS), -1, dtype=np.int64)
        if len(self.frames) > 1:  # (fromiter: half the time of asarray over a list of pairs)
            following = np.fromiter(chain.from_iterable(self.frames[1:]), dtype=np.int64,
                                    count=2 * (len(self.frames) - 1)).reshape(-1, 2)
            table[:len(self.frames) - 1, PHONEME] = following[:, 0] - slot_token(PHONEME, 0)
            table[:len(self.frames) - 1, CONTEXT] = following[:, 1] - slot_token(CONTEXT, 0)
        return table

    def frame_codes(self, position: int) -> list[int]:
        """The codes of generated position ``position``'s frame that the alignment fixes (the next
        frame's phoneme and context), -1 in the columns that are sampled or empty."""
        codes = [-1] * COLUMNS
        if position + 1 < len(self.frames):
            phoneme, context = self.frames[position + 1]
            codes[PHONEME] = phoneme - slot_token(PHONEME, 0)
            codes[CONTEXT] = context - slot_token(CONTEXT, 0)
        return codes


@dataclass(frozen=True)
class PhonemeLPCFrameLayout(PhonemeLPCLayout):
    tokens_per_frame: int = 1
    codes_per_token: ClassVar[int] = COLUMNS
    #: The sampled id is the frame's envelope code.
    token_column: ClassVar[int] = ENVELOPE

    def alignment(self, prompt: Sequence[int]) -> FrameAlignment:
        frames, _, edges = self._spoken_frames(prompt)
        return FrameAlignment(frames, edges)

    def _silence_ids(self, phonemes: Sequence[tuple[int, int]], count: int) -> list[int]:
        """One position per frame handed to the model: its envelope id (the frame is in prompt_frames)."""
        return [slot_token(ENVELOPE, (self.silence_frame or (0, 0))[0])] * count

    def prompt_frames(self, prompt_ids: Sequence[int], reference=None) -> torch.Tensor:
        """-1 rows, but for the start of speech (frame 0's phoneme and context) and the leading
        pause's frames the prompt holds (each with the next frame's phoneme and context, and the
        silence frame's codes)."""
        head, given = split_prompt(prompt_ids)
        frames = torch.full((len(prompt_ids), COLUMNS), -1, dtype=torch.long)
        # These frames' codes depend on the opening pause and the two phonemes after it alone (the
        # last one handed over carries the first phoneme's frame and context): not the whole
        # alignment, which the request's preparation builds once already.
        alignment = FrameAlignment(alignment_tokens(prompt_schedule(head)[:3]))
        envelope, prosody = self.silence_frame or (0, 0)
        for k in range(len(given) + 1):  # start of speech is position -1 of the alignment
            codes = alignment.frame_codes(k - 1)
            if k:
                codes[ENVELOPE], codes[PROSODY] = envelope, prosody
            frames[len(head) - 1 + k] = torch.tensor(codes)
        return frames

    def check_model(self, model) -> None:
        """A folded prompt needs a model whose frame head folds (its pair ids, FOLD_BASE on); a
        model that folds needs the folded prompt it was trained on."""
        from audio_pipeline.layouts.phoneme_lpc import FOLD_BASE

        base = getattr(model.model, "fold_base", None)  # a frame Llama's; None for other modules
        if self.folded_prompt and base != FOLD_BASE:
            raise ValueError("audio_pipeline.json: layout_options.prompt is folded, but config.json's frame_head has no "
                             f"fold at {FOLD_BASE} (a model trained on folded prompts has)")
        if not self.folded_prompt and base is not None:
            raise ValueError("config.json: frame_head has a fold (the model was trained on folded prompts), but "
                             "audio_pipeline.json's layout_options.prompt is not folded")

    def token_range(self, position: int) -> tuple[int, int]:
        """Every position samples an envelope id."""
        start = slot_token(ENVELOPE, 0)
        return start, start + CODEBOOK_SIZE



register_family(Family("phoneme-lpc-frame", make_layout=layout_factory(PhonemeLPCFrameLayout),
                       plain_checkpoint=True, languages=US_ENGLISH,
                       layout_options={"prompt": "pairs (two positions per phoneme, the default) or folded (one: "
                                                 "the model's frame_head has a fold)", **SHARED_OPTIONS}))

"""What every speech-token layout says about its frames; the engine, scheduler and sampler read
only this (and the layout's token ranges), never the family.

* ``tokens_per_frame``: LM positions (sampled tokens, KV cache positions) per audio frame;
* ``codes_per_token``: audio codes one position carries. 1 where a frame is sampled one token per
  backbone pass (Orpheus, Maya1, NeuTTS, phoneme-lpc); more where one backbone pass samples the
  frame's first code and a depth decoder the rest of it (CSM). Then a position's input is the sum
  of its frame's codebook embeddings, and the frame travels beside the token (the context's
  ``frames``);
  ``token_column`` is the frame column whose code is the position's token id (the code the
  backbone samples; the depth decoder samples others, and the layout may fix some from its
  alignment: ``alignment.frame_codes``);
* ``stops_by_token``: a sampled end-of-speech id ends the speech (a candidate on frame boundaries);
  False where the frame's codes say it (``ends_speech``);
* its prompt format (``build_prompt``, and ``prompt_frames`` where prompt positions are audio
  frames) and its decoder (``check_decoder``; the decoder takes ``codes_per_frame`` codes a frame).
"""

from __future__ import annotations

from typing import ClassVar, Sequence


class FrameRules:
    """Defaults for layouts that sample one token per backbone pass and end on a stop id."""

    tokens_per_frame: int
    codes_per_token: ClassVar[int] = 1
    token_column: ClassVar[int] = 0
    stops_by_token: ClassVar[bool] = True

    @property
    def codes_per_frame(self) -> int:
        """Audio codes per frame: what the decoder takes per frame."""
        return self.tokens_per_frame * self.codes_per_token

    def ends_speech(self, frame: Sequence[int]) -> bool:
        """Whether a depth-sampled frame (``codes_per_token`` codes) ends the speech."""
        return False

    def prompt_frames(self, prompt_ids: Sequence[int], reference=None):
        """[len(prompt_ids), codes_per_token] codes of the prompt positions that are audio frames
        (-1 rows for text), or None where every prompt position is a token."""
        return None

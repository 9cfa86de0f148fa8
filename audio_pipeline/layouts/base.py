"""What every speech-token layout provides: a model family's frames, token maps and prompts.

The engine, the request's preparation, the scheduler and the sampler read only these attributes
(and never probe a layout for one, or ask which family it is). A family declares its layout and
the rest of what it needs in one record (``layouts/registry.py``).

Frames
    * ``tokens_per_frame``: LM positions (sampled tokens, KV cache positions) per audio frame;
    * ``codes_per_token``: audio codes one position carries. 1 where a frame is sampled one token
      per backbone pass (Orpheus, Maya1, NeuTTS, phoneme-lpc); more where one backbone pass samples
      the frame's first code and a depth decoder the rest of it (CSM, the frame voice). Then a
      position's input is the sum of its frame's codebook embeddings, and the frame travels beside
      the token (the request's ``frames``);
    * ``token_column``: the frame column whose code is the position's token id (the code the
      backbone samples; the depth decoder samples the others, and the layout may fix some from its
      alignment: ``alignment.frame_codes``);
    * ``stops_by_token``: a sampled end-of-speech id ends the speech (a candidate on frame
      boundaries); False where the frame's codes say it (``ends_speech``).
Token maps
    ``codebook_size``, ``end_of_speech``, ``min_vocab_size``, ``token_range(position)``,
    ``token_to_code``, ``tokens_to_codes``, ``codes_to_tokens``.
Prompts
    ``build_prompt(tokenizer, text, voice, reference, speed)``, and ``prompt_frames`` where prompt
    positions are audio frames.
Optional capabilities (the defaults here say "not this family")
    ``requires_reference`` (every request speaks as a reference recording), ``described_voices``
    (a voice is a description in words), ``takes_instructions`` (``build_prompt`` takes a request's
    ``instructions``, a style, beside its voice), ``takes_language`` (``build_prompt`` takes a
    request's ``language``, one of the model's languages as it declares them, or ``auto``),
    ``spoken_languages()`` (a checkpoint that lists its languages: they, not the family's
    declaration, are what a request may name), ``supports_speed``
    (a request may set a speed), ``clonable`` (False: a reference recording gives no voice),
    ``takes_pronunciations`` (``build_prompt`` and ``word_frames``
    take ``overrides``: words' phonemes, audio_pipeline/text/lexicon.py's Overrides),
    ``has_text_track`` with ``text_track(prompt)`` (a text token beside every position, and raw
    input vectors: core/tracks.py), ``text_stream`` with ``text_rule(text, prompt)`` (the backbone
    samples a text stream: a request's rule turns each sampled id into the position's token before
    the depth decoder samples every audio code of the frame, over ``audio_codebook_size``; the
    audio is ``audio_codes`` of the frames, the first ``lead_in_frames`` of it decoded but not
    heard; Kyutai TTS), ``alignment(prompt)`` (tokens fixed by the prompt alone),
    ``word_frames(text, speed)`` (the
    frames each spoken word sounds in), ``check_decoder(decoder)`` (ValueError for a decoder that
    does not speak its codes), ``check_model(model)`` (ValueError for a model that does not take
    its prompts).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch

from audio_pipeline.errors import InvalidArgument


class Alignment:
    """The tokens a request's prompt alone fixes (a layout's ``alignment(prompt)``), and what the
    engine reads of them. Declared here with their defaults, so nothing probes an alignment."""

    #: Frames of pause the speech opens and ends with (the built-in voices know them).
    edge_pause_frames: tuple[int, int] = (0, 0)

    @property
    def tokens(self) -> int:
        """Generated tokens the request makes, end of speech not counted."""
        raise NotImplementedError

    def forced(self, position: int) -> int | None:
        """The id generated token ``position`` must be, or None where the model chooses."""
        raise NotImplementedError

    def frame_codes(self, position: int) -> list[int] | None:
        """The codes of generated position ``position``'s frame the alignment fixes (-1 where the
        depth decoder samples), for a layout whose positions are frames; None: it fixes none."""
        return None

    def lone_forced(self) -> tuple[int, int] | None:
        """(position, id) where :meth:`forced` fixes one position alone (a frame layout's end of
        speech): the engine's row table keeps it and asks nothing row by row. None: it fixes more
        (or none it can name this way), and the engine asks :meth:`forced` for each row."""
        return None

    def frame_code_table(self) -> np.ndarray | None:
        """:meth:`frame_codes` of every generated position that has some, as one [positions, codes]
        int64 array (later positions fix none), for the row table to gather; None where
        :meth:`frame_codes` is None everywhere."""
        return None


class Layout:
    """The base of every layout: what a family must define, and the defaults of what it may."""

    tokens_per_frame: int
    codebook_size: int
    end_of_speech: int
    codes_per_token: ClassVar[int] = 1
    token_column: ClassVar[int] = 0
    stops_by_token: ClassVar[bool] = True
    requires_reference: ClassVar[bool] = False
    described_voices: ClassVar[bool] = False
    supports_speed: ClassVar[bool] = False
    has_text_track: ClassVar[bool] = False
    takes_instructions: ClassVar[bool] = False
    takes_language: ClassVar[bool] = False
    takes_pronunciations: ClassVar[bool] = False
    #: A reference recording can give a voice (the prompt takes a cloned voice's frames).
    clonable: ClassVar[bool] = True
    #: The backbone samples a text stream (see the module docstring): ``text_rule``.
    text_stream: ClassVar[bool] = False
    #: Audio frames decoded at the start of the speech but not heard.
    lead_in_frames: ClassVar[int] = 0
    #: One request speaks a dialogue in two voices, the request's and one other, its turns marked
    #: in its text (``build_prompt``'s ``other_voice``; ``text_rule``'s speakers).
    speaker_turns: ClassVar[bool] = False

    @property
    def audio_codebook_size(self) -> int:
        """Codes per codebook the depth decoder samples (a text stream's backbone samples text ids)."""
        return self.codebook_size

    @property
    def draws_per_position(self) -> int:
        """Uniform draws a sampled position takes: the backbone's, then one per code the depth
        decoder samples (all of a text stream's frame; all but the backbone's code otherwise)."""
        return self.codes_per_token + 1 if self.text_stream else self.codes_per_token

    def pause_words(self, seconds: float) -> list:
        """A text stream's words for a pause of ``seconds`` (an SSML <break>) that its model keeps."""
        raise NotImplementedError

    def speech_frames(self, words: Sequence) -> int:
        """The most positions a text stream's request takes to read ``words`` (its rule's words)."""
        raise NotImplementedError

    @property
    def frames_beyond_words(self) -> int:
        """The positions a text stream's request takes besides its words' (at its start and end)."""
        raise NotImplementedError

    def preset_name(self, voice: str | None) -> str | None:
        """The preset voice another spelling of a voice's name means (a family whose presets have
        several names), else the name as given."""
        return voice

    def text_rule(self, text: str, prompt: Sequence[int], *, speaker: int = 0, after: int | None = None,
                  written: Callable[[int, int], tuple[int, int]] | None = None):
        """The rule turning a request's sampled text ids into its tokens, where ``text_stream``:
        ``text`` said by ``speaker`` (0 the request's voice, 1 the other voice of a dialogue where
        ``speaker_turns``), after words of speaker ``after`` (a streamed text's later pieces; None:
        the text is the first). ``written(start, end)``: where ``text[start:end]`` was written (a
        normalized text's source), for each word's place."""
        return None

    def audio_frame_count(self, sampled: int, end_step: int | None) -> int:
        """A text stream's audio frames whose codes are sampled after ``sampled`` positions."""
        raise NotImplementedError

    def audio_codes(self, frames: Sequence[Sequence[int]], start: int, end: int) -> torch.Tensor:
        """A text stream's frame-major codes of audio frames [start, end) from its positions' frames."""
        raise NotImplementedError

    @property
    def acts_on_instructions(self) -> bool:
        """Whether a request's ``instructions`` act: a described voice's description, or a style
        beside a preset voice."""
        return self.described_voices or self.takes_instructions

    @property
    def codes_per_frame(self) -> int:
        """Audio codes per frame: what the decoder takes per frame."""
        return self.tokens_per_frame * self.codes_per_token

    @property
    def min_vocab_size(self) -> int:
        """Smallest LM vocabulary that holds every id the layout samples or prompts with."""
        raise NotImplementedError

    # --- prompts ---------------------------------------------------------------------------------

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0) -> list[int]:
        """The LM prompt ids for ``text`` in ``voice`` (or as ``reference``: a cloned voice's
        ``.transcript`` and frame-major ``.codes``), at ``speed`` where ``supports_speed``."""
        raise NotImplementedError

    def reference_frames(self, reference) -> torch.Tensor:
        """A cloned voice's frame-major codes as [frames, codes_per_token] (layouts whose positions
        are frames); InvalidArgument naming ``reference`` unless they are whole frames."""
        codes = torch.as_tensor(reference.codes, dtype=torch.long).reshape(-1)
        if codes.numel() == 0 or codes.numel() % self.codes_per_token:
            raise InvalidArgument(f"the reference's codes ({codes.numel()}) are not whole frames of "
                                  f"{self.codes_per_token} codebooks", field="reference")
        return codes.view(-1, self.codes_per_token)

    def prompt_frames(self, prompt_ids: Sequence[int], reference=None):
        """[len(prompt_ids), codes_per_token] codes of the prompt positions that are audio frames
        (-1 rows for text), or None where every prompt position is a token."""
        return None

    def alignment(self, prompt: Sequence[int]) -> Alignment | None:
        """The tokens the prompt alone fixes (an :class:`Alignment`), or None where the model
        chooses every token."""
        return None

    def word_frames(self, text: str, speed: float = 1.0) -> list | None:
        """The spoken words of ``text`` with the frames each sounds in, or None where the layout
        does not know (then each segment gets one timing)."""
        return None

    def text_track(self, prompt: Sequence[int]) -> Any:
        """The text track that travels beside ``prompt`` (layouts/text_track.py's TextTrack: a text id per
        position, raw vectors), where ``has_text_track``; None otherwise."""
        return None

    def spoken_languages(self) -> tuple[str, ...] | None:
        """The languages the checkpoint says it speaks, as ``build_prompt`` takes them; None: the
        family's declaration (layouts/registry.py's ``Family.languages``)."""
        return None

    def check_decoder(self, decoder) -> None:
        """ValueError unless ``decoder`` speaks this layout's codes (beyond its frame size, which
        the engine checks)."""

    def check_model(self, model) -> None:
        """ValueError unless ``model`` (the pipeline model) takes the prompts this layout builds."""

    # --- frames and tokens -----------------------------------------------------------------------

    def ends_speech(self, frame: Sequence[int]) -> bool:
        """Whether a depth-sampled frame (``codes_per_token`` codes) ends the speech."""
        return False

    def token_range(self, position: int) -> tuple[int, int]:
        """Half-open range of the speech-token ids valid at ``position`` of a frame."""
        raise NotImplementedError

    def token_to_code(self, token_id: int, position: int) -> int:
        raise NotImplementedError

    def tokens_to_codes(self, token_ids: Sequence[int], first_position: int = 0):
        raise NotImplementedError

    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        raise NotImplementedError

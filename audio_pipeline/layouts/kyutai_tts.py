"""The Kyutai TTS layout (delayed streams modeling): one position per 80 ms frame; the backbone
samples a text id, the request's text rule (layouts/dsm_text.py) turns it into the text fed back,
and the depth transformer samples all the frame's audio codes from it.

Positions
    The prompt is one position, the start of the streams (the model reads start ids there, whatever
    the ids staged); its id names the request's condition (its voice and guidance), which the text
    track carries to every position (the model reads its summed conditions and its voice's
    cross-attention by it). Generated position t holds the text id fed back at frame t (the
    position's token) and the codes sampled at frame t (its frame): codebook k's code of audio frame
    t - delay_k (the acoustic codebooks lag the semantic one); position t + 1 reads them.

Audio
    Frame f of the audio is codebook k's code from frame f + delay_k. The audio starts with frame
    ``audio_delay_steps`` (the text leads the audio by that much); its first two frames are decoded
    but not heard (``lead_in_frames``), and it ends two frames after the one where the model asked
    past the last word. A request stops once the frames that audio needs are sampled.

Voices
    The checkpoint's ``voices/`` folder (checkpoints/kyutai_tts_config.py): each file a preset,
    named by its path without ``.wav.<sig>@<epoch>.safetensors``; the bare file name and the
    ``.wav`` form name it too. A recording cannot give a voice (the voice encoder is not public).

Dialogues
    A model that knows several speakers (``multi_speaker``) takes two voices in one condition, the
    main speaker's (the request's voice) and the other's, and reads whose turn it is from the text:
    the first word of a turn carries its speaker's token (the service makes turns of SSML <voice>).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import torch

from audio_pipeline.checkpoints.kyutai_tts_config import (FRAME_RATE, DsmConfig, generation_options,
                                                          is_kyutai_tts_config, read_dsm_config, voice_files)
from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.base import Layout
from audio_pipeline.layouts.dsm_text import TextMachine, TextRule, Word, script_words
from audio_pipeline.layouts.registry import Family, register_family
from audio_pipeline.layouts.text_track import TextTrack
from audio_pipeline.layouts.voice_info import VoiceInfo

#: The reference's generation settings: padding the speech opens with, the most frames of padding
#: in a row, frames forced after each word beyond its tokens.
INITIAL_PADDING, MAX_PADDING, PADDING_BETWEEN = 2, 8, 1
#: Audio frames decoded before the heard audio starts (the reference drops them: a click).
LEAD_IN_FRAMES = 2


@dataclass(frozen=True, kw_only=True)
class KyutaiLayout(Layout):
    #: The backbone's candidates: the text vocabulary.
    codebook_size: int
    #: The depth transformer's: the audio codebook.
    audio_card: int
    codes_per_token: int
    tokens_per_frame: int = 1
    end_of_speech: int = -1
    text_card: int
    delays: tuple[int, ...]
    audio_delay_steps: int
    second_stream_ahead: int
    multi_speaker: bool
    voice_names: tuple[str, ...]
    #: Guidance values a distilled model takes as a condition (empty: none).
    cfg_values: tuple[float, ...]
    cfg_coef: float
    sentencepiece: object = None
    stops_by_token: ClassVar[bool] = False
    has_text_track: ClassVar[bool] = True
    clonable: ClassVar[bool] = False
    text_stream: ClassVar[bool] = True
    lead_in_frames: ClassVar[int] = LEAD_IN_FRAMES

    @classmethod
    def from_checkpoint(cls, model_dir: Path, tokenizer, options) -> "KyutaiLayout":
        config = read_dsm_config(model_dir)
        chosen = generation_options(model_dir, config, dict(options))
        cfg = chosen.cfg_coef
        return cls(codebook_size=config.text_card, audio_card=config.card, codes_per_token=chosen.n_q,
                   text_card=config.text_card, delays=config.delays, audio_delay_steps=config.audio_delay_steps,
                   second_stream_ahead=config.second_stream_ahead, multi_speaker=config.multi_speaker,
                   voice_names=tuple(name for name, _ in voice_files(model_dir, config)),
                   cfg_values=config.cfg_values, cfg_coef=cfg,
                   sentencepiece=tokenizer)

    @property
    def audio_codebook_size(self) -> int:
        return self.audio_card

    # --- conditions and prompts ------------------------------------------------------------------

    @property
    def condition_choices(self) -> int:
        """Guidance values a condition id distinguishes: each distilled value, then none."""
        return len(self.cfg_values) + 1

    @property
    def speaker_turns(self) -> bool:
        """A model that knows several speakers speaks dialogues: the main speaker in the request's
        voice, the other in a second voice, each turn marked by its speaker's token."""
        return self.multi_speaker

    def condition_id(self, voice: str | None, other_voice: str | None = None) -> int:
        """The id of a request's condition: its voice's index, its dialogue's other voice's (plus
        one; 0: none) and the guidance value's: ``((other + 1) * voices + voice) * choices + cfg``."""
        index = self.voice_index(voice)
        other = self.voice_index(other_voice, field="text") + 1 if other_voice else 0
        cfg = self.cfg_values.index(self.cfg_coef) if self.cfg_coef in self.cfg_values else len(self.cfg_values)
        return (other * len(self.voice_names) + index) * self.condition_choices + cfg

    def preset_name(self, voice: str | None) -> str | None:
        """A voice's path below voices/ (as listed), for its path, its file name, or either with ``.wav``."""
        if not voice:
            return voice
        name = voice.removesuffix(".wav")
        if name in self.voice_names:
            return name
        matches = [known for known in self.voice_names if known.rsplit("/", 1)[-1] == name]
        return matches[0] if len(matches) == 1 else voice

    def voice_index(self, voice: str | None, field: str = "voice") -> int:
        if not self.voice_names:
            raise InvalidArgument("this model has no voices (its checkpoint's voices/ folder is empty)", field=field)
        if not voice:
            return 0
        name = self.preset_name(voice)
        if name in self.voice_names:
            return self.voice_names.index(name)
        shown = ", ".join(self.voice_names[:5]) + (" ..." if len(self.voice_names) > 5 else "")
        raise InvalidArgument(f"unknown voice {voice[:80]!r} (this model's voices: {shown})", field=field)

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0,
                     other_voice: str | None = None) -> list[int]:
        """The one prompt position: the condition of ``voice`` (and a dialogue's ``other_voice``)."""
        if reference is not None:
            raise InvalidArgument("this model speaks its preset voices only and cannot clone a recording",
                                  field="reference")
        return [self.condition_id(voice, other_voice)]

    def text_track(self, prompt: Sequence[int]) -> TextTrack:
        """The request's condition id at every position."""
        return TextTrack(prompt=[prompt[0]], generated=[], pad=prompt[0])

    def words(self, text: str, *, speaker: int = 0, after: int | None = None) -> list[Word]:
        """``text``'s words said by ``speaker`` after words of speaker ``after`` (None: none)."""
        return script_words(self.sentencepiece.encode, [text], frame_rate=FRAME_RATE,
                            multi_speaker=self.multi_speaker, padding_between=PADDING_BETWEEN,
                            first_speaker=speaker, last_speaker=after)

    def pause_words(self, seconds: float) -> list[Word]:
        """A pause the model keeps: padding for ``seconds`` (the reference's <break time="...">)."""
        frames = int(round(seconds * FRAME_RATE))
        return [Word((), "", frames)] if frames > 0 else []

    def speech_frames(self, words: Sequence[Word]) -> int:
        """At most the frames from taking each word to taking the next (the rule forces a new word
        after MAX_PADDING frames of padding, and pads while a word's tokens and forced padding last)."""
        return sum(max(MAX_PADDING, len(word.tokens)) + word.padding + 1 for word in words)

    @property
    def frames_beyond_words(self) -> int:
        """The opening padding, and the frames after the model asks past its last word."""
        return INITIAL_PADDING + self.frames_after_end + 1

    def text_rule(self, text: str, prompt: Sequence[int], *, speaker: int = 0, after: int | None = None,
                  written: Callable[[int, int], tuple[int, int]] | None = None) -> TextRule:
        machine = TextMachine(self.text_card, self.second_stream_ahead, MAX_PADDING, INITIAL_PADDING)
        words = self.words(text, speaker=speaker, after=after)
        if written is not None:  # each word's place where it was written
            words = [dataclasses.replace(word, at=written(*word.at)) if word.at else word for word in words]
        return TextRule(machine, machine.new_state(words))

    @property
    def min_vocab_size(self) -> int:
        return self.codebook_size

    # --- frames, codes and the audio ----------------------------------------------------------------

    @property
    def frames_after_end(self) -> int:
        """Frames a request samples after the one where the model asked past its last word."""
        return self.audio_delay_steps + LEAD_IN_FRAMES + max(self.delays)

    def audio_frame_count(self, sampled: int, end_step: int | None) -> int:
        """Audio frames (lead-in included) whose codes are all sampled after ``sampled`` frames."""
        ready = max(0, sampled - max(self.delays) - self.audio_delay_steps)
        return ready if end_step is None else min(ready, end_step + LEAD_IN_FRAMES)

    def audio_codes(self, frames: Sequence[Sequence[int]], start: int, end: int) -> torch.Tensor:
        """The codes of audio frames [start, end), frame-major (frame f: codebook k's code from the
        frame sampled at audio_delay_steps + f + delay_k)."""
        base = self.audio_delay_steps
        rows = [[frames[base + f + self.delays[k + 1]][k] for k in range(self.codes_per_token)]
                for f in range(start, end)]
        return torch.tensor(rows, dtype=torch.long).reshape(-1)

    def check_decoder(self, decoder) -> None:
        if decoder.codebook_size < self.audio_card:
            raise ValueError(f"audio_decoder: {decoder.name!r} has {decoder.codebook_size} codes per codebook; "
                             f"the model samples {self.audio_card}")

    def token_range(self, position: int) -> tuple[int, int]:
        return 0, self.codebook_size

    def token_to_code(self, token_id: int, position: int) -> int:
        return token_id

    def tokens_to_codes(self, token_ids: Sequence[int], first_position: int = 0):
        return list(token_ids)

    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        return list(codes)


def _tokenizer(model_dir: Path):
    import sentencepiece

    config: DsmConfig = read_dsm_config(model_dir)
    path = Path(model_dir) / config.tokenizer_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} (config.json tokenizer_name) is missing")
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


def _make_layout(model_dir: Path, tokenizer, options) -> KyutaiLayout:
    return KyutaiLayout.from_checkpoint(Path(model_dir), tokenizer or _tokenizer(model_dir), options)


def _preset_voices(model_dir: Path) -> tuple[VoiceInfo, ...]:
    config = read_dsm_config(model_dir)
    return tuple(VoiceInfo(name, f"Kyutai TTS voice {name}", "en") for name, _ in voice_files(model_dir, config))


register_family(Family(
    "kyutai-tts", make_layout=_make_layout, detect=lambda config, model_dir: is_kyutai_tts_config(config),
    preset_voices=_preset_voices, tokenizer=_tokenizer,
    # Mimi, as the checkpoint stores it (decoders/mimi_moshi.py): the model directory names its file.
    decoder="mimi", decoder_weights=".", languages=("en", "fr"),
    # Mimi keeps its streaming state: each chunk is decoded as it comes, the first after three
    # frames (two of them the lead-in), then four and eight (counted in codes: 32 a frame at most).
    streaming={"chunk_size": [96, 128, 256], "block_causal": True},
    # The reference's sampling: temperature 0.6; the text's 25 likeliest ids (its audio codes' 250:
    # models/kyutai_tts_model.py), no repetition penalty.
    sampling={"temperature": 0.6, "top_k": 25, "top_p": 1.0, "repetition_penalty": 1.0},
    layout_options={"cfg_coef": "the guidance coefficient (default 2.0: a value a distilled model was distilled for; "
                                "a model that was not is guided with a doubled batch, 1.0 turning it off)",
                    "padding_bonus": "added to the text's padding logit (above 0: slower speech; default 0)",
                    "n_q": "the codebooks generated (fewer than the model's: faster, coarser audio; default all)",
                    "kept_conditions": "conditions (a voice, or a dialogue's two, with a guidance value) the model keeps "
                                       "computed: each holds the voices' cross-attention keys and values for every "
                                       "layer, tens of MB at the published shape (default 16; the least recently "
                                       "used goes first)"}))

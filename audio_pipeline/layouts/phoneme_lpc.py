"""The "phoneme-lpc" speech-token layout of the built-in voice: phonemes with durations in, LPC
vocoder frames out, with an explicit, monotonic alignment that the engine enforces.

Ids (vocabulary of 4608):
    0 pad, 1 begin, 2 end of speech, 3 start of speech, 4 end-of-phonemes marker, 5-7 unused,
    8 + p                  phoneme p of the model's inventory (the tokenizer's ``<ph:NAME>`` tokens),
    256 + 1024 * s + v     value v of frame slot s (0 phoneme, 1 context, 2 envelope, 3 prosody),
    4352 + d               a duration of d + 1 frames (prompt only).

Prompt: ``begin``, then for each phoneme of the text ``[phoneme, duration]`` (its frames at 50 Hz,
from the eSpeak NG front-end), then ``end-of-phonemes`` and ``start of speech``.

Each generated frame is ``[phoneme p, context, envelope, prosody]``: p is the phoneme sounding in
this frame, context = ``next * 4 + min(left, 3)`` with ``next`` the phoneme that follows (or
:data:`NO_NEXT` after the last) and ``left`` the frames p still has after this one. After the last
frame of the last phoneme comes end of speech. The first two tokens of every frame (and the end)
follow from the prompt alone: :meth:`PhonemeLPCLayout.alignment` computes them, and the engine
forces them, so the model cannot skip, repeat or stretch a word; what it predicts is the
acoustics of each frame given the phoneme, what comes next, and its own history.

Edge pauses: the front end opens and closes every utterance with a pause of 100-200 ms (its
teacher's recordings do), which a listener hears as silence before the first word and after the
last. The prompt keeps them, as the model learned, but only :data:`LEAD_PAUSE_FRAMES` of the
leading pause are spoken: the frames before those are handed to the model as prompt positions
holding the voice's ``silence_frame`` (its manifest's ``layout_options``), so generation and audio
start that close to the first phoneme; and the alignment ends the speech
:data:`TAIL_PAUSE_FRAMES` frames into the trailing pause. A prompt is then ``... end-of-phonemes,
start of speech`` followed by those frames' ids (one per frame in phoneme-lpc-frame, four here).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from audio_pipeline.layouts.base import Alignment as LayoutAlignment, Layout
from audio_pipeline.layouts.registry import Family, register_family

logger = logging.getLogger(__name__)

#: Each tokenizer's vocabulary (and its size when read), built once: building it took a third of
#: preparing a request (0.7 of 2.2 ms), and 64 prompts arriving at once are prepared one by one.
_VOCABULARIES: "weakref.WeakKeyDictionary[Any, tuple[int, dict[str, int]]]" = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer) -> dict[str, int]:
    """``tokenizer.get_vocab()``, read again only when the tokenizer's size changed."""
    size = len(tokenizer)
    try:
        known = _VOCABULARIES.get(tokenizer)
    except TypeError:  # a tokenizer that takes no weak reference
        return tokenizer.get_vocab()
    if known is None or known[0] != size:
        known = _VOCABULARIES[tokenizer] = (size, tokenizer.get_vocab())
    return known[1]

PAD, BEGIN, END_OF_SPEECH, START_OF_SPEECH, END_OF_PHONEMES = 0, 1, 2, 3, 4
PHONEME_BASE = 8
MAX_PHONEMES = 248
SLOT_BASE = PHONEME_BASE + MAX_PHONEMES  # 256
CODEBOOK_SIZE = 1024
TOKENS_PER_FRAME = 4
PHONEME, CONTEXT, ENVELOPE, PROSODY = range(TOKENS_PER_FRAME)
#: The context slot's "next phoneme" after the last phoneme.
NO_NEXT = MAX_PHONEMES
#: The context slot's frames-left values: 0, 1, 2 and "3 or more".
LEFT_LEVELS = 4
DURATION_BASE = SLOT_BASE + TOKENS_PER_FRAME * CODEBOOK_SIZE  # 4352
#: Longest phoneme a prompt holds, in frames (5.12 s); longer ones (pauses) are cut to it.
MAX_DURATION = 256
VOCAB_SIZE = DURATION_BASE + MAX_DURATION
FRAME_RATE = 50
#: Phonemes one prompt may hold.
MAX_PROMPT_PHONEMES = 1000
#: Frames of an utterance's leading and trailing pause that are spoken: a natural onset and end
#: (20 ms before the first phoneme, none before a QUIET_ONSETS one; 20 ms after the last), where
#: the front end's pauses are 100-200 ms. The speech of the frames in between is as with the whole pauses spoken (the model
#: reads the same pause durations in its prompt, and the handed-over frames are silence).
LEAD_PAUSE_FRAMES = 1
TAIL_PAUSE_FRAMES = 1
#: The front ends' pause phonemes (the lexicon's, eSpeak NG's short and long).
PAUSE_NAMES = ("pau", "_", "_:")
#: Phonemes whose sound starts softly (a stop's silent closure, a fricative's noise): an utterance
#: that opens with one needs no pause frame before it for a natural onset, where one that opens
#: with a vowel, nasal, liquid or glide would start its first sample at speech level (a click).
QUIET_ONSETS = ("p", "t", "k", "b", "d", "g", "f", "th", "s", "sh", "hh", "ch", "jh", "v", "dh", "z", "zh")
#: A folded prompt (phoneme-lpc-frame's ``layout_options.prompt: folded``) gives each phoneme one
#: position whose id stands for the pair: FOLD_BASE + (phoneme - PHONEME_BASE) * MAX_DURATION +
#: frames - 1. Such ids are inputs only (never sampled): the model embeds one as the sum of its
#: phoneme's and its duration's embeddings (models/frame_head.py ``fold``), so a prompt is half as
#: long and its prefill half the work.
FOLD_BASE = VOCAB_SIZE

SPECIAL_TOKENS = {PAD: "<pad>", BEGIN: "<begin>", END_OF_SPEECH: "<end_of_speech>",
                  START_OF_SPEECH: "<start_of_speech>", END_OF_PHONEMES: "<end_of_phonemes>"}
SLOT_NAMES = ("ph", "ctx", "env", "pros")


def slot_token(slot: int, value: int) -> int:
    return SLOT_BASE + slot * CODEBOOK_SIZE + value


def phoneme_token_name(name: str) -> str:
    return f"<ph:{name}>"


def token_names(inventory: Sequence[str]) -> list[str]:
    """Every id's token string, id order: what the tokenizer's vocabulary holds."""
    if len(inventory) > MAX_PHONEMES:
        raise ValueError(f"{len(inventory)} phonemes, more than the layout's {MAX_PHONEMES}")
    names = [SPECIAL_TOKENS.get(i, f"<unused_{i}>") for i in range(PHONEME_BASE)]
    names += [phoneme_token_name(p) for p in inventory]
    names += [f"<unused_phoneme_{i}>" for i in range(len(inventory), MAX_PHONEMES)]
    for slot in SLOT_NAMES:
        names += [f"<{slot}_{v}>" for v in range(CODEBOOK_SIZE)]
    names += [f"<dur_{d + 1}>" for d in range(MAX_DURATION)]
    return names


def write_tokenizer(path, inventory: Sequence[str]) -> None:
    """A word-level tokenizer over :func:`token_names` (tokenizer.json + tokenizer_config.json),
    loadable offline with transformers' AutoTokenizer."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    names = token_names(inventory)
    tokenizer = Tokenizer(models.WordLevel(vocab={n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BEGIN],
        "eos_token": SPECIAL_TOKENS[END_OF_SPEECH], "pad_token": SPECIAL_TOKENS[PAD], "unk_token": SPECIAL_TOKENS[PAD],
        "model_max_length": 8192}, indent=2))


def prompt_ids(phonemes: Sequence[tuple[int, int]], folded: bool = False) -> list[int]:
    """The prompt for (phoneme id, frames) pairs (ids already offset by PHONEME_BASE; frames >= 1,
    cut to MAX_DURATION): two positions per phoneme, or one where ``folded``."""
    if len(phonemes) > MAX_PROMPT_PHONEMES:
        raise ValueError(f"{len(phonemes)} phonemes, more than the {MAX_PROMPT_PHONEMES} one request may hold")
    ids = [BEGIN]
    for phoneme, frames in phonemes:
        if not PHONEME_BASE <= phoneme < SLOT_BASE or frames < 1:
            raise ValueError(f"bad phoneme entry ({phoneme}, {frames})")
        duration = min(frames, MAX_DURATION) - 1
        if folded:
            ids.append(FOLD_BASE + (phoneme - PHONEME_BASE) * MAX_DURATION + duration)
        else:
            ids += [phoneme, DURATION_BASE + duration]
    return ids + [END_OF_PHONEMES, START_OF_SPEECH]


def fold_config() -> dict:
    """The ``fold`` of a folded-prompt model's ``frame_head`` (models/frame_head.py): a pair id's
    two parts, (phoneme, duration), and where each part's ids start."""
    return {"base": FOLD_BASE, "offsets": [PHONEME_BASE, DURATION_BASE], "sizes": [MAX_PHONEMES, MAX_DURATION]}


def split_prompt(prompt: Sequence[int]) -> tuple[list[int], list[int]]:
    """(the prompt up to and including start of speech, the ids after it: the leading pause's
    frames handed to the model); ValueError when it is not a phoneme-lpc prompt."""
    prompt = list(prompt)
    try:
        end = prompt.index(START_OF_SPEECH) + 1  # no phoneme, duration or frame id is START_OF_SPEECH
    except ValueError:
        raise ValueError("not a phoneme-lpc prompt") from None
    if end < 3 or prompt[0] != BEGIN or prompt[end - 2] != END_OF_PHONEMES:
        raise ValueError("not a phoneme-lpc prompt")
    if any(not SLOT_BASE <= token < DURATION_BASE for token in prompt[end:]):
        raise ValueError("not a phoneme-lpc prompt")
    return prompt[:end], prompt[end:]


def prompt_schedule(prompt: Sequence[int]) -> list[tuple[int, int]]:
    """(phoneme id, frames) pairs read back from a prompt's ids; ValueError when it is not a
    phoneme-lpc prompt."""
    prompt = split_prompt(prompt)[0]
    body = prompt[1:-2]
    pairs = []
    i = 0
    while i < len(body):
        if body[i] >= FOLD_BASE:  # a folded pair
            index, duration = divmod(body[i] - FOLD_BASE, MAX_DURATION)
            if index >= MAX_PHONEMES:
                raise ValueError("not a phoneme-lpc prompt")
            pairs.append((PHONEME_BASE + index, duration + 1))
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("not a phoneme-lpc prompt")
        phoneme, duration = body[i], body[i + 1]
        if not (PHONEME_BASE <= phoneme < SLOT_BASE and DURATION_BASE <= duration < VOCAB_SIZE):
            raise ValueError("not a phoneme-lpc prompt")
        pairs.append((phoneme, duration - DURATION_BASE + 1))
        i += 2
    return pairs


def alignment_tokens(phonemes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each frame's (phoneme, context) tokens for (phoneme id, frames) pairs."""
    frames: list[tuple[int, int]] = []
    for i, (phoneme, count) in enumerate(phonemes):
        following = phonemes[i + 1][0] - PHONEME_BASE if i + 1 < len(phonemes) else NO_NEXT
        for left in range(min(count, MAX_DURATION) - 1, -1, -1):
            frames.append((slot_token(PHONEME, phoneme - PHONEME_BASE),
                           slot_token(CONTEXT, following * LEFT_LEVELS + min(left, LEFT_LEVELS - 1))))
    return frames


def frame_tokens(phonemes: Sequence[tuple[int, int]], codes: Sequence[tuple[int, int]]) -> list[int]:
    """The generated stream for (phoneme id, frames) pairs and per-frame (envelope, prosody) codes
    (one per frame, phonemes cut to MAX_DURATION frames), end of speech included."""
    alignment = alignment_tokens(phonemes)
    if len(alignment) != len(codes):
        raise ValueError(f"{len(codes)} frames of codes for a {len(alignment)}-frame alignment")
    out: list[int] = []
    for (phoneme, context), (envelope, prosody) in zip(alignment, codes):
        out += [phoneme, context, slot_token(ENVELOPE, int(envelope)), slot_token(PROSODY, int(prosody))]
    return out + [END_OF_SPEECH]


PAUSE, QUIET, OTHER = "pause", "quiet", "other"


def _kind(pause: bool, quiet: bool) -> str:
    """A unit's kind for the edge pauses: a pause, a phoneme whose sound starts softly, or another."""
    return PAUSE if pause else QUIET if quiet else OTHER


class Alignment(LayoutAlignment):
    """The forced tokens of one request: every frame's phoneme and context, then end of speech.
    ``edge_pause_frames``: (the leading, the trailing) pause frames it speaks."""

    def __init__(self, frames: list[tuple[int, int]], edge_pause_frames: tuple[int, int] = (0, 0)):
        self.frames = frames
        self.edge_pause_frames = edge_pause_frames

    @property
    def tokens(self) -> int:
        """Generated tokens the request makes, end of speech not counted."""
        return TOKENS_PER_FRAME * len(self.frames)

    def forced(self, position: int) -> int | None:
        """The id generated token ``position`` must be, or None where the model chooses."""
        frame, slot = divmod(position, TOKENS_PER_FRAME)
        if slot >= ENVELOPE:
            return None
        if frame >= len(self.frames):
            return END_OF_SPEECH if slot == PHONEME else None
        return self.frames[frame][slot]


@dataclass(frozen=True)
class PhonemeLPCLayout(Layout):
    """Maps between LM token ids and the lpc decoder's codes, and builds prompts with eSpeak NG."""

    codebook_size: int = CODEBOOK_SIZE
    tokens_per_frame: int = TOKENS_PER_FRAME
    end_of_speech: int = END_OF_SPEECH
    min_vocab_size: int = VOCAB_SIZE
    #: The text front end: anything with ``align(text, frame_rate) -> TextAlignment`` (the
    #: model's manifest picks it: audio_pipeline/text/lexicon.py's LexiconFrontEnd); None is
    #: eSpeak NG (audio_pipeline/text/espeak.py).
    front_end: Any = field(default=None, compare=False)
    #: One prompt position per phoneme (FOLD_BASE ids; phoneme-lpc-frame's layout_options.prompt
    #: "folded"), else two.
    folded_prompt: bool = False
    #: The (envelope, prosody) codes of a silent frame in the voice's codec (layout_options
    #: ``silence_frame``): what the leading pause's unspoken frames hold. None: the whole leading
    #: pause is spoken.
    silence_frame: tuple[int, int] | None = None
    #: The model's pause phoneme ids (PAUSE_NAMES in its inventory), and its QUIET_ONSETS' ids.
    pause_ids: frozenset = frozenset()
    quiet_onset_ids: frozenset = frozenset()
    #: Pause frames spoken at the start and the end of an utterance (None: the whole pause).
    lead_pause_frames: int | None = LEAD_PAUSE_FRAMES
    tail_pause_frames: int | None = TAIL_PAUSE_FRAMES

    @property
    def takes_pronunciations(self) -> bool:
        """Requests may give words' phonemes: the front end is the lexicon's."""
        return self.front_end is not None and self.front_end.takes_pronunciations

    def _align(self, text: str, overrides=None):
        if self.front_end is not None:
            return self.front_end.align(text, FRAME_RATE, overrides) if overrides else self.front_end.align(text, FRAME_RATE)
        from audio_pipeline.text.espeak import text_alignment

        return text_alignment(text, FRAME_RATE)

    # --- prompts ---------------------------------------------------------------------------------

    #: Requests may set a speed: the voice says each phoneme in its frames divided by the speed.
    supports_speed: ClassVar[bool] = True
    #: One voice, learned: a reference recording gives no other.
    clonable: ClassVar[bool] = False

    @staticmethod
    def _frames(frames: int, speed: float) -> int:
        """A phoneme's frames at ``speed`` (at least 1, at most MAX_DURATION)."""
        return min(MAX_DURATION, max(1, int(round(frames / speed))))

    def phonemes(self, tokenizer, text: str, speed: float = 1.0, overrides=None) -> list[tuple[int, int]]:
        """(phoneme id, frames) of ``text`` from the front-end, in the model's phoneme inventory,
        at ``speed`` (2.0: each phoneme in half its frames); ``overrides``: words' phonemes
        (audio_pipeline/text/lexicon.py's Overrides, where takes_pronunciations)."""
        from audio_pipeline.text.espeak import PAUSE

        vocab = _vocabulary(tokenizer)
        out = []
        for name, frames in self._align(text, overrides).phonemes:
            token = vocab.get(phoneme_token_name(name))
            if token is None:  # unknown to this model: the same phoneme unstressed, else a pause
                token = vocab.get(phoneme_token_name(name.lstrip("',")),
                                  vocab.get(phoneme_token_name(PAUSE), vocab.get(phoneme_token_name("pau"))))
                logger.debug("phoneme %r is not in the model's inventory", name)
            out.append((token, self._frames(frames, speed)))
        return out

    def word_frames(self, text: str, speed: float = 1.0, overrides=None) -> list:
        """The spoken words of ``text`` with the frames each sounds in, on the alignment the
        engine forces (:class:`audio_pipeline.text.espeak.WordFrames`): the front end's frames at
        ``speed``, phonemes cut to MAX_DURATION frames, the words moved as the speech moves."""
        import bisect
        import dataclasses

        aligned = self._align(text, overrides)
        starts, cut_starts = [0], [0]
        for _, frames in aligned.phonemes:
            starts.append(starts[-1] + frames)
            cut_starts.append(cut_starts[-1] + self._frames(frames, speed))

        def cut(frame: int) -> int:
            k = min(bisect.bisect_right(starts, frame) - 1, len(aligned.phonemes) - 1)
            if k < 0:
                return frame
            return cut_starts[k] + min(frame - starts[k], cut_starts[k + 1] - cut_starts[k])

        lead, tail = self._edge_cuts([(_kind(name in PAUSE_NAMES, name in QUIET_ONSETS), self._frames(frames, speed))
                                      for name, frames in aligned.phonemes])
        spoken = cut_starts[-1] - lead - tail

        def moved(frame: int) -> int:
            """A frame of the front end's alignment on the spoken one (edge pauses cut)."""
            return min(max(cut(frame) - lead, 0), spoken)

        if starts[-1] == cut_starts[-1] and not lead and not tail:
            return list(aligned.words)
        return [dataclasses.replace(w, first_frame=moved(w.first_frame), end_frame=moved(w.end_frame))
                for w in aligned.words]

    def _kinds(self, phonemes: Sequence[tuple[int, int]]) -> list[tuple[str, int]]:
        """(kind, frames) of (phoneme id, frames) pairs (kinds: see _kind)."""
        return [(_kind(phoneme in self.pause_ids, phoneme in self.quiet_onset_ids), frames)
                for phoneme, frames in phonemes]

    def _edge_cuts(self, units: Sequence[tuple[str, int]]) -> tuple[int, int]:
        """(frames of the leading pause handed to the model, frames of the trailing pause never
        made) for (kind, frames) units: all but lead_pause_frames (none before a quiet onset) and
        tail_pause_frames; (0, 0) where the speech would be cut to nothing."""
        if len(units) < 2:
            return 0, 0
        (first_kind, first), (last_kind, last) = units[0], units[-1]
        lead = tail = 0
        if first_kind == PAUSE and self.silence_frame is not None and self.lead_pause_frames is not None:
            keep = 0 if units[1][0] == QUIET else self.lead_pause_frames
            lead = max(0, min(first, MAX_DURATION) - keep)
        if last_kind == PAUSE and self.tail_pause_frames is not None:
            tail = max(0, min(last, MAX_DURATION) - self.tail_pause_frames)
        total = sum(min(frames, MAX_DURATION) for _, frames in units)
        return (lead, tail) if lead + tail < total else (0, 0)

    def _edge_pause_frames(self, units: Sequence[tuple[str, int]], given: int) -> tuple[int, int]:
        """(leading, trailing) pause frames spoken, where the prompt holds ``given`` leading frames."""
        if len(units) < 2:
            return 0, 0
        tail = self._edge_cuts(units)[1]
        (first_kind, first), (last_kind, last) = units[0], units[-1]
        return (min(first, MAX_DURATION) - given if first_kind == PAUSE else 0,
                min(last, MAX_DURATION) - tail if last_kind == PAUSE else 0)

    def build_prompt(self, tokenizer, text: str, voice: str | None, reference=None, speed: float = 1.0,
                     overrides=None) -> list[int]:
        """The LM prompt for ``text`` at ``speed`` (one voice: ``voice`` is not part of the prompt)."""
        from audio_pipeline.errors import InvalidArgument

        if reference is not None:
            raise InvalidArgument("this model speaks only in its own voice and cannot clone a recording",
                                  field="reference")
        phonemes = self.phonemes(tokenizer, text, speed, overrides)
        if not phonemes:
            raise InvalidArgument("has nothing to speak", field="text")
        if len(phonemes) > MAX_PROMPT_PHONEMES:
            raise InvalidArgument(f"{len(phonemes)} phonemes, over the {MAX_PROMPT_PHONEMES} one request may hold: "
                                  "split the text", field="text")
        lead = self._edge_cuts(self._kinds(phonemes))[0]
        return prompt_ids(phonemes, folded=self.folded_prompt) + self._silence_ids(phonemes, lead)

    def _silence_ids(self, phonemes: Sequence[tuple[int, int]], count: int) -> list[int]:
        """The prompt ids of the leading pause's first ``count`` frames, holding the silence frame:
        each frame's four tokens (the alignment's phoneme and context, then the codes)."""
        envelope, prosody = self.silence_frame or (0, 0)
        ids: list[int] = []
        for phoneme, context in alignment_tokens(phonemes[:3])[:count]:
            ids += [phoneme, context, slot_token(ENVELOPE, envelope), slot_token(PROSODY, prosody)]
        return ids

    # --- alignment -------------------------------------------------------------------------------

    def _spoken_frames(self, prompt: Sequence[int]) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
        """(the alignment's frames from the first one generated to the last, the leading frames the
        prompt holds, the edge pause frames spoken) of a prompt."""
        pairs = prompt_schedule(prompt)
        given, rest = divmod(len(split_prompt(prompt)[1]), self.tokens_per_frame)
        units = self._kinds(pairs)
        lead, tail = self._edge_cuts(units)
        if rest or given not in (0, lead):
            raise ValueError(f"the prompt holds {given} leading pause frames; this layout hands over {lead}")
        frames = alignment_tokens(pairs)
        return frames[given:len(frames) - tail], given, self._edge_pause_frames(units, given)

    def alignment(self, prompt: Sequence[int]) -> Alignment:
        """The request's forced tokens, from its prompt (the engine calls this once per request)."""
        frames, _, edges = self._spoken_frames(prompt)
        return Alignment(frames, edges)

    def forced_token(self, prompt: Sequence[int], generated: Sequence[int]) -> int | None:
        """The id the next token must be, or None where the model chooses (envelope, prosody)."""
        return self.alignment(prompt).forced(len(generated))

    # --- ids <-> codes ---------------------------------------------------------------------------

    def token_range(self, position: int) -> tuple[int, int]:
        """Half-open range of the ids valid at ``position`` of a frame."""
        start = slot_token(position % TOKENS_PER_FRAME, 0)
        return start, start + CODEBOOK_SIZE

    def is_valid_token(self, token_id: int, position: int) -> bool:
        start, end = self.token_range(position)
        return start <= token_id < end

    def token_to_code(self, token_id: int, position: int) -> int:
        """The code of ``token_id`` at frame position ``position``; ValueError when it is not valid there."""
        if not self.is_valid_token(token_id, position):
            start, end = self.token_range(position)
            raise ValueError(f"token {token_id} is not a speech token for frame position "
                             f"{position % TOKENS_PER_FRAME} (expected [{start}, {end}))")
        return token_id - self.token_range(position)[0]

    def tokens_to_codes(self, token_ids: Sequence[int], first_position: int = 0) -> torch.Tensor:
        return torch.tensor([self.token_to_code(t, first_position + i) for i, t in enumerate(token_ids)],
                            dtype=torch.long)

    def codes_to_tokens(self, codes: Sequence[int], first_position: int = 0) -> list[int]:
        return [self.token_range(first_position + i)[0] + int(c) for i, c in enumerate(codes)]


#: Text front ends a phoneme-lpc(-frame) model may name (its layout option ``front_end``): eSpeak
#: NG's phonemes and durations, or lexicon.txt.gz and prosody.json in the option ``front_end_dir``.
FRONT_ENDS = ("espeak", "lexicon")
#: The language the voices speak (US English phonemes, either front end).
US_ENGLISH = ("en-US",)


def layout_factory(layout_class: type[PhonemeLPCLayout]):
    """The family's layout factory: ``layout_class`` with the front end the manifest names (and
    the prompt form its layout_options name, where the family takes one)."""

    def make_layout(model_dir, tokenizer, layout_options) -> PhonemeLPCLayout:
        if tokenizer is None:  # the vocabulary alone: which ids are pauses
            from audio_pipeline.checkpoints.plain_config import VocabularyTokenizer

            tokenizer = VocabularyTokenizer(model_dir)
        vocab = _vocabulary(tokenizer)
        ids = {name: vocab[phoneme_token_name(name)] for name in PAUSE_NAMES + QUIET_ONSETS
               if phoneme_token_name(name) in vocab}
        options: dict[str, Any] = {"pause_ids": frozenset(ids[n] for n in PAUSE_NAMES if n in ids),
                                   "quiet_onset_ids": frozenset(ids[n] for n in QUIET_ONSETS if n in ids)}
        silence = layout_options.get("silence_frame")
        if silence is not None:
            if (not isinstance(silence, list) or len(silence) != 2
                    or not all(isinstance(c, int) and 0 <= c < CODEBOOK_SIZE for c in silence)):
                raise ValueError(f"{model_dir}: layout_options.silence_frame must be [envelope, prosody] codes in "
                                 f"0..{CODEBOOK_SIZE - 1}, got {silence!r}")
            options["silence_frame"] = tuple(silence)
        prompt = layout_options.get("prompt", "pairs")
        if prompt not in ("pairs", "folded"):
            raise ValueError(f"{model_dir}: layout_options.prompt {prompt!r} is not pairs or folded")
        if prompt == "folded":
            options["folded_prompt"] = True
        front_end, front_end_dir = layout_options.get("front_end", "espeak"), layout_options.get("front_end_dir")
        if front_end not in FRONT_ENDS:
            raise ValueError(f"{model_dir}: unknown layout_options.front_end {front_end!r} (known: {', '.join(FRONT_ENDS)})")
        if front_end_dir is not None and front_end != "lexicon":
            raise ValueError(f"{model_dir}: layout_options.front_end_dir is the lexicon front end's folder, and "
                             f"front_end is {front_end!r}")
        if front_end == "lexicon":
            from audio_pipeline.text.lexicon import LexiconFrontEnd

            files = Path(model_dir) / (front_end_dir or ".")
            missing = [name for name in LexiconFrontEnd.FILES if not (files / name).is_file()]
            if missing:
                where = f"front_end_dir {front_end_dir!r}" if front_end_dir else "the model directory"
                raise ValueError(f"{model_dir}: the lexicon front end's {' and '.join(missing)} is missing from {where} "
                                 f"({files.resolve()})")
            return layout_class(front_end=LexiconFrontEnd.load(files), **options)
        return layout_class(**options)

    return make_layout


# The built-in voices' manifests name their decoder and streaming settings.
#: The layout options both phoneme-lpc families take.
SHARED_OPTIONS = {
    "silence_frame": "[envelope, prosody] codes of a silent frame in the voice's codec: the leading pause's "
                     "unspoken frames hold it (unset: the whole pause is spoken)",
    "front_end": "the text front end: espeak (eSpeak NG's phonemes and durations, the default) or lexicon "
                 "(lexicon.txt.gz and prosody.json in front_end_dir)",
    "front_end_dir": "where the lexicon front end's files are, relative to the model directory (the built-in "
                     "voices share one folder); unset: the model directory"}

register_family(Family("phoneme-lpc", make_layout=layout_factory(PhonemeLPCLayout), plain_checkpoint=True,
                       layout_options=SHARED_OPTIONS, languages=US_ENGLISH))

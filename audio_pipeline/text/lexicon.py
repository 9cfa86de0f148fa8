"""A pronouncing-dictionary front end: words to phones (CMU phone set, with syllable stress), the
way the second-generation built-in voice's teacher (Festival with its CMU lexicon) says them.

The lexicon is a data file shipped with the voice (``lexicon.txt.gz``; one line per word:
``word<TAB>syllable<TAB>syllable...``, a syllable being its phones and its stress digit, e.g.
``aardvark	aa r 1	d v aa r k 0``), built by the voice's recipe from Festival's CMU lexicon.
:class:`Phonemizer` turns a normalized text into units: ``pau`` at the start, at punctuation and
at the end, and each word's phones, a vowel carrying its syllable's stress (``ae1``, ``ax0``).
Rules on top of the lexicon, as the teacher applies them: a possessive "'s" the lexicon lacks is
"s" after a voiceless sound, "ih z" after a sibilant and "z" otherwise; hyphenated words are their
parts. (The teacher's voice keeps "the" as "dh ax" even before a vowel.) A word the lexicon lacks is spelled out from
eSpeak NG's phonemes, mapped to the CMU set.
"""

from __future__ import annotations

import functools
import gzip
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOWELS = {"aa", "ae", "ah", "ao", "aw", "ax", "ay", "eh", "er", "ey", "ih", "iy", "ow", "oy", "uh", "uw"}
VOICELESS = {"p", "t", "k", "f", "th", "s", "sh", "ch", "hh"}
SIBILANTS = {"s", "z", "sh", "zh", "ch", "jh"}
STOPS = {"p", "t", "k", "b", "d", "g"}
PAUSE = "pau"
#: The longest an utterance's first phone may last (frames at 50 Hz) where it is a stop, "hh" or a
#: weak fricative: after the opening pause a stop's closure is silence and the others' first frames
#: are too quiet to hear (under -45 dBFS), so the teacher's durations there (100-120 ms) put up to
#: 90 ms of silence before the first sound. Cut, the speech starts within 50 ms of the first frame.
ONSET_FRAMES = {"p": 2, "t": 2, "k": 2, "b": 2, "d": 2, "g": 2, "hh": 2, "f": 3, "th": 3}
#: Likewise its last phone before the closing pause, and the stops just before it (a final stop's
#: closure, a weak fricative's fading end: up to 180 ms the teacher holds, 60 ms or less heard).
CODA_FRAMES = {"p": 2, "t": 2, "k": 2, "b": 2, "d": 2, "g": 2, "f": 3, "th": 3, "v": 3, "dh": 3}
#: Punctuation after which the teacher pauses.
BREAKS = set(",;:.!?")

#: eSpeak NG (en-us) phoneme -> CMU phones, for words the lexicon lacks.
ESPEAK_TO_CMU = {
    "a": "ae", "a#": "ax", "aa": "aa", "A:": "aa", "A@": "aa r", "aI": "ay", "aI@": "ay er", "aU": "aw",
    "@": "ax", "@2": "ax", "@5": "ax", "3": "er", "3:": "er", "@L": "ax l", "E": "eh", "E2": "eh",
    "e@": "eh r", "eI": "ey", "i": "iy", "i:": "iy", "i@": "iy ax", "i@3": "iy r", "I": "ih", "I2": "ih",
    "I#": "ih", "0": "aa", "O": "ao", "O:": "ao", "O@": "ao r", "o@": "ao r", "OI": "oy", "oU": "ow",
    "u:": "uw", "U": "uh", "U@": "uh r", "V": "ah", "aa#": "aa", "b": "b", "d": "d", "D": "dh", "dZ": "jh",
    "f": "f", "g": "g", "h": "hh", "j": "y", "k": "k", "l": "l", "m": "m", "n": "n", "N": "ng", "p": "p",
    "r": "r", "r-": "r", "s": "s", "S": "sh", "t": "t", "t#": "t", "T": "th", "tS": "ch", "v": "v", "w": "w",
    "z": "z", "Z": "zh", "n-": "n", "m-": "m", "l-": "l", "?": "",
}

_TOKEN = re.compile(r"[A-Za-z][A-Za-z']*|[0-9]+|[,;:.!?]")


def unit(phone: str, stress: int) -> str:
    """A phone as the voice's unit: vowels carry their syllable's stress."""
    return f"{phone}{min(stress, 1)}" if phone in VOWELS else phone


@dataclass(frozen=True)
class Word:
    """One written word of the text and the units the voice says for it."""

    start: int
    end: int
    units: tuple[str, ...]


@dataclass(frozen=True)
class Overrides:
    """Pronunciations a request gives (hashable: the front end caches by it): ``words``, (word
    lower-cased, units) from a lexicon; ``spans``, (start, end, units) of a ``<phoneme>``'s words in
    the text: the first word there says the units, the others nothing."""

    words: tuple[tuple[str, tuple[str, ...]], ...] = ()
    spans: tuple[tuple[int, int, tuple[str, ...]], ...] = ()

    @functools.cached_property
    def _by_word(self) -> dict[str, tuple[str, ...]]:
        return dict(self.words)

    def units(self, word: str, start: int) -> tuple[str, ...] | None:
        for begin, end, units in self.spans:
            if begin <= start < end:
                return units if start == begin else ()
        return self._by_word.get(word.lower())


def punctuation_after(items: list) -> dict[int, str]:
    """For :meth:`Phonemizer.words`'s items: the first punctuation mark after each word that has
    one, by the word's index among the words."""
    out: dict[int, str] = {}
    count = 0
    for item in items:
        if isinstance(item, Word):
            count += 1
        elif count:
            out.setdefault(count - 1, item)
    return out


def words_to_punctuation(index: int, words: int, marks: dict[int, str]) -> int:
    """Words after word ``index`` up to the next punctuation mark (or the end), that one included."""
    remaining = 0
    for later in range(index + 1, words):
        remaining += 1
        if later in marks:
            break
    return remaining


class Lexicon:
    """word (lower case) -> syllables ((phones, stress), ...).

    Each word's syllables are kept as the file writes them (one string: ``phones stress`` per
    syllable, tab-separated) and read on lookup: as parsed tuples the 105,000 words of the shipped
    lexicon took 67 MB of an idle server's memory, as strings about a quarter of it (lookups are
    few and cached by the front end)."""

    def __init__(self, entries: dict[str, str]):
        self.entries = entries

    @classmethod
    def load(cls, path: str | Path) -> "Lexicon":
        entries = {}
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                word, _, syllables = line.rstrip("\n").partition("\t")
                if syllables:
                    entries[word] = syllables
        return cls(entries)

    @staticmethod
    def write(path: str | Path, entries: dict[str, tuple[tuple[tuple[str, ...], int], ...]]) -> None:
        with gzip.open(path, "wt", encoding="utf-8") as out:
            for word in sorted(entries):
                out.write(word + "".join(f"\t{' '.join(p)} {s}" for p, s in entries[word]) + "\n")

    def syllables(self, word: str) -> tuple[tuple[tuple[str, ...], int], ...] | None:
        """((phones, stress), ...) of ``word``, or None when the lexicon lacks it."""
        stored = self.entries.get(word.lower())
        if stored is None:
            return None
        return tuple((tuple(parts[:-1]), int(parts[-1])) for parts in (s.split() for s in stored.split("\t")))

    def phones(self, word: str) -> list[tuple[str, int]] | None:
        """(phone, stress) of ``word``, or None when the lexicon lacks it."""
        syllables = self.syllables(word)
        if syllables is None:
            return None
        return [(phone, stress) for phones, stress in syllables for phone in phones]


class Phonemizer:
    """Normalized text -> units and words (see the module docstring)."""

    def __init__(self, lexicon: Lexicon):
        self.lexicon = lexicon

    def _word(self, word: str) -> list[tuple[str, int]]:
        found = self.lexicon.phones(word)
        if found is not None:
            return found
        lower = word.lower()
        if lower.endswith("'s") and len(lower) > 2:
            base = self._word(word[:-2])
            last = base[-1][0] if base else ""
            suffix = [("ih", 0), ("z", 0)] if last in SIBILANTS else [("s", 0)] if last in VOICELESS else [("z", 0)]
            return base + suffix
        if "'" in lower:
            found = self.lexicon.phones(lower.replace("'", ""))
            if found is not None:
                return found
        return _espeak_phones(word)

    def words(self, text: str, overrides: Overrides | None = None) -> list[Word | str]:
        """The text's words (with their units) and the punctuation marks between them, in order;
        ``overrides`` say some words' units."""
        out: list[Word | str] = []
        for match in _TOKEN.finditer(text):
            token = match.group()
            if token in BREAKS:
                out.append(token)
                continue
            start = match.start()
            given = overrides.units(token, start) if overrides else None
            if given is not None:
                out.append(Word(start, match.end(), given))
                continue
            for part in token.split("-") if "-" in token else [token]:
                given = overrides.units(part, start) if overrides else None
                if given is not None:
                    out.append(Word(start, start + len(part), given))
                    start += len(part) + 1
                    continue
                phones = self._word(part)
                out.append(Word(start, start + len(part), tuple(unit(p, s) for p, s in phones)))
                start += len(part) + 1
        return out

    def units(self, text: str) -> list[tuple[str, int]]:
        """(unit, index of its word or -1 for a pause), with pauses at the start, after each
        punctuation mark that ends a phrase, and at the end."""
        out: list[tuple[str, int]] = [(PAUSE, -1)]
        number = 0
        for item in self.words(text):
            if isinstance(item, str):
                if out[-1][0] != PAUSE:
                    out.append((PAUSE, -1))
                continue
            out += [(u, number) for u in item.units]
            number += 1
        if out[-1][0] != PAUSE:
            out.append((PAUSE, -1))
        return out


def _espeak_phones(word: str) -> list[tuple[str, int]]:
    """A word the lexicon lacks, from eSpeak NG's phonemes (stress from its stress marks)."""
    from audio_pipeline.text.espeak import espeak

    out = []
    for name, _ in espeak().synthesize(word, keep_audio=False).phonemes:
        stressed = 1 if name.startswith("'") else 0
        for phone in ESPEAK_TO_CMU.get(name.lstrip("',%="), "").split():
            out.append((phone, stressed if phone in VOWELS else 0))
    return out


class LexiconFrontEnd:
    """Text -> (unit, frames) and word frames for a voice with a lexicon and prosody models
    (``lexicon.txt.gz`` and ``prosody.json`` in its model directory, or the folder its
    manifest's ``front_end_dir`` names): the same answers as
    :func:`audio_pipeline.text.espeak.text_alignment` gives for eSpeak NG voices."""

    def __init__(self, lexicon: Lexicon, prosody):
        import functools

        self.phonemizer = Phonemizer(lexicon)
        self.prosody = prosody
        # One text, one answer for the life of the process (a seeded request stays the same).
        self.align = functools.lru_cache(maxsize=4096)(self._align)

    @classmethod
    def load(cls, directory: str | Path) -> "LexiconFrontEnd":
        from audio_pipeline.text.prosody import ProsodyModel

        directory = Path(directory)
        lexicon, prosody = cls.FILES
        return cls(Lexicon.load(directory / lexicon), ProsodyModel.load(directory / prosody))

    #: The files load() reads from its directory.
    FILES = ("lexicon.txt.gz", "prosody.json")

    #: Requests may give words' phonemes (Overrides): the layout passes them to align().
    takes_pronunciations = True

    def units(self, text: str, overrides: Overrides | None = None):
        """The text's units (audio_pipeline.text.prosody.Unit: pauses with what caused them) and
        its words."""
        from audio_pipeline.text.prosody import Unit

        items = self.phonemizer.words(text, overrides)
        words = [item for item in items if isinstance(item, Word)]
        marks = punctuation_after(items)
        units = [Unit(PAUSE, -1, "start")]
        since = 0
        for index, word in enumerate(words):
            units += [Unit(name, index) for name in word.units]
            since += 1
            if index == len(words) - 1:
                break
            if index in marks:
                if marks[index] != "," or self.prosody.pauses_at_comma(text[word.start:word.end], since):
                    units.append(Unit(PAUSE, -1, marks[index]))
                    since = 0
                continue
            following = text[words[index + 1].start:words[index + 1].end]
            if self.prosody.is_break(following, since, words_to_punctuation(index, len(words), marks)):
                units.append(Unit(PAUSE, -1, "break"))
                since = 0
        units.append(Unit(PAUSE, -1, "end"))
        return units, words

    def _align(self, text: str, frame_rate: int = 50, overrides: Overrides | None = None):
        from audio_pipeline.text.espeak import TextAlignment, WordFrames

        if frame_rate != 50:
            raise ValueError("the lexicon front end's durations are in 50 Hz frames")
        units, words = self.units(text, overrides)
        frames = self.prosody.frames(units)
        # units[0] and units[-1] are the opening and closing pauses.
        if len(units) > 2 and units[1].name in ONSET_FRAMES:
            frames[1] = min(frames[1], ONSET_FRAMES[units[1].name])
        last = len(units) - 2  # the final consonant, and the stops before it ("shipped": p t)
        while last > 1 and units[last].name in CODA_FRAMES and (last == len(units) - 2 or units[last].name in STOPS):
            frames[last] = min(frames[last], CODA_FRAMES[units[last].name])
            last -= 1
        starts = np.concatenate([[0], np.cumsum(frames)]).astype(int)
        timed = []
        for number, word in enumerate(words):
            mine = [i for i, u in enumerate(units) if u.word == number]
            first, end = (int(starts[mine[0]]), int(starts[mine[-1] + 1])) if mine else (int(starts[-1]),) * 2
            timed.append(WordFrames(word.start, word.end, first, end))
        return TextAlignment(tuple((u.name, f) for u, f in zip(units, frames)), tuple(timed))

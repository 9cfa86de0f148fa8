"""eSpeak NG as a text front-end: the phonemes of a text and how long each one lasts, and the IPA
of a text for models that read phonemes (NeuTTS).

Runs the eSpeak NG C library through ctypes, from the ``espeakng-loader`` wheel (a PyPI package
that ships the library and its data) or else a system ``libespeak-ng`` (Debian: ``espeak-ng``).
eSpeak synthesizes the text in synchronous mode and reports a phoneme event at the sample where
each phoneme starts, and a word event where each word starts; those timings, on the built-in
voice's 50 Hz frame grid, are the explicit alignment its language model is trained and run with,
and the word timings a request reports.
"""

from __future__ import annotations

import ctypes
import bisect
import ctypes.util
import functools
import re
import threading
import dataclasses
from dataclasses import dataclass

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
INITIALIZE_PHONEME_EVENTS = 0x0001
INITIALIZE_DONT_EXIT = 0x8000
EVENT_LIST_TERMINATED, EVENT_WORD, EVENT_PHONEME = 0, 1, 7
POS_CHARACTER = 1
CHARS_UTF8 = 1
PARAM_RATE = 1
#: espeak_TextToPhonemes' phoneme mode: IPA, no separator between a word's phonemes.
PHONEMES_IPA = 0x02

#: The pause phoneme; phonemes missing from a model's inventory fall back to it.
PAUSE = "_"


class _Id(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _Id)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


def _library_and_data() -> tuple[str, str | None]:
    try:  # the PyPI wheel, a dependency of this package
        import espeakng_loader

        return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
    except ImportError:
        pass
    found = ctypes.util.find_library("espeak-ng")
    if not found:
        raise RuntimeError("eSpeak NG is not installed: pip install espeakng-loader (or apt-get install espeak-ng)")
    return found, None


@dataclass
class Utterance:
    """eSpeak's speech for one text."""

    samples: np.ndarray  # float32 mono in [-1, 1]; empty when audio was not kept
    sample_rate: int
    #: Samples eSpeak produced (also when the audio itself was not kept).
    length: int
    #: (phoneme name, start sample), in order; a phoneme lasts until the next one starts.
    phonemes: list[tuple[str, int]]
    #: (character offset in the text, characters, start sample) of each word eSpeak speaks, in
    #: order. eSpeak's character count may fall short of the written word ("don" of "don't").
    words: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


class ESpeak:
    """The process's eSpeak NG engine (the C library is one global engine): use :func:`espeak`."""

    def __init__(self, voice: str = "en-us"):
        library, data = _library_and_data()
        self.lib = ctypes.CDLL(library)
        self.lib.espeak_Initialize.restype = ctypes.c_int
        rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data.encode() if data else None,
                                          INITIALIZE_PHONEME_EVENTS | INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError("eSpeak NG failed to initialise")
        self.sample_rate = rate
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"eSpeak NG has no voice {voice!r}")
        self.voice = voice
        self._lock = threading.Lock()
        self._keep_audio = True
        self._chunks: list[np.ndarray] = []
        self._length = 0
        self._events: list[tuple[str, int]] = []
        self._words: list[tuple[int, int, int]] = []
        self._callback = _CALLBACK(self._on_audio)  # kept alive as long as the engine
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self.lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]

    def _on_audio(self, wav, count, events) -> int:
        if count > 0:
            self._length += count
            if self._keep_audio:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        index = 0
        while events[index].type != EVENT_LIST_TERMINATED:
            event = events[index]
            if event.type == EVENT_PHONEME:
                name = bytes(event.id.string).split(b"\0", 1)[0].decode("utf-8", "replace")
                self._events.append((name, event.sample))
            elif event.type == EVENT_WORD:  # text_position counts characters from 1
                self._words.append((event.text_position - 1, event.length, event.sample))
            index += 1
        return 0

    def synthesize(self, text: str, *, keep_audio: bool = True) -> Utterance:
        """eSpeak's speech of ``text`` with its phoneme timings (thread-safe)."""
        data = text.encode("utf-8") + b"\0"
        with self._lock:
            self._chunks, self._events, self._words, self._length, self._keep_audio = [], [], [], 0, keep_audio
            status = self.lib.espeak_Synth(ctypes.c_char_p(data), ctypes.c_size_t(len(data)), 0, POS_CHARACTER, 0,
                                           CHARS_UTF8, None, None)
            if status != 0:
                raise RuntimeError(f"eSpeak NG failed on {text!r} (status {status})")
            self.lib.espeak_Synchronize()
            chunks, events, words, length = self._chunks, self._events, self._words, self._length
            self._chunks, self._events, self._words = [], [], []
        samples = (np.concatenate(chunks).astype(np.float32) / 32768) if chunks else np.zeros(0, np.float32)
        return Utterance(samples, self.sample_rate, length, events, words)


    def ipa(self, text: str) -> str:
        """The IPA of ``text``, stress marked, words apart by spaces (thread-safe). eSpeak reads
        punctuation (it ends a clause) but writes none: :func:`ipa_with_punctuation` keeps it."""
        pointer = ctypes.c_char_p(text.encode("utf-8"))
        clauses = []
        with self._lock:
            while pointer.value:  # each call reads one clause and moves the pointer past it (NULL at the end)
                clauses.append(self.lib.espeak_TextToPhonemes(ctypes.byref(pointer), CHARS_UTF8, PHONEMES_IPA))
        return " ".join(c.decode("utf-8", "replace") for c in clauses if c)


_ENGINE: ESpeak | None = None
_ENGINE_LOCK = threading.Lock()


def espeak() -> ESpeak:
    """The process's one eSpeak NG engine (US English), created on first use."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = ESpeak("en-us")
        return _ENGINE


def frame_count(samples: int, sample_rate: int, frame_rate: int) -> int:
    """Whole frames of ``frame_rate`` Hz in ``samples`` samples at ``sample_rate``."""
    return samples * frame_rate // sample_rate


def _bounds(starts: list[int], samples: int, sample_rate: int, frame_rate: int) -> list[int]:
    """Frame boundaries of phonemes starting at ``starts`` (samples): the first starts at frame 0,
    each later one at its start rounded to the nearest frame (never going back), and the last ends
    at :func:`frame_count`; one more entry than ``starts``."""
    total = frame_count(samples, sample_rate, frame_rate)
    bounds = [0]
    for start in starts[1:]:  # eSpeak's starts never go back; max() keeps it so regardless
        bounds.append(max(bounds[-1], min(total, int(round(start * frame_rate / sample_rate)))))
    bounds.append(total)
    return bounds


def phoneme_frames(phonemes: list[tuple[str, int]], samples: int, sample_rate: int,
                   frame_rate: int) -> list[tuple[str, int]]:
    """(phoneme, frames) on a ``frame_rate`` grid: phoneme i covers frames [b_i, b_i+1), where b_i is
    its start rounded to the nearest frame (the first starts at frame 0, the last ends at the end).
    Phonemes shorter than half a frame get no frame and are left out. The frames add up to
    :func:`frame_count`."""
    if not phonemes or frame_count(samples, sample_rate, frame_rate) == 0:
        return []
    bounds = _bounds([start for _, start in phonemes], samples, sample_rate, frame_rate)
    return [(name, end - begin) for (name, _), begin, end in zip(phonemes, bounds, bounds[1:]) if end > begin]


@dataclass(frozen=True)
class WordFrames:
    """One spoken word: ``text[start:end]``, sounding in frames [first_frame, end_frame)."""

    start: int
    end: int
    first_frame: int
    end_frame: int


def _written_words(text: str) -> list[tuple[int, int]]:
    """Spans of the words of ``text``: runs of non-space characters holding a letter or digit,
    without the punctuation around them."""
    out = []
    for match in re.finditer(r"\S+", text):
        start, end = match.span()
        while start < end and not text[start].isalnum():
            start += 1
        while end > start and not text[end - 1].isalnum():
            end -= 1
        if end > start:
            out.append((start, end))
    return out


def word_frames(text: str, utterance: Utterance, frame_rate: int) -> list[WordFrames]:
    """The words of ``text`` with their frames on the grid of :func:`phoneme_frames`, in order.

    eSpeak speaks in phonological words: an unstressed word is spoken with the one before it and
    gets no word event of its own ("on the" in "on the coast"), and after such a word an event's
    text position can point inside the word before. So each event is matched to the next written
    word at or after its position (never the same word as the event before), and the written
    words up to the next event's go with it: one WordFrames per event, covering every written word
    once. An event owns the phonemes that start at or after it and before the next one (pauses
    excluded) and sounds from its first phoneme's start to its last one's end; one that owns no
    frame gets an empty range where the next phoneme starts."""
    written = _written_words(text)
    if not utterance.words or not written or frame_count(utterance.length, utterance.sample_rate, frame_rate) == 0:
        return []
    starts = [start for start, _ in written]
    # The written word each event speaks; an event with none left joins the one before.
    events: list[tuple[int, int]] = []  # (written word index, event sample)
    for position, _, sample in utterance.words:
        index = bisect.bisect_right(starts, position) - 1
        if index < 0 or position >= written[index][1]:
            index += 1  # the event points between words: the next one
        if events:
            index = max(index, events[-1][0] + 1)
        if index >= len(written):
            if events:
                continue
            index = len(written) - 1
        events.append((index, sample))
    phonemes = utterance.phonemes
    bounds = _bounds([start for _, start in phonemes], utterance.length, utterance.sample_rate, frame_rate)
    event_samples = [sample for _, sample in events]
    owned: dict[int, list[int]] = {}
    for index, (name, start) in enumerate(phonemes):
        if not name.startswith(PAUSE):
            owned.setdefault(max(0, bisect.bisect_right(event_samples, start) - 1), []).append(index)
    phoneme_starts = [s for _, s in phonemes]
    out = []
    for number, (index, sample) in enumerate(events):
        first_word = 0 if number == 0 else index  # words before the first event go with it
        last_word = events[number + 1][0] - 1 if number + 1 < len(events) else len(written) - 1
        mine = owned.get(number)
        if mine:
            first, last = bounds[mine[0]], bounds[mine[-1] + 1]
        else:
            first = last = bounds[min(bisect.bisect_left(phoneme_starts, sample), len(phonemes))]
        out.append(WordFrames(written[first_word][0], written[last_word][1], first, last))
    return out


@dataclass(frozen=True)
class TextAlignment:
    """What the front end says about one text on a frame grid."""

    #: (phoneme, frames), as :func:`phoneme_frames`.
    phonemes: tuple[tuple[str, int], ...]
    #: The spoken words, as :func:`word_frames`.
    words: tuple[WordFrames, ...]


@functools.lru_cache(maxsize=4096)
def text_alignment(text: str, frame_rate: int) -> TextAlignment:
    """The phonemes and words of ``text`` from the process's engine, cached per text: eSpeak's
    timings vary by a few milliseconds from call to call, and the cache keeps one text's prompt
    (and so a seeded request's speech, and its word timings) the same for the life of the process."""
    utterance = espeak().synthesize(text, keep_audio=False)
    return TextAlignment(
        tuple(phoneme_frames(utterance.phonemes, utterance.length, utterance.sample_rate, frame_rate)),
        tuple(word_frames(text, utterance, frame_rate)))


def text_phoneme_frames(text: str, frame_rate: int) -> tuple[tuple[str, int], ...]:
    """(phoneme, frames) of ``text`` (see :func:`text_alignment`)."""
    return text_alignment(text, frame_rate).phonemes


#: Punctuation kept between the phonemes (with the spaces around it): the marks the ``phonemizer``
#: package keeps with ``preserve_punctuation``, which phoneme-trained models (NeuTTS) were fed.
_PUNCTUATION = re.compile(r'(\s*[;:,.!?¡¿—…"«»“”(){}\[\]]+\s*)+')


@functools.lru_cache(maxsize=4096)
def ipa_with_punctuation(text: str) -> str:
    """eSpeak NG's IPA of ``text``, stress marked, its punctuation in place and spaces collapsed:
    what ``phonemizer``'s eSpeak backend gives with ``with_stress`` and ``preserve_punctuation``
    ("Hello, world." -> "həlˈoʊ, wˈɜːld.")."""
    engine, pieces, start = espeak(), [], 0
    for mark in _PUNCTUATION.finditer(text):
        pieces += [engine.ipa(text[start:mark.start()]), mark.group()]
        start = mark.end()
    pieces.append(engine.ipa(text[start:]))
    return " ".join("".join(pieces).split())

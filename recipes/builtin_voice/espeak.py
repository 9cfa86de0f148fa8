"""eSpeak NG through its C library (ctypes): a sentence's audio plus the timing of every phoneme.

The phoneme events give an explicit alignment (phoneme i covers samples [start_i, start_i+1)),
which is what the voice's training data needs. Works with Debian's libespeak-ng1 or the library
shipped by the ``espeakng-loader`` wheel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
INITIALIZE_PHONEME_EVENTS = 0x0001
INITIALIZE_PHONEME_IPA = 0x0002
INITIALIZE_DONT_EXIT = 0x8000
EVENT_LIST_TERMINATED, EVENT_WORD, EVENT_PHONEME = 0, 1, 7
POS_CHARACTER = 1
CHARS_UTF8 = 1
PARAM_RATE = 1


class _Id(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _Id)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


def _library_path() -> str:
    try:  # the PyPI wheel, when installed
        import espeakng_loader

        return espeakng_loader.get_library_path()
    except ImportError:
        pass
    found = ctypes.util.find_library("espeak-ng")
    if not found:
        raise RuntimeError("eSpeak NG is not installed: apt-get install espeak-ng, or pip install espeakng-loader")
    return found


def _data_path() -> str | None:
    try:
        import espeakng_loader

        return espeakng_loader.get_data_path()
    except ImportError:
        return None


@dataclass
class Utterance:
    samples: np.ndarray  # float32 mono
    sample_rate: int
    #: (phoneme name, start sample), in order; the last phoneme ends at the end of ``samples``.
    phonemes: list[tuple[str, int]]


class ESpeak:
    """One eSpeak NG engine (not thread-safe: use one per process)."""

    def __init__(self, voice: str = "en-us", rate_wpm: int | None = None):
        self.lib = ctypes.CDLL(_library_path())
        data = _data_path()
        self.lib.espeak_Initialize.restype = ctypes.c_int
        rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data.encode() if data else None,
                                          INITIALIZE_PHONEME_EVENTS | INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError("eSpeak NG failed to initialise")
        self.sample_rate = rate
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"eSpeak NG has no voice {voice!r}")
        if rate_wpm:
            self.lib.espeak_SetParameter(PARAM_RATE, rate_wpm, 0)
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, int, str]] = []
        self._callback = _CALLBACK(self._on_audio)
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav, count, events) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        index = 0
        while events[index].type != EVENT_LIST_TERMINATED:
            event = events[index]
            if event.type == EVENT_PHONEME:
                name = bytes(event.id.string).split(b"\0", 1)[0].decode("utf-8", "replace")
                self._events.append((event.type, event.sample, name))
            index += 1
        return 0

    def synthesize(self, text: str) -> Utterance:
        self._chunks, self._events = [], []
        data = text.encode("utf-8") + b"\0"
        status = self.lib.espeak_Synth(ctypes.c_char_p(data), ctypes.c_size_t(len(data)), 0, POS_CHARACTER, 0,
                                       CHARS_UTF8, None, None)
        if status != 0:
            raise RuntimeError(f"eSpeak NG failed on {text!r} (status {status})")
        self.lib.espeak_Synchronize()
        samples = (np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)).astype(np.float32) / 32768
        phonemes = [(name, sample) for _, sample, name in self._events]
        return Utterance(samples, self.sample_rate, phonemes)

"""Cloned voices: reference recordings checked and encoded to speech codes, and the registered-voice store.

A registered voice lives in ``voices_dir/<name>/``: ``voice.json`` (name, description, transcript,
sample rate), ``reference.flac`` (the recording at the decoder's sample rate) and
``codes.<decoder>.npy`` (its speech codes for that decoder, recomputed when missing). The store
is read at start-up, so registered voices survive a restart.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import soundfile as sf
import soxr
import torch

from audio_pipeline.errors import AlreadyExists, InvalidArgument, NotFound

MIN_REFERENCE_RATE = 8000
MAX_REFERENCE_RATE = 192000
#: Shortest usable reference: a tenth of a second.
MIN_REFERENCE_SECONDS = 0.1
MAX_DESCRIPTION_CHARS = 200
VOICE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


@dataclass(frozen=True)
class VoicePrompt:
    """What a cloned voice adds to a request: the reference transcript and its speech codes."""

    transcript: str
    #: Frame-major speech codes of the reference recording (1-D long tensor).
    codes: torch.Tensor


@dataclass(frozen=True)
class RegisteredVoice:
    name: str
    description: str
    prompt: VoicePrompt
    language: str = "en-US"


def read_reference_audio(data: bytes, sample_rate: int, *, max_seconds: float,
                         field: str = "reference.audio") -> np.ndarray:
    """Decodes an audio file's bytes to mono float32 at ``sample_rate``; InvalidArgument naming ``field``."""
    if not data:
        raise InvalidArgument("is empty: send the bytes of a WAV, FLAC or OGG recording", field=field)
    try:
        with sf.SoundFile(io.BytesIO(data)) as audio:
            rate, frames = audio.samplerate, audio.frames
            if not MIN_REFERENCE_RATE <= rate <= MAX_REFERENCE_RATE:
                raise InvalidArgument(f"sample rate {rate} Hz is not supported (use {MIN_REFERENCE_RATE} to "
                                      f"{MAX_REFERENCE_RATE} Hz)", field=field)
            if frames > max_seconds * rate:
                raise InvalidArgument(f"{frames / rate:.1f} s long, over the limit of {max_seconds:g} s", field=field)
            samples = audio.read(dtype="float32", always_2d=True)
    except InvalidArgument:
        raise
    except (RuntimeError, sf.LibsndfileError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"cannot be read as audio ({exc})", field=field) from None
    if samples.shape[0] < MIN_REFERENCE_SECONDS * rate:
        raise InvalidArgument(f"{samples.shape[0] / rate:.3f} s of audio is too short (at least "
                              f"{MIN_REFERENCE_SECONDS} s)", field=field)
    mono = samples.mean(axis=1)
    if not np.isfinite(mono).all():
        raise InvalidArgument("holds non-finite samples", field=field)
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)


def check_transcript(transcript: str, max_chars: int, field: str = "reference.transcript") -> str:
    if not transcript or not transcript.strip():
        raise InvalidArgument("is required: the words spoken in the reference recording", field=field)
    if len(transcript) > max_chars:
        raise InvalidArgument(f"{len(transcript)} characters, over the limit of {max_chars}", field=field)
    return transcript.strip()


class VoiceStore:
    """Registered voices on disk; thread-safe."""

    def __init__(self, directory: Path, decoder_name: str, sample_rate: int,
                 encode: Callable[[np.ndarray], torch.Tensor]):
        self.directory = Path(directory)
        self.decoder_name = re.sub(r"[^a-zA-Z0-9_.-]", "_", decoder_name)
        self.sample_rate = sample_rate
        self.encode = encode
        self._voices: dict[str, RegisteredVoice] = {}
        self._lock = threading.Lock()

    def load(self) -> list[str]:
        """Reads every registered voice; returns the names of entries it had to skip (broken)."""
        skipped = []
        if not self.directory.is_dir():
            return skipped
        for entry in sorted(self.directory.iterdir()):
            if not (entry / "voice.json").is_file():
                continue
            try:
                voice = self._read(entry)
            except Exception:  # noqa: BLE001 - one broken entry must not stop the server
                skipped.append(entry.name)
                continue
            self._voices[voice.name] = voice
        return skipped

    def _read(self, entry: Path) -> RegisteredVoice:
        meta = json.loads((entry / "voice.json").read_text())
        codes_path = entry / f"codes.{self.decoder_name}.npy"
        if codes_path.is_file():
            codes = torch.from_numpy(np.load(codes_path)).long()
        else:  # registered under another decoder: encode the kept recording again
            samples, rate = sf.read(entry / "reference.flac", dtype="float32")
            if rate != self.sample_rate:
                samples = soxr.resample(samples, rate, self.sample_rate).astype(np.float32)
            codes = self.encode(samples)
            np.save(codes_path, codes.numpy())
        return RegisteredVoice(meta["name"], meta.get("description", ""), VoicePrompt(meta["transcript"], codes),
                               meta.get("language", "en-US"))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def voices(self) -> list[RegisteredVoice]:
        with self._lock:
            return [self._voices[n] for n in sorted(self._voices)]

    def get(self, name: str) -> RegisteredVoice | None:
        with self._lock:
            return self._voices.get(name)

    def register(self, name: str, samples: np.ndarray, transcript: str, description: str,
                 reserved: set[str]) -> RegisteredVoice:
        """Encodes and stores a voice; ``reserved`` are names it may not take (preset voices)."""
        if not VOICE_NAME.fullmatch(name or ""):
            raise InvalidArgument(f"{name!r} is not a valid voice name (1 to 64 of a-z, 0-9, '-', '_', starting "
                                  "with a letter or digit)", field="name")
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise InvalidArgument(f"{len(description)} characters, over the limit of {MAX_DESCRIPTION_CHARS}",
                                  field="description")
        if name in reserved:
            raise AlreadyExists(f"{name!r} is a preset voice of the model", field="name")
        with self._lock:
            if name in self._voices:
                raise AlreadyExists(f"a voice named {name!r} is already registered", field="name")
        codes = self.encode(samples)
        voice = RegisteredVoice(name, description, VoicePrompt(transcript, codes))
        with self._lock:
            if name in self._voices:
                raise AlreadyExists(f"a voice named {name!r} is already registered", field="name")
            entry = self.directory / name
            staging = self.directory / f".{name}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            sf.write(staging / "reference.flac", samples, self.sample_rate)
            np.save(staging / f"codes.{self.decoder_name}.npy", codes.numpy())
            (staging / "voice.json").write_text(json.dumps(
                {"name": name, "description": description, "transcript": transcript, "language": voice.language},
                indent=2))
            staging.rename(entry)
            self._voices[name] = voice
        return voice

    def delete(self, name: str) -> None:
        with self._lock:
            if name not in self._voices:
                raise NotFound(f"no registered voice named {name!r}", field="name")
            del self._voices[name]
            shutil.rmtree(self.directory / name, ignore_errors=True)

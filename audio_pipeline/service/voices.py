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
from typing import TYPE_CHECKING, Callable

import numpy as np
import soundfile as sf
import soxr
import torch

from audio_pipeline.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, echo

if TYPE_CHECKING:
    from audio_pipeline.config import LimitsConfig

MIN_REFERENCE_RATE = 8000
MAX_REFERENCE_RATE = 192000
#: Shortest usable reference: a tenth of a second.
MIN_REFERENCE_SECONDS = 0.1
#: Lower-case letters, digits, '-' and '_', starting with a letter or digit (it names a directory);
#: the length is bounded by limits.max_voice_name_chars.
VOICE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


@dataclass(frozen=True)
class VoicePrompt:
    """What a cloned voice adds to a request: the reference transcript and its speech codes."""

    transcript: str
    #: Frame-major speech codes of the reference recording (1-D long tensor).
    codes: torch.Tensor
    #: The recording's speaker embedding, for models that clone by one (Qwen3-TTS Base); None
    #: where the model has no speaker encoder.
    speaker_embedding: torch.Tensor | None = None


@dataclass(frozen=True)
class RegisteredVoice:
    name: str
    description: str
    prompt: VoicePrompt
    language: str = "en-US"


def _decoder_message(exc: Exception) -> str:
    """The audio library's reason, without its description of our in-memory file object (which
    would show the client a memory address), and never the library's class names."""
    reason = getattr(exc, "error_string", None) or str(exc)
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>:? ?", "", reason).strip() or "an unknown or damaged format"


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
        raise InvalidArgument(f"cannot be read as audio ({_decoder_message(exc)})", field=field) from None
    if samples.shape[0] < MIN_REFERENCE_SECONDS * rate:
        raise InvalidArgument(f"{samples.shape[0] / rate:.3f} s of audio is too short (at least "
                              f"{MIN_REFERENCE_SECONDS} s)", field=field)
    mono = samples.mean(axis=1)
    if not np.isfinite(mono).all():
        raise InvalidArgument("holds non-finite samples", field=field)
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)


def check_reference_size(audio: bytes, max_bytes: int, field: str = "reference.audio") -> None:
    """InvalidArgument when the encoded recording is over ``max_bytes``; checked before decoding it."""
    if len(audio) > max_bytes:
        raise InvalidArgument(f"{len(audio)} bytes, over the limit of {max_bytes} "
                              "(limits.max_reference_audio_bytes)", field=field)


def check_transcript(transcript: str, max_chars: int, field: str = "reference.transcript") -> str:
    if not transcript or not transcript.strip():
        raise InvalidArgument("is required: the words spoken in the reference recording", field=field)
    if len(transcript) > max_chars:
        raise InvalidArgument(f"{len(transcript)} characters, over the limit of {max_chars}", field=field)
    return transcript.strip()


def check_voice_fields(name: str, description: str, limits: LimitsConfig) -> None:
    """InvalidArgument for a registration's name or description; lengths first, so a huge string is
    never matched against a pattern nor echoed back in full."""
    if len(name) > limits.max_voice_name_chars:
        raise InvalidArgument(f"{len(name)} characters, over the limit of {limits.max_voice_name_chars} "
                              "(limits.max_voice_name_chars)", field="name")
    if not VOICE_NAME.fullmatch(name or ""):
        raise InvalidArgument(f"{echo(name or '')} is not a valid voice name (1 to {limits.max_voice_name_chars} "
                              "of a-z, 0-9, '-', '_', starting with a letter or digit)", field="name")
    if len(description) > limits.max_description_chars:
        raise InvalidArgument(f"{len(description)} characters, over the limit of {limits.max_description_chars} "
                              "(limits.max_description_chars)", field="description")


def codes_file(decoder_name: str) -> str:
    """The file name of a voice's speech codes for a decoder (the name made safe for a file)."""
    return f"codes.{re.sub(r'[^a-zA-Z0-9_.-]', '_', decoder_name)}.npy"


def read_voice_entry(entry: Path, decoder_name: str, sample_rate: int,
                     encode: Callable[[np.ndarray], torch.Tensor] | None) -> tuple[dict, torch.Tensor, bool]:
    """(voice.json's fields, speech codes, whether they were encoded now) of a voice directory in the
    registered-voice format: its codes for ``decoder_name``, else its reference.flac encoded
    (at ``sample_rate``) with ``encode``; ValueError naming the file when neither can be had."""
    meta = json.loads((entry / "voice.json").read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("transcript"), str):
        raise ValueError(f"{entry / 'voice.json'}: needs a transcript (the words of the reference recording)")
    codes_path = entry / codes_file(decoder_name)
    if codes_path.is_file():
        return meta, torch.from_numpy(np.load(codes_path)).long(), False
    if encode is None or not (entry / "reference.flac").is_file():
        raise ValueError(f"{entry}: no {codes_path.name}, nor a reference.flac for the {decoder_name!r} decoder "
                         "to encode")
    samples, rate = sf.read(entry / "reference.flac", dtype="float32")
    if rate != sample_rate:
        samples = soxr.resample(samples, rate, sample_rate).astype(np.float32)
    return meta, encode(samples), True


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (what a registered voice takes on disk)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class VoiceStore:
    """Registered voices on disk; thread-safe.

    It keeps the on-disk size of each voice, so that the limits on the number of voices and on their
    bytes together (limits.max_registered_voices, limits.max_registered_voice_bytes) are checked
    without walking the directory on every registration.
    """

    def __init__(self, directory: Path, decoder_name: str, sample_rate: int,
                 encode: Callable[[np.ndarray], torch.Tensor],
                 speaker: Callable[[np.ndarray], torch.Tensor | None] | None = None):
        self.directory = Path(directory)
        self.decoder_name = decoder_name
        self.sample_rate = sample_rate
        self.encode = encode
        #: The model's speaker embedding of a recording (at ``sample_rate``), where it clones by one:
        #: computed from reference.flac as a voice is read (it depends on the model, not the decoder).
        self.speaker = speaker
        self._voices: dict[str, RegisteredVoice] = {}
        self._bytes: dict[str, int] = {}
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
            self._bytes[voice.name] = directory_bytes(entry)  # after _read, which may add codes
        return skipped

    def _read(self, entry: Path) -> RegisteredVoice:
        meta, codes, encoded = read_voice_entry(entry, self.decoder_name, self.sample_rate, self.encode)
        if encoded:  # registered under another decoder: kept for the next start
            np.save(entry / codes_file(self.decoder_name), codes.numpy())
        prompt = VoicePrompt(meta["transcript"], codes, self.speaker_of(entry))
        return RegisteredVoice(meta["name"], meta.get("description", ""), prompt, meta.get("language", "en-US"))

    def speaker_of(self, entry: Path) -> torch.Tensor | None:
        """The speaker embedding of a voice directory's reference.flac, where the model clones by one."""
        if self.speaker is None:
            return None
        samples, rate = sf.read(entry / "reference.flac", dtype="float32")
        if samples.ndim > 1:
            samples = samples.mean(axis=1)
        if rate != self.sample_rate:
            samples = soxr.resample(samples, rate, self.sample_rate).astype(np.float32)
        return self.speaker(samples)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def voices(self) -> list[RegisteredVoice]:
        with self._lock:
            return [self._voices[n] for n in sorted(self._voices)]

    def get(self, name: str) -> RegisteredVoice | None:
        with self._lock:
            return self._voices.get(name)

    def check_new(self, name: str, description: str, reserved: set[str], limits: LimitsConfig) -> None:
        """What can be refused before the recording is decoded and encoded: the name, the description,
        a taken name, and a store already full (by count or by bytes)."""
        check_voice_fields(name, description, limits)
        if name in reserved:
            raise AlreadyExists(f"{echo(name)} is a preset voice of the model", field="name")
        with self._lock:
            self._check_room(name, 0, limits)

    def _check_room(self, name: str, new_bytes: int, limits: LimitsConfig) -> None:
        """Under the lock: AlreadyExists for a taken name, ResourceExhausted when ``new_bytes`` more
        would not fit."""
        if name in self._voices:
            raise AlreadyExists(f"a voice named {echo(name)} is already registered", field="name")
        if len(self._voices) >= limits.max_registered_voices:
            raise ResourceExhausted(f"{len(self._voices)} voices are registered, the most this server keeps "
                                    f"(limits.max_registered_voices={limits.max_registered_voices}); delete one "
                                    "first")
        used, limit = sum(self._bytes.values()), limits.max_registered_voice_bytes
        if used >= limit:  # full already: no new voice fits, whatever its size
            raise ResourceExhausted(f"registered voices take {used} bytes, the most this server keeps "
                                    f"(limits.max_registered_voice_bytes={limit}); delete one first")
        if used + new_bytes > limit:
            raise ResourceExhausted(f"this voice takes {new_bytes} bytes on disk; with the {used} bytes of the "
                                    f"registered voices that is over limits.max_registered_voice_bytes={limit}; "
                                    "delete one first")

    def register(self, name: str, samples: np.ndarray, transcript: str, description: str,
                 reserved: set[str], limits: LimitsConfig) -> RegisteredVoice:
        """Encodes and stores a voice; ``reserved`` are names it may not take (preset voices).

        The limits are checked again once the voice is written (to a staging directory), since a
        concurrent registration may have taken the room meanwhile, and only then is it kept.
        """
        self.check_new(name, description, reserved, limits)
        codes = self.encode(samples)
        speaker = self.speaker(samples) if self.speaker is not None else None
        voice = RegisteredVoice(name, description, VoicePrompt(transcript, codes, speaker))
        with self._lock:
            self._check_room(name, 0, limits)
            entry = self.directory / name
            staging = self.directory / f".{name}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            try:
                sf.write(staging / "reference.flac", samples, self.sample_rate)
                np.save(staging / codes_file(self.decoder_name), codes.numpy())
                (staging / "voice.json").write_text(json.dumps(
                    {"name": name, "description": description, "transcript": transcript,
                     "language": voice.language}, indent=2))
                size = directory_bytes(staging)
                self._check_room(name, size, limits)
                staging.rename(entry)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            self._voices[name] = voice
            self._bytes[name] = size
        return voice

    def delete(self, name: str) -> None:
        with self._lock:
            if name not in self._voices:
                raise NotFound(f"no registered voice named {echo(name)}", field="name")
            del self._voices[name]
            self._bytes.pop(name, None)
            shutil.rmtree(self.directory / name, ignore_errors=True)

"""Pure conversions between Python values and the audio_pipeline.v1 messages, and Synthesize stream checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from audio_pipeline_client._proto import tts_pb2
from audio_pipeline_client.types import AudioStreamChunk, SynthesisResult, TTSError, Usage, Voice, WordTiming

PCM16 = tts_pb2.AUDIO_ENCODING_PCM16
FLOAT32 = tts_pb2.AUDIO_ENCODING_FLOAT32
#: Encodings whose chunks are one encoded stream (the chunks' bytes joined are the file).
STREAM_ENCODINGS = {"wav": tts_pb2.AUDIO_ENCODING_WAV, "mp3": tts_pb2.AUDIO_ENCODING_MP3,
                    "opus": tts_pb2.AUDIO_ENCODING_OPUS, "aac": tts_pb2.AUDIO_ENCODING_AAC,
                    "flac": tts_pb2.AUDIO_ENCODING_FLAC, "mulaw": tts_pb2.AUDIO_ENCODING_MULAW,
                    "alaw": tts_pb2.AUDIO_ENCODING_ALAW}
ENCODING_NAMES = {"pcm16": PCM16, "f32": FLOAT32, "float32": FLOAT32, **STREAM_ENCODINGS}
#: The file name extension that picks each stream encoding (tts-client --output out.mp3).
EXTENSIONS = {".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac", ".flac": "flac", ".ulaw": "mulaw",
              ".mulaw": "mulaw", ".alaw": "alaw"}
SAMPLE_WIDTH = {PCM16: 2, FLOAT32: 4}
PRECISION_NAMES = {
    tts_pb2.TIMING_PRECISION_UNSPECIFIED: "unspecified",
    tts_pb2.TIMING_PRECISION_WORD: "word",
    tts_pb2.TIMING_PRECISION_SEGMENT: "segment",
}
STOP_REASON_NAMES = {
    tts_pb2.STOP_REASON_UNSPECIFIED: "unspecified",
    tts_pb2.STOP_REASON_END_OF_SPEECH: "end_of_speech",
    tts_pb2.STOP_REASON_MAX_TOKENS: "max_tokens",
}


def parse_encoding(encoding: str | int | None) -> int | None:
    """``"pcm16"``, ``"f32"``/``"float32"``, a proto enum name or value, or None (unset) -> enum value."""
    if encoding is None:
        return None
    if isinstance(encoding, str):
        name = encoding.strip().lower()
        if name in ENCODING_NAMES:
            return ENCODING_NAMES[name]
        if encoding.strip().upper() in tts_pb2.AudioEncoding.keys():
            return tts_pb2.AudioEncoding.Value(encoding.strip().upper())
    elif isinstance(encoding, int) and not isinstance(encoding, bool) and encoding in tts_pb2.AudioEncoding.values():
        return encoding
    raise ValueError(f"encoding: unknown encoding {encoding!r}; use one of {', '.join(ENCODING_NAMES)}")


def build_request(text: str, *, voice: str | None = None, seed: int | None = None,
                  max_tokens: int | None = None, min_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  repetition_penalty: float | None = None, sample_rate: int | None = None,
                  encoding: str | int | None = None, request_id: str | None = None,
                  reference_audio: ReferenceAudio | None = None,
                  reference_transcript: str | None = None, min_p: float | None = None,
                  frequency_penalty: float | None = None, presence_penalty: float | None = None,
                  stop_token_ids: Sequence[int] | None = None,
                  normalize_text: bool | None = None, speed: float | None = None, language: str | None = None,
                  instructions: str | None = None, ssml: bool | None = None,
                  pronunciations: Sequence[dict] | None = None) -> tts_pb2.SynthesizeRequest:
    """A SynthesizeRequest carrying only the options given; None leaves a field unset (the server's default).
    ``ssml``: the text is SSML (None: when it starts with <speak); ``pronunciations``: dicts of
    ``word`` and ``phonemes`` (IPA) or ``respelling``."""
    request = tts_pb2.SynthesizeRequest(text=text)
    if reference_audio is not None or reference_transcript is not None:
        request.reference.CopyFrom(voice_reference(reference_audio, reference_transcript))
    if voice is not None:
        request.voice = voice
    if sample_rate is not None:
        request.sample_rate = sample_rate
    parsed_encoding = parse_encoding(encoding)
    if parsed_encoding is not None:
        request.encoding = parsed_encoding
    if request_id is not None:
        request.request_id = request_id
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                "repetition_penalty": repetition_penalty, "max_tokens": max_tokens, "min_tokens": min_tokens,
                "seed": seed, "min_p": min_p, "frequency_penalty": frequency_penalty,
                "presence_penalty": presence_penalty}
    given = {name: value for name, value in sampling.items() if value is not None}
    if given:
        request.sampling.CopyFrom(tts_pb2.SamplingParams(**given))
    if stop_token_ids:
        request.sampling.stop_token_ids.extend(int(t) for t in stop_token_ids)
    if normalize_text is not None:
        request.normalize_text = normalize_text
    if speed is not None:
        request.speed = speed
    if language is not None:
        request.language = language
    if instructions is not None:
        request.instructions = instructions
    if ssml is not None:
        request.ssml = ssml
    for entry in pronunciations or ():
        request.pronunciations.add(word=entry["word"], phonemes=entry.get("phonemes") or "",
                                   respelling=entry.get("respelling") or "")
    return request


def build_stream_settings(**options) -> tts_pb2.StreamSettings:
    """A live-text stream's settings: the options of build_request, without the text and reference."""
    request = build_request("", **options)
    return tts_pb2.StreamSettings(
        voice=request.voice, sampling=request.sampling, encoding=request.encoding,
        sample_rate=request.sample_rate, request_id=request.request_id,
        **({"normalize_text": request.normalize_text} if request.HasField("normalize_text") else {}),
        **({"speed": request.speed} if request.HasField("speed") else {}),
        language=request.language, instructions=request.instructions, pronunciations=request.pronunciations)


#: What a live-text iterable may yield: a piece of text, or FLUSH (speak what has come so far now).
FLUSH = object()


def text_inputs(settings: tts_pb2.StreamSettings, pieces):
    """The TextInput messages of a live-text call: settings, pieces (FLUSH flushes), end of input."""
    yield tts_pb2.TextInput(settings=settings)
    for piece in pieces:
        yield _text_input(piece)
    yield tts_pb2.TextInput(end_of_input=tts_pb2.EndOfInput())


def _text_input(piece) -> tts_pb2.TextInput:
    if piece is FLUSH:
        return tts_pb2.TextInput(flush=tts_pb2.Flush())
    if not isinstance(piece, str):
        raise TypeError(f"live text pieces must be str or FLUSH, got {type(piece).__name__}")
    return tts_pb2.TextInput(text=piece)


async def async_text_inputs(settings: tts_pb2.StreamSettings, pieces):
    """text_inputs for an async iterable (or a plain one) of pieces."""
    yield tts_pb2.TextInput(settings=settings)
    if hasattr(pieces, "__aiter__"):
        async for piece in pieces:
            yield _text_input(piece)
    else:
        for piece in pieces:
            yield _text_input(piece)
    yield tts_pb2.TextInput(end_of_input=tts_pb2.EndOfInput())


ReferenceAudio = Union[bytes, str, os.PathLike]


def voice_reference(audio: ReferenceAudio | None, transcript: str | None) -> tts_pb2.VoiceReference:
    """A VoiceReference from a recording (an audio file's bytes, or its path) and its transcript."""
    if isinstance(audio, (str, os.PathLike)):
        try:
            audio = Path(audio).read_bytes()
        except OSError as exc:
            raise TTSError.invalid_input(f"reference audio {audio}: {exc.strerror or exc}") from None
    return tts_pb2.VoiceReference(audio=audio or b"", transcript=transcript or "")


def is_stream_encoding(encoding: int) -> bool:
    return encoding in STREAM_ENCODINGS.values()


def sample_width(encoding: int) -> int:
    """Bytes per sample; an unspecified encoding means PCM16 (see the AudioEncoding docs)."""
    if encoding == tts_pb2.AUDIO_ENCODING_UNSPECIFIED:
        return SAMPLE_WIDTH[PCM16]
    if encoding not in SAMPLE_WIDTH:
        raise TTSError.protocol_violation(f"unknown audio encoding {encoding}")
    return SAMPLE_WIDTH[encoding]


def decode_samples(data: bytes, encoding: int) -> np.ndarray:
    """AudioFrames.data -> float32 samples in [-1, 1]."""
    if len(data) % sample_width(encoding):
        raise TTSError.protocol_violation(
            f"{len(data)} bytes of audio is not a whole number of {sample_width(encoding)}-byte samples")
    if encoding == FLOAT32:
        return np.clip(np.frombuffer(data, dtype="<f4"), -1.0, 1.0).astype(np.float32)
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float samples -> int16; exactly undoes ``decode_samples`` of PCM16 data."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


def encode_samples(samples: np.ndarray, encoding: int) -> bytes:
    """float samples -> little-endian bytes in ``encoding`` (the wire layout, for raw output)."""
    if encoding == FLOAT32:
        return samples.astype("<f4").tobytes()
    return float_to_pcm16(samples).astype("<i2").tobytes()


def usage_from_proto(usage: tts_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, generated_tokens=usage.generated_tokens,
                 audio_seconds=usage.audio_seconds, time_to_first_audio_seconds=usage.time_to_first_audio_seconds,
                 generation_seconds=usage.generation_seconds)


def voice_from_proto(voice: tts_pb2.Voice) -> Voice:
    return Voice(name=voice.name, description=voice.description, language=voice.language,
                 is_default=voice.is_default, registered=voice.registered)


class StreamReader:
    """Reads one Synthesize stream in order: format first, audio chunks 0, 1, 2, ..., complete last.

    ``read`` returns None for the format message and an AudioStreamChunk for audio and completion
    messages; anything out of order raises TTSError (INTERNAL, "protocol violation: ...").
    """

    def __init__(self) -> None:
        self.format: tts_pb2.AudioFormat | None = None
        self.request_id: str | None = None
        self.audio_chunks = 0
        self.complete = False

    def read(self, message: tts_pb2.AudioChunk) -> AudioStreamChunk | None:
        kind = message.WhichOneof("content")
        if self.complete:
            raise TTSError.protocol_violation(f"a {kind or 'empty'} message arrived after the completion message")
        if self.request_id is None:
            self.request_id = message.request_id
        elif message.request_id != self.request_id:
            raise TTSError.protocol_violation(
                f"request id changed from {self.request_id!r} to {message.request_id!r} within one stream")
        if kind == "format":
            return self._read_format(message.format)
        if self.format is None:
            raise TTSError.protocol_violation(f"a {kind or 'empty'} message arrived before the format message")
        if kind == "audio":
            return self._read_audio(message.audio)
        if kind == "complete":
            self.complete = True
            return AudioStreamChunk(samples=np.zeros(0, dtype=np.float32), sample_rate=self.format.sample_rate,
                                    index=self.audio_chunks, final=True,
                                    usage=usage_from_proto(message.complete.usage),
                                    stop_reason=STOP_REASON_NAMES.get(message.complete.stop_reason, "unspecified"),
                                    request_id=self.request_id)
        raise TTSError.protocol_violation("a message with no content arrived")

    def end(self) -> None:
        """The server closed the stream with OK status: it must have sent the completion message."""
        if not self.complete:
            raise TTSError.protocol_violation("the stream ended without a completion message")

    def _read_format(self, audio_format: tts_pb2.AudioFormat) -> None:
        if self.format is not None:
            raise TTSError.protocol_violation("a second format message arrived")
        if audio_format.sample_rate <= 0:
            raise TTSError.protocol_violation("the format message has no sample rate")
        if audio_format.channels != 1:
            raise TTSError.protocol_violation(f"expected mono audio, the format says {audio_format.channels} channels")
        if not is_stream_encoding(audio_format.encoding):
            sample_width(audio_format.encoding)
        self.format = audio_format
        return None

    def _read_audio(self, frames: tts_pb2.AudioFrames) -> AudioStreamChunk:
        if frames.chunk_index != self.audio_chunks:
            raise TTSError.protocol_violation(
                f"audio chunk {frames.chunk_index} arrived where chunk {self.audio_chunks} was expected")
        if is_stream_encoding(self.format.encoding):  # bytes of one encoded file: no samples per chunk
            samples = np.zeros(0, dtype=np.float32)
        else:
            samples = decode_samples(frames.data, self.format.encoding)
        if not is_stream_encoding(self.format.encoding) and samples.size != frames.num_samples:
            raise TTSError.protocol_violation(
                f"audio chunk {frames.chunk_index} says {frames.num_samples} samples but carries {samples.size}")
        self.audio_chunks += 1
        rate = self.format.sample_rate
        words = tuple(WordTiming(text=w.text, text_start=w.text_start, text_end=w.text_end,
                                 start_sample=w.start_sample, end_sample=w.end_sample, spoken=w.spoken,
                                 precision=PRECISION_NAMES.get(w.precision, "unspecified"), sample_rate=rate)
                      for w in frames.words)
        return AudioStreamChunk(samples=samples, sample_rate=rate, index=frames.chunk_index,
                                request_id=self.request_id, words=words, data=frames.data,
                                num_samples=frames.num_samples)


def decode_stream(data: bytes, name: str, sample_rate: int, total_samples: int = 0) -> tuple[np.ndarray, int]:
    """(float samples, their rate) of a whole encoded stream of ``sample_rate`` (G.711 here; WAV,
    FLAC, MP3 and Ogg/Opus through soundfile: Opus decodes at its own 48 kHz); no samples where this
    client cannot decode it (AAC). ``total_samples``: the samples the stream was made from (a
    streamed FLAC header leaves its length unknown, which soundfile cannot read: it is written in)."""
    if name in ("mulaw", "alaw"):
        return g711_decode(np.frombuffer(data, dtype=np.uint8), name), sample_rate
    if name == "aac" or not data:
        return np.zeros(0, dtype=np.float32), sample_rate
    import io

    import soundfile

    if name == "flac" and data[:4] == b"fLaC" and len(data) > 26 and total_samples:
        # STREAMINFO, the first metadata block: its 36-bit sample count ends at byte 25.
        patched = bytearray(data)
        patched[21] = (patched[21] & 0xF0) | ((total_samples >> 32) & 0x0F)
        patched[22:26] = (total_samples & 0xFFFFFFFF).to_bytes(4, "big")
        data = bytes(patched)
    if name == "wav":  # a streaming header (sizes 0xFFFFFFFF): the samples follow its 44 bytes
        return (np.frombuffer(data[44:len(data) - (len(data) - 44) % 2], dtype="<i2").astype(np.float32) / 32768,
                sample_rate)
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        rate = sound.samplerate
        blocks = []
        while True:
            block = sound.read(65536, dtype="float32")
            if not len(block):
                break
            blocks.append(block.reshape(-1))
    return (np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)), rate


def g711_decode(codes: np.ndarray, name: str) -> np.ndarray:
    """G.711 mu-law or A-law bytes -> float samples (the standard's expansion)."""
    if name == "mulaw":
        value = ~codes.astype(np.int32) & 0xFF
        exponent, mantissa = (value >> 4) & 0x07, value & 0x0F
        magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
        linear = np.where(value & 0x80, -magnitude, magnitude)
    else:
        value = codes.astype(np.int32) ^ 0x55
        exponent, mantissa = (value >> 4) & 0x07, value & 0x0F
        magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
        linear = np.where(value & 0x80, magnitude, -magnitude)
    return (linear / 32768.0).astype(np.float32)


def result_from_chunks(chunks: list[AudioStreamChunk], encoding: int | None = None) -> SynthesisResult:
    """The whole synthesis from a complete stream (audio chunks then the final chunk)."""
    final = chunks[-1]
    data = b"".join(chunk.data for chunk in chunks[:-1])
    name = next((n for n, e in STREAM_ENCODINGS.items() if e == encoding), None)
    rate = final.sample_rate
    if name is not None:
        samples, rate = decode_stream(data, name, rate, sum(chunk.num_samples for chunk in chunks[:-1]))
    else:
        audio = [chunk.samples for chunk in chunks[:-1]]
        samples = np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
    return SynthesisResult(samples=samples, sample_rate=rate, usage=final.usage,
                           stop_reason=final.stop_reason, request_id=final.request_id,
                           words=tuple(word for chunk in chunks[:-1] for word in chunk.words),
                           data=data if name is not None else b"")

"""Streaming audio encoders: float samples in, the bytes of an encoded stream out, chunk by chunk.

Every format gives its bytes as soon as it has them: no format waits for the end of the audio.

| name    | what                                              | media type        |
|---------|---------------------------------------------------|-------------------|
| pcm     | 16-bit little-endian mono, no header              | audio/pcm         |
| float32 | 32-bit float little-endian mono, no header        | audio/pcm         |
| wav     | one RIFF header (sizes 0xFFFFFFFF: streaming), PCM16 | audio/wav      |
| mp3     | MPEG audio (LAME), 64 kbit/s mono                 | audio/mpeg        |
| opus    | Opus in Ogg (48 kHz inside), 20 ms pages          | audio/ogg         |
| aac     | AAC-LC in ADTS frames                             | audio/aac         |
| flac    | FLAC, lossless                                    | audio/flac        |
| mulaw   | G.711 mu-law bytes, no header (telephony: 8 kHz)  | audio/basic       |
| alaw    | G.711 A-law bytes, no header (telephony: 8 kHz)   | audio/x-alaw-basic |

The compressed formats come from FFmpeg's codecs through PyAV (``av`` on PyPI), which resamples to
what a codec takes (Opus: 48 kHz inside the stream; the decoded rate is the stream's). pcm, wav,
mu-law and A-law are written here with numpy.
"""

from __future__ import annotations

import io
import struct

import numpy as np

#: Formats whose bytes are PCM samples (their byte count is a whole number of samples).
RAW_FORMATS = {"pcm": 2, "float32": 4, "mulaw": 1, "alaw": 1}
MEDIA_TYPES = {"pcm": "audio/pcm", "float32": "audio/pcm", "wav": "audio/wav", "mp3": "audio/mpeg",
               "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "mulaw": "audio/basic",
               "alaw": "audio/x-alaw-basic"}
FORMATS = tuple(MEDIA_TYPES)
#: (PyAV codec, container, codec sample rate or None for the stream's) of the compressed formats.
_CODECS = {"mp3": ("libmp3lame", "mp3", None), "opus": ("libopus", "ogg", 48000), "aac": ("aac", "adts", None),
           "flac": ("flac", "flac", None)}
#: Formats a response that is not a live stream sends as one complete file: FLAC's STREAMINFO must
#: hold the length (libsndfile, soundfile's library, cannot read a FLAC stream without it).
WHOLE_FILE_FORMATS = {"flac"}
#: Sample rates the compressed formats' codecs take (others are refused up front).
CODEC_RATES = {"mp3": {8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000},
               "aac": {8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000}}


def pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


def mulaw(samples: np.ndarray) -> bytes:
    """G.711 mu-law (the segment/mantissa form of the standard, on 14-bit magnitudes)."""
    value = pcm16(samples).astype(np.int32) >> 2  # 14-bit
    sign = np.where(value < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(value), 8158) + 33
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 5
    mantissa = (magnitude >> (exponent + 1)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def alaw(samples: np.ndarray) -> bytes:
    """G.711 A-law (13-bit magnitudes, even bits inverted)."""
    value = pcm16(samples).astype(np.int32) >> 3  # 13-bit
    sign = np.where(value >= 0, 0x80, 0)
    magnitude = np.minimum(np.abs(value), 4095)
    exponent = np.where(magnitude < 32, 0, np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4)
    mantissa = np.where(exponent == 0, magnitude >> 1, magnitude >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8).tobytes()


def wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono RIFF header for a stream of unknown length (sizes 0xFFFFFFFF: players read on
    to the end of the stream)."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", 0xFFFFFFFF))


class _Sink(io.RawIOBase):
    """Where PyAV's muxer writes: collects the bytes until they are taken (not seekable, so no
    muxer goes back to rewrite a header that has already been sent)."""

    def __init__(self):
        super().__init__()
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def encode_whole(name: str, samples: np.ndarray, sample_rate: int) -> bytes:
    """One complete file of ``samples``: every header holds the real length (the container is
    written into a seekable buffer, so its muxer goes back to fill in what a stream leaves open)."""
    samples = np.asarray(samples, dtype=np.float32)
    if name not in _CODECS:
        if name == "wav":
            data = pcm16(samples).tobytes()
            return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " +
                    struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
                    b"data" + struct.pack("<I", len(data)) + data)
        encoder = StreamEncoder(name, sample_rate)
        return encoder.encode(samples) + encoder.finish()
    import av

    codec, container_format, rate = _CODECS[name]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate or sample_rate)
        stream.layout = "mono"
        if samples.size:
            frame = av.AudioFrame.from_ndarray(pcm16(samples)[None, :], format="s16", layout="mono")
            frame.sample_rate, frame.pts = sample_rate, 0
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


class StreamEncoder:
    """``encode(samples)`` -> the bytes ready so far; ``finish()`` -> the rest. Samples are float32
    mono in [-1, 1] at ``sample_rate``."""

    def __init__(self, name: str, sample_rate: int):
        if name not in MEDIA_TYPES:
            raise ValueError(f"unknown audio format {name!r} (known: {', '.join(FORMATS)})")
        rates = CODEC_RATES.get(name)
        if rates is not None and sample_rate not in rates:
            raise ValueError(f"{name} does not take {sample_rate} Hz (it takes {', '.join(map(str, sorted(rates)))})")
        self.name = name
        self.sample_rate = sample_rate
        self.media_type = MEDIA_TYPES[name]
        self._started = False
        self._container = self._stream = None
        self._pts = 0
        if name in _CODECS:
            import av

            codec, container, rate = _CODECS[name]
            self._sink = _Sink()
            options = {"page_duration": "20000"} if container == "ogg" else {}
            self._container = av.open(self._sink, mode="w", format=container, options=options)
            self._stream = self._container.add_stream(codec, rate=rate or sample_rate)
            self._stream.layout = "mono"
            if name == "mp3":
                self._stream.bit_rate = 64000

    def encode(self, samples: np.ndarray) -> bytes:
        samples = np.asarray(samples, dtype=np.float32)
        head = b""
        if not self._started:
            self._started = True
            head = wav_header(self.sample_rate) if self.name == "wav" else b""
        if self.name in ("pcm", "wav"):
            return head + pcm16(samples).tobytes()
        if self.name == "float32":
            return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
        if self.name == "mulaw":
            return mulaw(samples)
        if self.name == "alaw":
            return alaw(samples)
        return self._encode_av(samples)

    def _encode_av(self, samples: np.ndarray | None) -> bytes:
        import av

        if samples is None:
            packets = self._stream.encode(None)
        else:
            if samples.size == 0:
                return b""
            frame = av.AudioFrame.from_ndarray(pcm16(samples)[None, :], format="s16", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            self._pts += samples.size
            packets = self._stream.encode(frame)
        for packet in packets:
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        """The bytes the codec still holds, and the container's end."""
        if self._container is None:
            return b"" if self._started or self.name != "wav" else self.encode(np.zeros(0, np.float32))
        out = self._encode_av(None)
        self._container.close()
        self._container = None
        return out + self._sink.take()

    def close(self) -> None:
        """Releases the codec without finishing the stream (the client went away)."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - a half-written stream may fail to close; nothing to keep
                pass
            self._container = None

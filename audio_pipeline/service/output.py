"""Per-stream audio output: resampling to the requested rate and encoding (PCM16, float32, or an
encoded stream: WAV, MP3, Opus, AAC, FLAC, mu-law, A-law; audio/encoders.py)."""

from __future__ import annotations

import numpy as np
import soxr

from audio_pipeline.audio.encoders import StreamEncoder
from audio_pipeline.errors import InvalidArgument
from audio_pipeline_client._proto import tts_pb2

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000
#: Encodings whose bytes are raw samples of a fixed width.
PCM_ENCODINGS = {tts_pb2.AUDIO_ENCODING_UNSPECIFIED: tts_pb2.AUDIO_ENCODING_PCM16,
                 tts_pb2.AUDIO_ENCODING_PCM16: tts_pb2.AUDIO_ENCODING_PCM16,
                 tts_pb2.AUDIO_ENCODING_FLOAT32: tts_pb2.AUDIO_ENCODING_FLOAT32}
#: Encodings made by a stream encoder, by its format name.
STREAM_ENCODINGS = {tts_pb2.AUDIO_ENCODING_WAV: "wav", tts_pb2.AUDIO_ENCODING_MP3: "mp3",
                    tts_pb2.AUDIO_ENCODING_OPUS: "opus", tts_pb2.AUDIO_ENCODING_AAC: "aac",
                    tts_pb2.AUDIO_ENCODING_FLAC: "flac", tts_pb2.AUDIO_ENCODING_MULAW: "mulaw",
                    tts_pb2.AUDIO_ENCODING_ALAW: "alaw"}
#: The telephony encodings' rate when the request names none.
TELEPHONY_RATE = 8000


class StreamAudioOutput:
    """Turns a stream's native-rate float chunks into encoded bytes at the requested rate.

    The resampler keeps its filter state across chunks, so seams stay continuous; ``finish()``
    flushes the samples it still holds, and ``close()`` the encoder's last bytes.
    """

    def __init__(self, native_rate: int, requested_rate: int, encoding: int):
        if requested_rate and not MIN_SAMPLE_RATE <= requested_rate <= MAX_SAMPLE_RATE:
            raise InvalidArgument(f"{requested_rate} Hz is not supported; use 0 (native {native_rate} Hz) or "
                                  f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}", field="sample_rate")
        if encoding not in PCM_ENCODINGS and encoding not in STREAM_ENCODINGS:
            raise InvalidArgument(f"unknown encoding {encoding}", field="encoding")
        name = STREAM_ENCODINGS.get(encoding)
        default_rate = TELEPHONY_RATE if name in ("mulaw", "alaw") else native_rate
        self.sample_rate = requested_rate or default_rate
        self.encoding = PCM_ENCODINGS.get(encoding, encoding)
        self._encoder = None
        if name is not None:
            try:
                self._encoder = StreamEncoder(name, self.sample_rate)
            except ValueError as error:
                raise InvalidArgument(str(error), field="sample_rate") from None
        self._resampler = (soxr.ResampleStream(native_rate, self.sample_rate, 1, dtype="float32", quality="HQ")
                           if self.sample_rate != native_rate else None)

    def convert(self, samples: np.ndarray, *, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        return samples

    def finish(self) -> np.ndarray:
        """Samples the resampler still holds (empty without resampling)."""
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        return self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)

    def encode(self, samples: np.ndarray) -> bytes:
        if self._encoder is not None:
            return self._encoder.encode(samples)
        clipped = np.clip(samples, -1.0, 1.0)
        if self.encoding == tts_pb2.AUDIO_ENCODING_FLOAT32:
            return clipped.astype("<f4").tobytes()
        return np.round(clipped * 32767.0).astype("<i2").tobytes()

    def close(self) -> bytes:
        """The encoded stream's last bytes (the codec's held samples, the container's end)."""
        return self._encoder.finish() if self._encoder is not None else b""

    def release(self) -> None:
        """Frees the encoder without finishing the stream (the client went away)."""
        if self._encoder is not None:
            self._encoder.close()

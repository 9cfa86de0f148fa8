"""Per-stream audio output: resampling to the requested rate and encoding to PCM16 or float32 bytes."""

from __future__ import annotations

import numpy as np
import soxr

from audio_pipeline.errors import InvalidArgument
from audio_pipeline_client._proto import tts_pb2

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000
ENCODINGS = {tts_pb2.AUDIO_ENCODING_UNSPECIFIED: tts_pb2.AUDIO_ENCODING_PCM16,
             tts_pb2.AUDIO_ENCODING_PCM16: tts_pb2.AUDIO_ENCODING_PCM16,
             tts_pb2.AUDIO_ENCODING_FLOAT32: tts_pb2.AUDIO_ENCODING_FLOAT32}


class StreamAudioOutput:
    """Turns a stream's native-rate float chunks into encoded bytes at the requested rate.

    The resampler keeps its filter state across chunks, so seams stay continuous; ``finish()``
    flushes the samples it still holds.
    """

    def __init__(self, native_rate: int, requested_rate: int, encoding: int):
        if requested_rate and not MIN_SAMPLE_RATE <= requested_rate <= MAX_SAMPLE_RATE:
            raise InvalidArgument(f"{requested_rate} Hz is not supported; use 0 (native {native_rate} Hz) or "
                                  f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}", field="sample_rate")
        if encoding not in ENCODINGS:
            raise InvalidArgument(f"unknown encoding {encoding}", field="encoding")
        self.sample_rate = requested_rate or native_rate
        self.encoding = ENCODINGS[encoding]
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
        clipped = np.clip(samples, -1.0, 1.0)
        if self.encoding == tts_pb2.AUDIO_ENCODING_FLOAT32:
            return clipped.astype("<f4").tobytes()
        return np.round(clipped * 32767.0).astype("<i2").tobytes()

"""A stream's audio output: the engine's float chunks resampled to the requested rate and encoded
in the requested format (audio/encoders.py), chunk by chunk or as one complete file.

Formats are named as in audio/encoders.py (pcm, float32, wav, mp3, opus, aac, flac, mulaw, alaw);
each front door maps its own names (gRPC's enum, OpenAI's ``response_format``) to these.
"""

from __future__ import annotations

import numpy as np

from audio_pipeline.audio.encoders import FORMATS, MEDIA_TYPES, StreamEncoder, encode_whole
from audio_pipeline.audio.resample import StreamResampler
from audio_pipeline.errors import InvalidArgument, echo

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000
#: The telephony formats' rate when the request names none.
TELEPHONY_RATE = 8000
TELEPHONY_FORMATS = ("mulaw", "alaw")
#: Formats sent as one complete file on every door: FLAC's STREAMINFO must hold the length
#: (libsndfile, soundfile's library, cannot read a FLAC stream whose length is left unknown).
WHOLE_FILE_FORMATS = {"flac"}
#: Formats whose one header holds the length: a complete file unless the client plays the stream
#: as it comes (then the header says "unknown length", which players read on to the end).
LENGTH_HEADER_FORMATS = {"wav"}


def default_rate(format: str, native_rate: int) -> int:
    """The rate a request that names none gets: 8 kHz for telephony formats, else ``native_rate``."""
    return TELEPHONY_RATE if format in TELEPHONY_FORMATS else native_rate


class AudioOutput:
    """One stream's resampler and encoder.

    The resampler keeps its filter state across chunks, so seams stay continuous. Not thread-safe:
    the service calls one stream's output from one task at a time (off the event loop).
    """

    def __init__(self, native_rate: int, format: str, sample_rate: int = 0, *, streamed: bool = True):
        """``sample_rate`` 0 takes :func:`default_rate`; ``streamed``: the client plays the stream as
        it comes (a length-header format is then sent in its streaming form)."""
        if format not in FORMATS:
            raise InvalidArgument(f"{echo(str(format))} is not one of {', '.join(FORMATS)}", field="format")
        if sample_rate and not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
            raise InvalidArgument(f"{sample_rate} Hz is not supported; use 0 (the default) or "
                                  f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}", field="sample_rate")
        self.format = format
        self.media_type = MEDIA_TYPES[format]
        self.sample_rate = sample_rate or default_rate(format, native_rate)
        #: Sent as one complete file once the speech is done (its header holds the length).
        self.whole_file = format in WHOLE_FILE_FORMATS or (format in LENGTH_HEADER_FORMATS and not streamed)
        try:
            self._encoder = StreamEncoder(format, self.sample_rate)
        except ValueError as error:
            raise InvalidArgument(str(error), field="sample_rate") from None
        if self.whole_file:
            self._encoder.close()  # the file is written at the end, in one piece
        # A resampler that holds back a fixed 2 ms, not blocks: a stream's first chunks are short.
        self._resampler = StreamResampler(native_rate, self.sample_rate) if self.sample_rate != native_rate else None
        self._gathered: list[np.ndarray] = []

    def _convert(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._resampler is not None:
            samples = self._resampler.finish() if last else self._resampler.process(samples)
        return samples

    def chunk(self, samples: np.ndarray) -> tuple[bytes, int]:
        """(bytes to send now, samples they hold at the output rate) for native-rate ``samples``
        (no bytes for a whole-file output: it keeps them for :meth:`end`)."""
        converted = self._convert(samples)
        if self.whole_file:
            self._gathered.append(converted)
            return b"", converted.size
        return self._encoder.encode(converted) if converted.size else b"", converted.size

    def end(self) -> tuple[bytes, int]:
        """(the last bytes, the samples still held): the resampler's tail and the encoder's end,
        or the whole file."""
        tail = self._convert(np.zeros(0, dtype=np.float32), last=True) if self._resampler is not None \
            else np.zeros(0, dtype=np.float32)
        if self.whole_file:
            self._gathered.append(tail)
            samples, self._gathered = np.concatenate(self._gathered), []
            return encode_whole(self.format, samples, self.sample_rate), tail.size
        return (self._encoder.encode(tail) if tail.size else b"") + self._encoder.finish(), tail.size

    def release(self) -> None:
        """Frees the encoder without finishing the stream (the client went away)."""
        self._encoder.close()
        self._gathered = []

"""The values the client hands back: synthesis results, stream chunks, voices, usage, and TTSError."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np


@dataclass(frozen=True)
class Usage:
    """Figures the server reports for one finished synthesis (mirrors ``audio_pipeline.v1.Usage``)."""

    prompt_tokens: int
    generated_tokens: int
    audio_seconds: float
    time_to_first_audio_seconds: float
    generation_seconds: float


@dataclass(frozen=True)
class Voice:
    """A voice the server can speak with."""

    name: str
    description: str
    language: str
    is_default: bool
    #: Registered with register_voice (a cloned voice that can be deleted).
    registered: bool = False


@dataclass(frozen=True)
class WordTiming:
    """When one written word (or piece: "$5", "9:15") sounds in the stream's audio.

    ``text`` is ``request_text[text_start:text_end]`` (for ``stream_text``, offsets into all the
    pieces joined); the audio says ``spoken`` in samples [start_sample, end_sample) of the stream
    (its sample rate, counted from its first sample). ``precision`` is ``"word"`` where the model's
    own alignment timed this word (the built-in voice), ``"segment"`` where the timing covers a
    whole sentence or clause (models without an alignment).
    """

    text: str
    text_start: int
    text_end: int
    start_sample: int
    end_sample: int
    spoken: str
    precision: str
    sample_rate: int

    @property
    def start_seconds(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def end_seconds(self) -> float:
        return self.end_sample / self.sample_rate


@dataclass(frozen=True)
class AudioStreamChunk:
    """One item of ``TTSClient.stream``.

    Audio items come first (``index`` 0, 1, ..., ``final`` False). The stream then ends with exactly
    one extra item with ``final`` True, empty ``samples``, ``index`` equal to the number of audio items,
    and ``usage`` and ``stop_reason`` set. A separate final item (rather than marking the last audio
    item) means no audio is held back waiting for the completion message.
    """

    samples: np.ndarray
    sample_rate: int
    index: int
    final: bool = False
    usage: Usage | None = None
    stop_reason: str | None = None
    request_id: str = ""
    #: The words whose audio starts in this chunk (or, with ``"segment"`` precision, the segment
    #: whose audio just ended). A chunk may carry words and no samples.
    words: tuple[WordTiming, ...] = ()
    #: The chunk's bytes as sent. With an encoded stream (mp3, opus, aac, flac, wav, mulaw, alaw)
    #: these are the audio (the chunks' bytes joined are the file) and ``samples`` is empty.
    data: bytes = b""
    #: Samples this chunk was made from (of an encoded stream: the encoder may hold some back).
    num_samples: int = 0


@dataclass(frozen=True)
class SynthesisResult:
    """The whole audio of one synthesis: float32 mono samples in [-1, 1] whatever the wire encoding."""

    samples: np.ndarray
    #: The rate of ``samples``: the stream's, except Opus, which decodes at its own 48 kHz.
    sample_rate: int
    usage: Usage
    stop_reason: str
    request_id: str
    #: Every spoken word's timing, in text order (see WordTiming).
    words: tuple[WordTiming, ...] = ()
    #: With an encoded stream: the whole file (``samples`` is its decoded audio where this client
    #: can decode it: all but AAC).
    data: bytes = b""

    @property
    def duration_seconds(self) -> float:
        return self.samples.size / self.sample_rate


class TTSError(Exception):
    """A failed call: the gRPC status ``code`` and its ``details``. ``str()`` is one line, ``CODE: details``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code = code
        self.details = " ".join(details.split())
        super().__init__(f"{code.name}: {self.details}" if self.details else code.name)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> TTSError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")

    @classmethod
    def invalid_input(cls, what: str) -> TTSError:
        """Something the caller passed cannot be sent (an unreadable reference file, say)."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, what)

    @classmethod
    def protocol_violation(cls, what: str) -> TTSError:
        """The server broke the Synthesize stream contract (order, indices, sizes)."""
        return cls(grpc.StatusCode.INTERNAL, f"protocol violation: {what}")

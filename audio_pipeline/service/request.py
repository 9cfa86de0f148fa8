"""What every front door turns its request into, and the encoded events the service sends back."""

from __future__ import annotations

from dataclasses import dataclass, field

from audio_pipeline.core.stop import StopReason
from audio_pipeline.core.engine_core import Usage
from audio_pipeline.text.pronunciations import Lexicon
from audio_pipeline.text.timings import WordTiming


@dataclass(frozen=True)
class SpeechRequest:
    """One request for speech, whichever front door it came through (gRPC, HTTP, WebSocket, the
    in-process CLI). Nothing here is checked yet: the service checks it once."""

    #: The whole text (a live-text request leaves it empty: its text comes later).
    text: str = ""
    voice: str | None = None
    #: A recording (encoded bytes) and its transcript to clone the voice from, for this request.
    reference_audio: bytes | None = None
    reference_transcript: str = ""
    #: Read written forms as words (None: the server's normalize_text).
    normalize_text: bool | None = None
    #: Sampling fields the client set, by name (temperature, seed, max_tokens, stop_token_ids...).
    sampling: dict = field(default_factory=dict)
    #: Speaking rate (None: 1.0).
    speed: float | None = None
    #: How to speak: the voice's description for a model whose voices are descriptions (Maya1), or
    #: a style beside a preset voice (a layout that takes_instructions).
    instructions: str | None = None
    #: The language to speak: one of the model's languages in any usual spelling, or auto (the
    #: service resolves it: text/languages.py); None: the model's setting.
    language: str | None = None
    #: The text is an SSML document (True), plain text (False), or SSML if it starts with
    #: ``<speak`` (None).
    ssml: bool | None = None
    #: Pronunciations for this request (over the voice's).
    pronunciations: Lexicon = Lexicon()
    #: Output format (audio/encoders.py's names) and rate (0: the format's default).
    format: str = "pcm"
    sample_rate: int = 0
    #: Whether the client plays the audio as it comes (else a format whose header holds the length
    #: is sent as one complete file).
    streamed: bool = True
    #: The client's name for the request (its chunks and logs carry it); empty: the server's id.
    label: str = ""
    #: The request field that carries the label, for errors about it.
    label_field: str = "request_id"


@dataclass(frozen=True)
class SpeechAudio:
    """Encoded audio to send: ``data`` holds ``num_samples`` samples at the output rate (a
    compressed format's bytes may lag its samples), ``words`` the timings that start in them
    (samples on the output clock)."""

    data: bytes
    num_samples: int
    words: list[WordTiming]


@dataclass(frozen=True)
class SpeechDone:
    """The end of a request's speech: why it stopped, the engine's usage, and the samples sent."""

    stop_reason: StopReason
    usage: Usage
    #: Samples sent at the output rate.
    audio_samples: int
    sample_rate: int

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / self.sample_rate

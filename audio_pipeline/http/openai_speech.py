"""The OpenAI-compatible request and its errors: a /v1/audio/speech body (or a WebSocket utterance's
start) checked and mapped to the service's request, and a RequestError mapped to OpenAI's error
body and status. The HTTP routes (app.py) and the WebSocket (stream_socket.py) both use it."""

from __future__ import annotations

import json
import logging
import re

from starlette.responses import JSONResponse

from audio_pipeline.audio.encoders import FORMATS
from audio_pipeline.errors import (AlreadyExists, GenerationFailed, InvalidArgument, NotFound, RequestError,
                                   ResourceExhausted, Unavailable, echo)
from audio_pipeline.service.output import default_rate
from audio_pipeline.service.request import SpeechRequest
from audio_pipeline.text.pronunciations import from_entries

logger = logging.getLogger(__name__)

#: OpenAI's voice names: a client written for OpenAI gets the default voice (or the configured one).
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
#: The formats OpenAI documents, and this server's additions.
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm") + tuple(f for f in FORMATS if f not in
                                                                      ("mp3", "opus", "aac", "flac", "wav", "pcm"))
#: OpenAI's rate: its formats are 24 kHz (pcm is documented so); telephony formats are 8 kHz.
OPENAI_RATE = 24000
RETRY_AFTER_S = 1
STATUS = {InvalidArgument: 400, NotFound: 404, ResourceExhausted: 429, Unavailable: 503, AlreadyExists: 409,
          GenerationFailed: 500}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error", 500: "server_error"}
#: The service's field names as OpenAI's request names them.
FIELDS = {"text": "input", "format": "response_format", "sampling.seed": "seed"}
#: The body's fields: OpenAI's, then this server's extensions. Any other is named in the
#: X-Ignored-Fields header (a misspelt field is not silently dropped).
OPENAI_FIELDS = ("model", "input", "voice", "instructions", "response_format", "speed", "stream_format")
EXTENSION_FIELDS = ("stream", "sample_rate", "seed", "normalize_text", "language", "ssml", "pronunciations")
#: Unknown fields the header names at most (then how many more).
MAX_NAMED_FIELDS = 16
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: The header the ``openai`` package sends with ``with_streaming_response`` (it reads the body as it comes).
STREAMING_CLIENT_HEADER = ("x-stainless-raw-response", "stream")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "param": param, "code": code}}, status_code=status, headers=headers)


def error_fields(error: RequestError) -> tuple[str, str | None]:
    """(message, param) of an error, with the field named as OpenAI's request names it."""
    field = FIELDS.get(error.field, error.field) if error.field else None
    return (f"{field}: {error.detail}" if field else str(error)), field


def request_error(error: RequestError) -> JSONResponse:
    status = next((STATUS[cls] for cls in type(error).__mro__ if cls in STATUS), 500)
    return error_response(status, *error_fields(error))


def client_streams(body: dict, headers) -> bool:
    """Whether the client plays (or reads) the audio as it comes, so a WAV may come in its
    streaming form (one header of unknown length) instead of as one complete file: the body's
    ``stream`` (this server's extension) says so, else SSE does, else the ``openai`` package's
    streaming response. A plain request (``audio.speech.create``, curl -o) gets complete files."""
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise InvalidArgument("must be true or false", field="stream")
        return stream
    name, value = STREAMING_CLIENT_HEADER
    return body.get("stream_format") == "sse" or headers.get(name, "").lower() == value


def field_name(name: str) -> str:
    """A client's field name as a header may carry it: as sent where it is plain (letters, digits,
    ``_ . -``), else JSON-quoted in ASCII and cut to 40 characters (no control characters, no
    forged headers)."""
    return name if _PLAIN_NAME.fullmatch(name) else json.dumps(name[:40] + ("..." if len(name) > 40 else ""))


def ignored_header(ignored: list[str], unknown: list[str]) -> str | None:
    """The X-Ignored-Fields value: the known fields spoken past (``voice=alloy``, ``instructions``),
    then the unknown ones by name (at most MAX_NAMED_FIELDS, then ``+N more``); None: none."""
    named = [*ignored, *(field_name(name) for name in unknown[:MAX_NAMED_FIELDS])]
    if len(unknown) > MAX_NAMED_FIELDS:
        named.append(f"+{len(unknown) - MAX_NAMED_FIELDS} more")
    return ", ".join(named) or None


class OpenAISpeech:
    """A POST /v1/audio/speech body (or a WebSocket utterance's start): its types checked and
    mapped to the service's request; the values are the service's to check.

    Fields the request does not act on are listed, not refused (a client written for OpenAI keeps
    working): ``ignored`` holds the known ones spoken past (an OpenAI voice name this server does
    not have, spoken with the default voice: ``voice=alloy``; ``instructions`` for a model that
    takes none), ``unknown`` the fields neither OpenAI's request nor this server's extensions have
    (OPENAI_FIELDS, EXTENSION_FIELDS), a misspelling among them. POST /v1/audio/speech names both
    in its ``X-Ignored-Fields`` response header (:func:`ignored_header`). ``model`` is never
    listed: the server speaks with its one model whatever the request names."""

    def __init__(self, body, voices: list[str], default_voice: str | None, voice_map: dict[str, str],
                 headers=None, default_format: str = "mp3", takes_instructions: bool = False):
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object", field="body")
        text = body.get("input", "")
        if not isinstance(text, str):
            raise InvalidArgument("must be a string: the text to speak", field="input")
        model = body.get("model", "")
        if not isinstance(model, str):
            raise InvalidArgument("must be a string", field="model")
        voice = body.get("voice")
        if isinstance(voice, dict):  # OpenAI's custom-voice form: {"id": ...}
            voice = voice.get("id")
        if voice is not None and not isinstance(voice, str):
            raise InvalidArgument("must be a voice name", field="voice")
        #: Known fields spoken past, and fields this request does not have (both named in the
        #: X-Ignored-Fields header).
        self.ignored: list[str] = []
        self.unknown: list[str] = [name for name in body if name not in OPENAI_FIELDS and name not in EXTENSION_FIELDS]
        if voice in voice_map:
            voice = voice_map[voice]
        elif voice and voice not in voices and voice.lower() in OPENAI_VOICES:
            self.ignored.append(f"voice={voice}")  # spoken with the default voice
            voice = default_voice
        response_format = body.get("response_format", default_format)
        if response_format not in SPEECH_FORMATS:
            raise InvalidArgument(f"{echo(str(response_format))} is not one of {', '.join(SPEECH_FORMATS)}",
                                  field="response_format")
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise InvalidArgument(f"{echo(str(stream_format))} is not 'audio' or 'sse'", field="stream_format")
        self.sse = stream_format == "sse"
        speed = body.get("speed")
        if speed is not None and (not isinstance(speed, (int, float)) or isinstance(speed, bool)):
            raise InvalidArgument("must be a number", field="speed")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidArgument("must be a string", field="instructions")
        if instructions and not takes_instructions:
            self.ignored.append("instructions")  # a described voice (Maya1) or a style (Qwen3-TTS CustomVoice)
        rate = body.get("sample_rate")  # this server's extension
        if rate is not None and (not isinstance(rate, int) or isinstance(rate, bool)):
            raise InvalidArgument("must be a whole number of hertz", field="sample_rate")
        seed = body.get("seed")  # extension: the same seed and text, the same audio
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidArgument("must be a whole number, 0 or more", field="seed")
        normalize = body.get("normalize_text")  # extension
        if normalize is not None and not isinstance(normalize, bool):
            raise InvalidArgument("must be true or false", field="normalize_text")
        # extension: one of the model's languages (a name, an ISO 639 code, a BCP 47 tag) or auto;
        # the service refuses another
        language = body.get("language")
        if language is not None and not isinstance(language, str):
            raise InvalidArgument("must be a string", field="language")
        ssml = body.get("ssml")  # extension: the input is SSML (default: when it starts with <speak)
        if ssml is not None and not isinstance(ssml, bool):
            raise InvalidArgument("must be true or false", field="ssml")
        pronunciations = from_entries(body.get("pronunciations"))  # extension
        self.request = SpeechRequest(
            text=text, voice=voice or None, normalize_text=normalize, speed=speed, ssml=ssml,
            pronunciations=pronunciations,
            instructions=instructions if takes_instructions else None, language=language or None,
            sampling={} if seed is None else {"seed": seed}, format=response_format,
            sample_rate=rate or default_rate(response_format, OPENAI_RATE),
            streamed=client_streams(body, headers or {}))

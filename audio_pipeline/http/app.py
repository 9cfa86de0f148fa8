"""The HTTP front door: an OpenAI-compatible speech API beside gRPC, on the same engine.

Routes:
- ``POST /v1/audio/speech``: OpenAI's request (``model``, ``input``, ``voice``, ``response_format``,
  ``speed``, ``instructions`` (the voice's description for a Maya1 model), ``stream_format``); the
  audio streams as it is made, in chunked
  transfer (``stream_format: audio``) or as server-sent events (``sse``: ``speech.audio.delta``
  with base64 audio, then ``speech.audio.done`` with the usage). FLAC comes as one complete file
  once the speech is done (its header holds the length, which FLAC readers such as libsndfile need);
  so does WAV unless the client streams (see :func:`client_streams`).
- ``/v1/audio/stream``: a WebSocket for live text (http/stream_socket.py).
- ``GET /v1/models``, ``GET /v1/audio/voices``, ``GET /health`` (200 when serving, 503 otherwise:
  the gRPC health state), ``GET /metrics`` (Prometheus).

Requests go to the speech service (service/speech.py) as gRPC's do (the same limits, queue,
labels and metrics), and every error comes in OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}`` with 400, 401, 404, 413, 429 (with Retry-After) or 503. A client that goes
away mid-stream has its request cancelled at once.
"""

from __future__ import annotations

import base64
import json
import logging
from contextlib import aclosing

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from audio_pipeline.audio.encoders import FORMATS
from audio_pipeline.errors import (AlreadyExists, GenerationFailed, InvalidArgument, NotFound, RequestError,
                                   ResourceExhausted, Unavailable, echo)
from audio_pipeline.service.output import default_rate
from audio_pipeline.service.request import SpeechAudio, SpeechDone, SpeechRequest
from audio_pipeline.service.speech import SpeechStream, gather

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
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error", 500: "server_error"}
#: The service's field names as OpenAI's request names them.
FIELDS = {"text": "input", "format": "response_format", "sampling.seed": "seed"}
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


class OpenAISpeech:
    """A POST /v1/audio/speech body (or a WebSocket utterance's start): its types checked and
    mapped to the service's request; the values are the service's to check."""

    def __init__(self, body, voices: list[str], default_voice: str | None, voice_map: dict[str, str],
                 headers=None, default_format: str = "mp3", describes_voices: bool = False):
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
        #: Fields spoken past (named in the X-Ignored-Fields header).
        self.ignored: list[str] = []
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
        if instructions and not describes_voices:
            self.ignored.append("instructions")  # only a described-voice model (Maya1) speaks by them
        rate = body.get("sample_rate")  # this server's extension
        if rate is not None and (not isinstance(rate, int) or isinstance(rate, bool)):
            raise InvalidArgument("must be a whole number of hertz", field="sample_rate")
        seed = body.get("seed")  # extension: the same seed and text, the same audio
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidArgument("must be a whole number, 0 or more", field="seed")
        normalize = body.get("normalize_text")  # extension
        if normalize is not None and not isinstance(normalize, bool):
            raise InvalidArgument("must be true or false", field="normalize_text")
        self.request = SpeechRequest(
            text=text, voice=voice or None, normalize_text=normalize, speed=speed,
            instructions=instructions if describes_voices else None,
            sampling={} if seed is None else {"seed": seed}, format=response_format,
            sample_rate=rate or default_rate(response_format, OPENAI_RATE),
            streamed=client_streams(body, headers or {}))


def create_app(running) -> Starlette:
    """The ASGI app of a running server (``running``: server/app.py's RunningServer)."""
    service, engine = running.service, running.engine
    config = engine.config
    voice_map = dict(config.openai_voices)

    async def speech(request: Request) -> Response:
        limit = config.limits.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return error_response(413, f"the body is over the server's limit of {limit} bytes", "body")
        body = b""
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                return error_response(413, f"the body is over the server's limit of {limit} bytes", "body")
        try:
            parsed = json.loads(body or b"null")
        except ValueError as exc:
            return error_response(400, f"the body is not JSON: {exc}", "body")
        try:
            wanted = OpenAISpeech(parsed, [v.name for v in engine.voices], engine.manifest.default_voice,
                                  voice_map, request.headers, describes_voices=engine.describes_voices)
        except RequestError as error:
            service.count("invalid")
            return request_error(error)
        try:
            stream = await service.open(wanted.request)
        except RequestError as error:
            return request_error(error)
        headers = {"X-Request-Id": stream.request_id}
        if wanted.ignored:
            headers["X-Ignored-Fields"] = ", ".join(wanted.ignored)
        if stream.whole_file:
            return await _whole_file(stream, wanted.sse, headers)
        media_type = "text/event-stream" if wanted.sse else stream.output.media_type
        return StreamingResponse(_body(stream, wanted.sse), media_type=media_type, headers=headers)

    async def models(request: Request) -> Response:
        name = config.model.served_model_name or str(config.model.model_path)
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                         "owned_by": "audio-pipeline"}]})

    async def voices(request: Request) -> Response:
        default = engine.manifest.default_voice
        registered = {v.name for v in engine.registered_voices()}
        return JSONResponse({"voices": [{"name": v.name, "language": v.language, "description": v.description,
                                         "default": v.name == default, "registered": v.name in registered}
                                        for v in engine.voices]})

    async def health(request: Request) -> Response:
        serving = service.serving
        return JSONResponse({"status": "serving" if serving else "not_serving"}, status_code=200 if serving else 503)

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(running.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}", None, "not_found")

    async def method_not_allowed(request: Request, exc) -> Response:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}", None)

    auth = getattr(running.options, "auth", None)

    def authorized(handler):
        """The route behind the server's bearer tokens (as gRPC's: health and metrics stay open)."""
        if auth is None or not auth.enabled:
            return handler

        async def checked(request: Request) -> Response:
            from audio_pipeline.server.auth import bearer_token

            token = bearer_token([("authorization", request.headers.get("authorization", ""))])
            if token is None:
                return error_response(401, "missing bearer token (Authorization: Bearer <token>)", None,
                                      "invalid_api_key")
            if auth.role_of(token) is None:
                return error_response(401, "the bearer token is not valid", None, "invalid_api_key")
            return await handler(request)
        return checked

    async def stream_socket(websocket: WebSocket) -> None:
        from audio_pipeline.http.stream_socket import StreamSocket
        from audio_pipeline.server.auth import bearer_token

        if auth is not None and auth.enabled:
            token = bearer_token([("authorization", websocket.headers.get("authorization", ""))])
            if token is None or auth.role_of(token) is None:
                await websocket.close(code=1008, reason="missing or invalid bearer token")
                return
        await websocket.accept()
        await StreamSocket(websocket, running).run()

    speech, models, voices = authorized(speech), authorized(models), authorized(voices)
    routes = [Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute("/v1/audio/stream", stream_socket), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/audio/voices", voices, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})


async def _body(stream: SpeechStream, sse: bool):
    """The response body as it is made: audio bytes (or SSE events). A client that goes away has
    its request cancelled at once; a failure after the first bytes ends the body (SSE: an error
    event)."""
    try:
        async with aclosing(stream.events()) as events:
            async for event in events:
                if isinstance(event, SpeechAudio):
                    if event.data:
                        yield _sse(_delta(event.data)) if sse else event.data
                elif sse:
                    yield _sse(_done(event))
    except RequestError as error:
        message, param = error_fields(error)
        if sse:
            yield _sse({"type": "error", "error": {"message": message, "param": param}})
    finally:
        stream.close()


async def _whole_file(stream: SpeechStream, sse: bool, headers: dict[str, str]) -> Response:
    """The response of a whole-file output: sent once the speech is done, so a failure is an
    error response, not a short body."""
    try:
        data, done = await gather(stream)
    except RequestError as error:
        return request_error(error)
    finally:
        stream.close()
    if not sse:
        return Response(data, media_type=stream.output.media_type, headers=headers)
    return Response(_sse(_delta(data)) + _sse(_done(done)), media_type="text/event-stream", headers=headers)


def _delta(data: bytes) -> dict:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}


def _done(done: SpeechDone) -> dict:
    usage = done.usage
    return {"type": "speech.audio.done", "usage": {
        "input_tokens": usage.prompt_tokens, "output_tokens": usage.generated_tokens,
        "total_tokens": usage.prompt_tokens + usage.generated_tokens}}


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()

"""The HTTP front door: an OpenAI-compatible speech API beside gRPC, on the same engine.

Routes:
- ``POST /v1/audio/speech``: OpenAI's request (``model``, ``input``, ``voice``, ``response_format``,
  ``speed``, ``instructions``, ``stream_format``); the audio streams as it is made, in chunked
  transfer (``stream_format: audio``) or as server-sent events (``sse``: ``speech.audio.delta``
  with base64 audio, then ``speech.audio.done`` with the usage). FLAC comes as one complete file
  once the speech is done (its header holds the length, which FLAC readers such as libsndfile need).
- ``/v1/audio/stream``: a WebSocket for live text (http/stream_socket.py).
- ``GET /v1/models``, ``GET /v1/audio/voices``, ``GET /health`` (200 when serving, 503 otherwise:
  the gRPC health state), ``GET /metrics`` (Prometheus).

Requests go through the gRPC servicer's admission and synthesis (the same limits, queue,
labels and metrics), and every error comes in OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}`` with 400, 401, 404, 413, 429 (with Retry-After) or 503. A client that goes
away mid-stream has its request cancelled at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from contextlib import aclosing

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from audio_pipeline.audio.encoders import FORMATS, MEDIA_TYPES, WHOLE_FILE_FORMATS, StreamEncoder, encode_whole
from audio_pipeline.context import StopReason
from audio_pipeline.errors import (AlreadyExists, InvalidArgument, NotFound, RequestError, ResourceExhausted,
                                   Unavailable, echo)

logger = logging.getLogger(__name__)

#: OpenAI's voice names: a client written for OpenAI gets the default voice (or the configured one).
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
#: The formats OpenAI documents, and this server's additions.
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm") + tuple(f for f in FORMATS if f not in
                                                                      ("mp3", "opus", "aac", "flac", "wav", "pcm"))
#: OpenAI's rate: its formats are 24 kHz (pcm is documented so); telephony formats are 8 kHz.
OPENAI_RATE = 24000
TELEPHONY_RATE = 8000
RETRY_AFTER_S = 1
STATUS = {InvalidArgument: 400, NotFound: 404, ResourceExhausted: 429, Unavailable: 503, AlreadyExists: 409}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error", 500: "server_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "param": param, "code": code}}, status_code=status, headers=headers)


def request_error(error: RequestError) -> JSONResponse:
    status = STATUS.get(type(error), 500)
    return error_response(status, str(error), getattr(error, "field", None))


class SpeechRequest:
    """A validated POST /v1/audio/speech body."""

    def __init__(self, body: dict, voices: list[str], default_voice: str | None, voice_map: dict[str, str]):
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object", field="body")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument("is required: the text to speak", field="input")
        self.text = text
        model = body.get("model", "")
        if not isinstance(model, str):
            raise InvalidArgument("must be a string", field="model")
        self.model = model
        voice = body.get("voice")
        if isinstance(voice, dict):  # OpenAI's custom-voice form: {"id": ...}
            voice = voice.get("id")
        if voice is not None and not isinstance(voice, str):
            raise InvalidArgument("must be a voice name", field="voice")
        self.ignored: list[str] = []
        if voice in voice_map:
            voice = voice_map[voice]
        elif voice and voice not in voices and voice.lower() in OPENAI_VOICES:
            self.ignored.append(f"voice={voice}")  # spoken with the default voice
            voice = default_voice
        self.voice = voice or None
        response_format = body.get("response_format", "mp3")
        if response_format not in SPEECH_FORMATS:
            raise InvalidArgument(f"{echo(str(response_format))} is not one of {', '.join(SPEECH_FORMATS)}",
                                  field="response_format")
        self.response_format = response_format
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise InvalidArgument(f"{echo(str(stream_format))} is not 'audio' or 'sse'", field="stream_format")
        self.stream_format = stream_format
        speed = body.get("speed", 1.0)
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0.25 <= speed <= 4.0:
            raise InvalidArgument("must be a number from 0.25 to 4.0", field="speed")
        self.speed = float(speed)
        if body.get("instructions"):
            self.ignored.append("instructions")
        rate = body.get("sample_rate")  # this server's extension
        if rate is not None and (not isinstance(rate, int) or isinstance(rate, bool)):
            raise InvalidArgument("must be a whole number of hertz", field="sample_rate")
        self.sample_rate = rate or (TELEPHONY_RATE if response_format in ("mulaw", "alaw") else OPENAI_RATE)
        seed = body.get("seed")  # extension: the same seed and text, the same audio
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InvalidArgument("must be a whole number, 0 or more", field="seed")
        self.seed = seed


def create_app(running) -> Starlette:
    """The ASGI app of a running server (``running``: server/app.py's RunningServer)."""
    servicer, engine = running.servicer, running.engine
    config = engine.config
    voice_map = dict(config.openai_voices)

    async def speech(request: Request) -> Response:
        from audio_pipeline.service.output import StreamAudioOutput
        from audio_pipeline.server.servicer import SpeechSettings, outcome_of

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
            voices = [v.name for v in engine.voices]
            wanted = SpeechRequest(parsed, voices, engine.manifest.default_voice, voice_map)
            output = StreamAudioOutput(engine.sample_rate, wanted.sample_rate, 0)
            encoder = StreamEncoder(wanted.response_format, output.sample_rate)
        except RequestError as error:
            servicer.metrics.requests.labels("invalid").inc()
            return request_error(error)
        except ValueError as error:
            servicer.metrics.requests.labels("invalid").inc()
            return error_response(400, str(error), "sample_rate")
        try:
            request_id, label = servicer.admit("", "request_id")
        except RequestError as error:
            encoder.close()
            servicer.metrics.requests.labels(outcome_of(error)).inc()
            return request_error(error)
        overrides = {} if wanted.seed is None else {"seed": wanted.seed}
        try:
            with servicer.preparing():
                synthesis = await servicer.start_text(
                    wanted.text, SpeechSettings(voice=wanted.voice, overrides=overrides, speed=wanted.speed),
                    request_id)
        except RequestError as error:
            encoder.close()
            servicer.metrics.requests.labels(outcome_of(error)).inc()
            return request_error(error)
        headers = {"X-Request-Id": request_id}
        if wanted.ignored:
            headers["X-Ignored-Fields"] = ", ".join(wanted.ignored)
        sse = wanted.stream_format == "sse"
        if wanted.response_format in WHOLE_FILE_FORMATS:
            encoder.close()
            return await _whole_file(synthesis, output, wanted.response_format, servicer, request_id, sse, headers)
        chunks = _audio(synthesis, output, encoder, servicer, request_id, sse)
        media_type = "text/event-stream" if sse else encoder.media_type
        return StreamingResponse(chunks, media_type=media_type, headers=headers)

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
        serving = servicer.ready and engine.generation.healthy
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


async def _audio(synthesis, output, encoder: StreamEncoder, servicer, request_id: str, sse: bool):
    """The response body: encoded audio as it comes (or SSE events), the request cancelled if the
    client goes away."""
    finished = False
    try:
        async with aclosing(synthesis.events()) as events:
            async for event in events:
                if event.kind == "audio":
                    data = encoder.encode(output.convert(event.samples))
                elif event.kind == "complete":
                    finished = True
                    if event.stop_reason == StopReason.CANCELLED:
                        servicer.metrics.requests.labels("cancelled").inc()
                        return  # the server is shutting down: the body ends short
                    data = encoder.encode(output.finish()) + encoder.finish()
                else:
                    finished = True
                    servicer.metrics.requests.labels("failed").inc()
                    logger.error("request %s failed: %s", request_id, event.error)
                    if sse:
                        yield _sse({"type": "error", "error": {"message": event.error or "generation failed"}})
                    return
                if data:
                    yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
                if event.kind == "complete":
                    servicer.metrics.requests.labels("ok").inc()
                    if sse:
                        usage = event.usage
                        yield _sse({"type": "speech.audio.done", "usage": {
                            "input_tokens": usage.prompt_tokens, "output_tokens": usage.generated_tokens,
                            "total_tokens": usage.prompt_tokens + usage.generated_tokens}})
                    return
    except RequestError as error:  # a later segment that cannot be spoken
        finished = True
        servicer.metrics.requests.labels("invalid").inc()
        if sse:
            yield _sse({"type": "error", "error": {"message": str(error), "param": getattr(error, "field", None)}})
    finally:
        synthesis.cancel()  # a no-op once it completed; the client left otherwise
        encoder.close()
        if not finished:
            servicer.metrics.requests.labels("client_cancelled").inc()
            logger.info("request %s: the HTTP client went away; cancelled", request_id)


async def _whole_file(synthesis, output, response_format: str, servicer, request_id: str, sse: bool,
                      headers: dict[str, str]) -> Response:
    """The response of a whole-file format: the speech gathered, then encoded at once (off the
    event loop) into one file whose header holds its length. Nothing is sent before, so a failure
    is an error response, not a short body."""
    pieces = []
    try:
        async with aclosing(synthesis.events()) as events:
            async for event in events:
                if event.kind == "audio":
                    pieces.append(output.convert(event.samples))
                    continue
                if event.kind != "complete":
                    servicer.metrics.requests.labels("failed").inc()
                    logger.error("request %s failed: %s", request_id, event.error)
                    return error_response(500, event.error or "generation failed")
                if event.stop_reason == StopReason.CANCELLED:
                    servicer.metrics.requests.labels("cancelled").inc()
                    return error_response(503, "the server is shutting down; retry")
                pieces.append(output.finish())
                data = await asyncio.to_thread(encode_whole, response_format, np.concatenate(pieces),
                                               output.sample_rate)
                servicer.metrics.requests.labels("ok").inc()
                if not sse:
                    return Response(data, media_type=MEDIA_TYPES[response_format], headers=headers)
                usage = event.usage
                body = _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) + _sse(
                    {"type": "speech.audio.done", "usage": {
                        "input_tokens": usage.prompt_tokens, "output_tokens": usage.generated_tokens,
                        "total_tokens": usage.prompt_tokens + usage.generated_tokens}})
                return Response(body, media_type="text/event-stream", headers=headers)
    except RequestError as error:  # a later segment that cannot be spoken
        servicer.metrics.requests.labels("invalid").inc()
        return request_error(error)
    finally:
        synthesis.cancel()  # a no-op once it completed
    return error_response(500, "the speech ended without its completion")


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()

"""The HTTP front door: an OpenAI-compatible speech API beside gRPC, on the same engine.

Routes:
- ``POST /v1/audio/speech``: OpenAI's request (``model``, ``input``, ``voice``, ``response_format``,
  ``speed``, ``instructions`` (the voice's description for a Maya1 model), ``stream_format``) and
  this server's extensions (``stream``, ``sample_rate``, ``seed``, ``normalize_text``,
  ``language``, ``ssml``, ``pronunciations``). A field the request does not act on is not refused
  but named in the ``X-Ignored-Fields`` response header, comma-separated: a known one spoken past
  (``voice=alloy``: an OpenAI voice this server lacks, spoken with the default voice;
  ``instructions`` for a model that takes none), and any field neither OpenAI's request nor the
  extensions have, by name (a misspelt ``speeed``; a name with other than letters, digits,
  ``_ . -`` JSON-quoted). ``language`` names one of the model's languages in any usual spelling
  (``English``, ``en``, ``eng``, ``en-US``) or ``auto``; another is refused (400, ``param``
  ``language``, the message listing the supported ones). The audio streams as it is made, in chunked
  transfer (``stream_format: audio``) or as server-sent events (``sse``: ``speech.audio.delta``
  with base64 audio, then ``speech.audio.done`` with the usage). FLAC comes as one complete file
  once the speech is done (its header holds the length, which FLAC readers such as libsndfile need);
  so does WAV unless the client streams (see :func:`client_streams`).
- ``/v1/audio/stream``: a WebSocket for live text (http/stream_socket.py); the bearer token in its
  Authorization header, or (browsers) as its subprotocol ``bearer.<token>``.
- ``GET /``: the playground, a page to try the server in a browser (http/playground.py).
- ``GET /v1/models``, ``GET /v1/audio/voices``, ``GET /health`` (200 when serving, 503 otherwise:
  the gRPC health state), ``GET /metrics`` (Prometheus).
- ``POST /v1/audio/voices`` (a multipart form: ``name``, ``file``, ``transcript``, ``description``)
  and ``DELETE /v1/audio/voices/{name}``: cloned voices, as gRPC's RegisterVoice and DeleteVoice
  (http/voices.py); where the server has admin tokens, they need one.

Requests go to the speech service (service/speech.py) as gRPC's do (the same limits, queue,
labels and metrics), and every error comes in OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}`` with 400, 401, 403, 404, 409, 413, 429 (with Retry-After) or 503. A client that goes
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

from audio_pipeline.http.playground import routes as playground_routes
from starlette.websockets import WebSocket

from audio_pipeline.errors import RequestError
from audio_pipeline.http.openai_speech import (OpenAISpeech, error_fields, error_response, ignored_header,
                                               request_error)
from audio_pipeline.http.stream_socket import StreamSocket
from audio_pipeline.http.voices import voice_handlers
from audio_pipeline.service.auth import Role, bearer_token
from audio_pipeline.service.request import SpeechAudio, SpeechDone
from audio_pipeline.service.speech import SpeechStream, gather

logger = logging.getLogger(__name__)

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
            wanted = OpenAISpeech(parsed, [v.name for v in engine.voice_catalogue.listed], engine.manifest.default_voice,
                                  voice_map, request.headers, takes_instructions=engine.layout.acts_on_instructions)
        except RequestError as error:
            service.count("invalid")
            return request_error(error)
        try:
            stream = await service.open(wanted.request)
        except RequestError as error:
            return request_error(error)
        headers = {"X-Request-Id": stream.request_id}
        ignored = ignored_header(wanted.ignored, wanted.unknown)
        if ignored:
            headers["X-Ignored-Fields"] = ignored
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
        registered = {v.name for v in engine.voice_catalogue.registered()}
        return JSONResponse({"voices": [{"name": v.name, "language": v.language, "description": v.description,
                                         "default": v.name == default, "registered": v.name in registered}
                                        for v in engine.voice_catalogue.listed],
                             # extension: whether POST /v1/audio/voices can clone a voice here
                             "cloning": engine.voice_catalogue.can_clone})

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

    def authorized(handler, *, admin: bool = False):
        """The route behind the server's bearer tokens (as gRPC's: health and metrics stay open);
        with ``admin``, where the server has admin tokens, behind one of those (403 for a client's)."""
        if auth is None or not auth.enabled:
            return handler
        needs_admin = admin and bool(auth.admin)

        async def checked(request: Request) -> Response:
            token = bearer_token([("authorization", request.headers.get("authorization", ""))])
            if token is None:
                return error_response(401, "missing bearer token (Authorization: Bearer <token>)", None,
                                      "invalid_api_key")
            role = auth.role_of(token)
            if role is None:
                return error_response(401, "the bearer token is not valid", None, "invalid_api_key")
            if needs_admin and role is not Role.ADMIN:
                return error_response(403, "registering and deleting voices needs an admin token", None,
                                      "permission_denied")
            return await handler(request)
        return checked

    async def stream_socket(websocket: WebSocket) -> None:
        # A browser cannot set a WebSocket's headers: it may offer the token as the subprotocol
        # "bearer.<token>" instead (the playground does), which the accept then echoes.
        offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        chosen = next((p for p in offered if p.startswith("bearer.")), None)
        if auth is not None and auth.enabled:
            token = bearer_token([("authorization", websocket.headers.get("authorization", ""))])
            if token is None and chosen is not None:
                token = chosen[len("bearer."):]
            if token is None or auth.role_of(token) is None:
                # Accepted, then closed with the reason: a browser sees a refused handshake only as
                # "closed (1006)", but it reads a close frame's code and reason.
                await websocket.accept(subprotocol=chosen)
                await websocket.close(code=1008, reason="missing or invalid bearer token")
                return
        await websocket.accept(subprotocol=chosen)
        await StreamSocket(websocket, running).run()

    speech, models, voices = authorized(speech), authorized(models), authorized(voices)
    register_voice, delete_voice = (authorized(handler, admin=True) for handler in voice_handlers(running))
    routes = [Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute("/v1/audio/stream", stream_socket), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/audio/voices", voices, methods=["GET"]),
              Route("/v1/audio/voices", register_voice, methods=["POST"]),
              Route("/v1/audio/voices/{name}", delete_voice, methods=["DELETE"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]), *playground_routes]
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

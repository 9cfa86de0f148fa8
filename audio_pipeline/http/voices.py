"""Voices over HTTP: register a cloned voice from a recording, and delete one.

``POST /v1/audio/voices`` takes a multipart form: ``name``, ``file`` (the recording: WAV, FLAC,
OGG...), ``transcript`` (what is said in it) and an optional ``description``; it answers 201 with
the voice. ``DELETE /v1/audio/voices/{name}`` deletes one. The limits, checks and errors are the
gRPC registration's (the engine's ``register_voice``, off the event loop), in OpenAI's error shape
with the field named as the form names it; where the server has admin tokens, both need one
(403 for a client token), as RegisterVoice and DeleteVoice do.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from audio_pipeline.errors import InvalidArgument, RequestError, Unavailable
from audio_pipeline.http.openai_speech import error_response, request_error

logger = logging.getLogger(__name__)

#: The registration's field names as the form names them.
FORM_FIELDS = {"reference.audio": "file", "reference.transcript": "transcript"}
#: Parts a registration form may have (a stranger's form is not parsed past this).
MAX_FORM_FIELDS = 8


def _form_error(error: RequestError) -> RequestError:
    """``error`` naming the form's field instead of the gRPC request's."""
    if error.field in FORM_FIELDS:
        renamed = type(error)(error.detail, field=FORM_FIELDS[error.field])
        return renamed
    return error


def voice_handlers(running):
    """(register, delete) route handlers of a running server."""
    service, engine = running.service, running.engine
    limits = engine.config.limits

    async def read_form(request: Request):
        """The form, its body read within limits.max_message_bytes (a recording rides in it)."""
        limit = limits.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None, error_response(413, f"the body is over the server's limit of {limit} bytes", "body")
        body = b""
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                return None, error_response(413, f"the body is over the server's limit of {limit} bytes", "body")
        request._body = body  # the form parser reads the body from here
        try:
            return await request.form(max_files=1, max_fields=MAX_FORM_FIELDS), None
        except Exception as exc:  # noqa: BLE001 - any malformed form is the client's
            return None, error_response(400, f"the body is not a multipart form: {exc}", "body")

    async def register(request: Request) -> Response:
        if not service.ready:
            return request_error(Unavailable("the server is shutting down; retry on another replica"
                                             if service.draining else "the server is warming up; retry shortly"))
        form, refused = await read_form(request)
        if refused is not None:
            return refused
        upload = form.get("file")
        try:
            if not isinstance(upload, UploadFile):
                raise InvalidArgument("is required: the recording, as a file part of the form", field="file")
            fields = {}
            for name in ("name", "transcript", "description"):
                value = form.get(name, "")
                if not isinstance(value, str):
                    raise InvalidArgument("must be a text field of the form, not a file", field=name)
                fields[name] = value
            audio = await upload.read()
            voice = await asyncio.get_running_loop().run_in_executor(
                None, engine.voice_catalogue.register, fields["name"], audio, fields["transcript"], fields["description"])
        except RequestError as error:
            return request_error(_form_error(error))
        finally:
            await form.close()
        logger.info("registered voice %s over HTTP (%d speech codes)", voice.name, voice.prompt.codes.numel())
        return JSONResponse({"name": voice.name, "description": voice.description, "language": voice.language,
                             "registered": True}, status_code=201)

    async def delete(request: Request) -> Response:
        name = request.path_params["name"]
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.voice_catalogue.delete, name)
        except RequestError as error:
            return request_error(error)
        logger.info("deleted voice %s over HTTP", name)
        return JSONResponse({"name": name, "deleted": True})

    return register, delete

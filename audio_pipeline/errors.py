"""Request errors with the field they concern; the server maps each class to a gRPC status code."""

from __future__ import annotations


class RequestError(Exception):
    """A request the engine will not run. ``field`` names the offending request field, if any."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        #: The message without the field's name (a front door that names the field otherwise).
        self.detail = message


class InvalidArgument(RequestError):
    """A field is malformed or out of range (gRPC INVALID_ARGUMENT)."""


class NotFound(RequestError):
    """A named thing (voice) does not exist (gRPC NOT_FOUND)."""


class ResourceExhausted(RequestError):
    """The request queue is full (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(RequestError):
    """The engine is not accepting work: warming up or shutting down (gRPC UNAVAILABLE)."""


class AlreadyExists(RequestError):
    """A name to create is taken (gRPC ALREADY_EXISTS)."""


class ServerCancelled(Unavailable):
    """The server stopped the request (shutting down); another replica may serve it (UNAVAILABLE)."""


class GenerationFailed(RequestError):
    """The engine failed while generating the request's speech (gRPC INTERNAL, HTTP 500)."""


def error_of_kind(kind: str | None, message: str) -> RequestError:
    """The request error of class name ``kind`` (as an engine event or another process names it);
    GenerationFailed for None or a name that is not a request error."""
    found = globals().get(kind or "")
    if isinstance(found, type) and issubclass(found, RequestError):
        return found(message)
    return GenerationFailed(message)


def echo(value: str, limit: int = 40) -> str:
    """A client-sent string as it may appear in an error or a log line: quoted, control characters
    escaped (no forged log lines) and cut to ``limit`` characters (no huge echoes)."""
    text = value if len(value) <= limit else value[:limit] + "..."
    return repr(text)

"""Bearer-token authentication: who may call the server, and who may change its registered voices.

Tokens come from files (``--auth-token-file``, ``--admin-token-file``: one token a line, blank lines
and ``#`` comments ignored) and from the environment (``AUDIO_PIPELINE_AUTH_TOKENS``,
``AUDIO_PIPELINE_ADMIN_TOKENS``: comma-separated); a server accepts the union of both sources.

- With client tokens, every RPC needs ``authorization: Bearer <token>`` metadata holding a client or
  admin token, except the gRPC health and reflection services (load balancers and tools probe them
  without credentials).
- With admin tokens, RegisterVoice and DeleteVoice need an admin token: a valid client token gets
  PERMISSION_DENIED. With admin tokens only, the other RPCs stay open.

A missing and a wrong token get the same answer (UNAUTHENTICATED), so a caller cannot probe which
tokens exist; presented tokens are compared with every configured one in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import grpc

from audio_pipeline_client._proto import tts_pb2

AUTH_TOKENS_ENVIRONMENT = "AUDIO_PIPELINE_AUTH_TOKENS"
ADMIN_TOKENS_ENVIRONMENT = "AUDIO_PIPELINE_ADMIN_TOKENS"
_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
#: RPCs that change what the server keeps; admin tokens guard them.
ADMIN_METHODS = frozenset({f"/{_SERVICE}/RegisterVoice", f"/{_SERVICE}/DeleteVoice"})
#: Services open to everyone: health checks and service discovery carry no audio and no voices.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                         "/grpc.reflection.v1.ServerReflection/")
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


class Role(Enum):
    CLIENT = "client"
    ADMIN = "admin"


def parse_tokens(lines: Iterable[str], source: str) -> list[str]:
    """Tokens of a file or variable; ValueError naming ``source`` and the line (never the token)."""
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        # A token travels as a gRPC metadata value: visible ASCII only, and no spaces inside it.
        if not all("!" <= ch <= "~" for ch in token):
            raise ValueError(f"{source}: token {number} has characters other than visible ASCII")
        tokens.append(token)
    return tokens


def load_tokens(file: str | None, environment_value: str | None, *, flag: str, variable: str) -> frozenset[str]:
    """The union of the tokens of ``file`` and of the comma-separated ``environment_value``.

    A file given but holding no token is an error: it would leave the server open by mistake.
    """
    tokens: list[str] = []
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{flag}: cannot read {file}: {reason or exc}") from None
        from_file = parse_tokens(text.splitlines(), f"{flag} {file}")
        if not from_file:
            raise ValueError(f"{flag}: {file} holds no token (one a line; '#' starts a comment)")
        tokens += from_file
    if environment_value:
        tokens += parse_tokens(environment_value.split(","), f"environment variable {variable}")
    return frozenset(tokens)


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's time independent of the token's length too.
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class AuthTokens:
    """The accepted tokens; both empty = no authentication."""

    client: frozenset[str] = frozenset()
    admin: frozenset[str] = frozenset()

    @classmethod
    def load(cls, token_file: str | None = None, admin_token_file: str | None = None,
             environ: Mapping[str, str] | None = None) -> AuthTokens:
        environ = os.environ if environ is None else environ
        return cls(load_tokens(token_file, environ.get(AUTH_TOKENS_ENVIRONMENT), flag="--auth-token-file",
                               variable=AUTH_TOKENS_ENVIRONMENT),
                   load_tokens(admin_token_file, environ.get(ADMIN_TOKENS_ENVIRONMENT), flag="--admin-token-file",
                               variable=ADMIN_TOKENS_ENVIRONMENT))

    @property
    def enabled(self) -> bool:
        return bool(self.client or self.admin)

    def required_role(self, method: str) -> Role | None:
        """What a call of ``method`` (``/package.Service/Method``) needs; None = open to everyone."""
        if method.startswith(OPEN_SERVICE_PREFIXES):
            return None
        if method in ADMIN_METHODS and self.admin:
            return Role.ADMIN
        return Role.CLIENT if self.client else None

    def role_of(self, presented: str) -> Role | None:
        """The role ``presented`` grants, None when it is no configured token.

        Every configured token is compared (no early exit), so the time taken does not tell which
        token, or how many, came close.
        """
        digest = _digest(presented)
        is_admin = False
        is_client = False
        for token in self.admin:
            is_admin |= hmac.compare_digest(_digest(token), digest)
        for token in self.client:
            is_client |= hmac.compare_digest(_digest(token), digest)
        if is_admin:
            return Role.ADMIN
        return Role.CLIENT if is_client else None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry; None when there is none."""
    for key, value in metadata or ():
        if key != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers ``code`` without reading the request.

    No deserializer: a stranger's request is never parsed.
    """
    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's bearer token against ``tokens`` before the servicer sees the request."""

    def __init__(self, tokens: AuthTokens):
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        required = self.tokens.required_role(handler_call_details.method)
        handler = await continuation(handler_call_details)
        if required is None or handler is None:  # open, or an unknown method (UNIMPLEMENTED as usual)
            return handler
        presented = bearer_token(handler_call_details.invocation_metadata)
        role = self.tokens.role_of(presented) if presented is not None else None
        if role is None:
            return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        if required is Role.ADMIN and role is not Role.ADMIN:
            method = handler_call_details.method.rsplit("/", 1)[-1]
            return _denying_handler(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin token")
        return handler

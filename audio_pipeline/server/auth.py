"""Bearer-token authentication on gRPC: who may call the server, and who may change its registered
voices (the tokens themselves: service/auth.py).

- With client tokens, every RPC needs ``authorization: Bearer <token>`` metadata holding a client or
  admin token, except the gRPC health and reflection services (load balancers and tools probe them
  without credentials).
- With admin tokens, RegisterVoice and DeleteVoice need an admin token: a valid client token gets
  PERMISSION_DENIED. With admin tokens only, the other RPCs stay open.

A missing and a wrong token get the same answer (UNAUTHENTICATED), so a caller cannot probe which
tokens exist; presented tokens are compared with every configured one in constant time.
"""

from __future__ import annotations

import grpc

from audio_pipeline.service.auth import AuthTokens, Role, bearer_token
from audio_pipeline_client._proto import tts_pb2

_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
#: RPCs that change what the server keeps; admin tokens guard them.
ADMIN_METHODS = frozenset({f"/{_SERVICE}/RegisterVoice", f"/{_SERVICE}/DeleteVoice"})
#: Services open to everyone: health checks and service discovery carry no audio and no voices.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                         "/grpc.reflection.v1.ServerReflection/")
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


def required_role(tokens: AuthTokens, method: str) -> Role | None:
    """What a call of ``method`` (``/package.Service/Method``) needs; None = open to everyone."""
    if method.startswith(OPEN_SERVICE_PREFIXES):
        return None
    if method in ADMIN_METHODS and tokens.admin:
        return Role.ADMIN
    return Role.CLIENT if tokens.client else None



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
        required = required_role(self.tokens, handler_call_details.method)
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

"""Bearer-token check for the ssd.v1 API; health and reflection stay open.

Probes (load balancers, Kubernetes) and grpcurl's discovery carry no
credentials, and neither reveals anything a token should protect.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable

import grpc

OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying(handler)

    def _authorized(self, metadata: Any) -> bool:
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        # Constant time: the comparison must not leak how much of a guess was right.
        return hmac.compare_digest(given, self._expected)


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: expected 'Bearer <token>'")


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(_deny, **kwargs)

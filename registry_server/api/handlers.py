"""Wrapping a gRPC method handler's behaviour, for server interceptors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

Unary = Callable[[Any, grpc.ServicerContext], Any]
Stream = Callable[[Any, grpc.ServicerContext], Iterator[Any]]


def rewrap(
    handler: grpc.RpcMethodHandler[Any, Any] | None,
    wrap_unary: Callable[[Unary], Unary],
    wrap_stream: Callable[[Stream], Stream],
) -> grpc.RpcMethodHandler[Any, Any] | None:
    """The same handler with its unary-unary or unary-stream behaviour wrapped
    (this service has no client-streaming methods; others pass through)."""
    if handler is None:
        return None
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap_unary(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


def refuse(
    handler: grpc.RpcMethodHandler[Any, Any],
    code: grpc.StatusCode,
    message: str,
    before: Callable[[Any, grpc.ServicerContext], None] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as ``handler`` that aborts every call
    (``before`` is told of each first: the refusal's record)."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        if before is not None:
            before(request, context)
        context.abort(code, message)

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        if getattr(handler, kind) is not None:
            built: grpc.RpcMethodHandler[Any, Any] = make(
                deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
            return built
    raise ValueError("a handler with no behaviour")

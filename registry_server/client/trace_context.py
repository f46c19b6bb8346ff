"""Trace context on every call a client makes.

Each RPC becomes a CLIENT span under the caller's current span, and its W3C
``traceparent`` travels as gRPC metadata, so a server with tracing on continues
the caller's trace. With no OpenTelemetry SDK in the process the span records
nothing, but the caller's current context (if any) is still passed on.

Written on grpc's own interceptor interface rather than taken from the
OpenTelemetry gRPC instrumentation, whose client interceptor hands back
streams wrapped in a generator: no ``cancel()``, and a span context attached
in one read and detached in another, which breaks a stream read from
several threads. Here the caller gets grpc's own call objects back and the
span ends when the call terminates.
"""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

tracer = trace.get_tracer("toolreg.client")


class TraceContext(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def _start(self, details: Any) -> tuple[Span, Any]:
        method = str(details.method)
        service, _, name = method.lstrip("/").partition("/")
        span = tracer.start_span(
            method,
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = [*(details.metadata or ()), *carrier.items()]
        return span, details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        try:
            outcome = continuation(details, request)
        except BaseException:
            span.end()
            raise
        outcome.add_done_callback(lambda done: _end(span, done))
        return outcome

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        try:
            call = continuation(details, request)
        except BaseException:
            span.end()
            raise
        call.add_callback(lambda: _end(span, call))
        return call


def _end(span: Span, call: Any) -> None:
    """Called once the RPC has terminated, so ``code()`` does not wait."""
    code = call.code()
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()

"""Spans for the parts of a call only the backend sees: the tool's run and the
container's removal (which may finish after the call has answered, on the
remover thread, so the caller's context travels with the job).

No span is started without a caller's span to hang it under: a warm pool's
refill or eviction is not a call and would only add root traces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

tracer = trace.get_tracer("toolreg.sandbox")

TOOL_RUN = "toolreg.tool.run"
SANDBOX_REMOVE = "toolreg.sandbox.remove"


@contextmanager
def step_span(
    source: trace.Tracer, name: str, attributes: dict[str, str | bool | int] | None = None
) -> Iterator[Span]:
    """A child span for one step. An exception marks it failed by its type only:
    exception messages may quote what a client sent. (The server's steps use it too.)"""
    with source.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def within_call(name: str) -> AbstractContextManager[Span | None]:
    """A child span of the current one, or nothing outside a traced call."""
    if not trace.get_current_span().get_span_context().is_valid:
        return nullcontext()
    return step_span(tracer, name)

"""Spans and log context for one tool call.

The executor marks its steps as child spans of whatever span is current (the
RPC's, when the gRPC instrumentation is on) and tags that span with what the
call was: tool, level, status, execution id, warm or cold. Attributes are
facts the server decided, never the caller's arguments or a secret.

Without a configured SDK, ``opentelemetry.trace`` hands out non-recording
spans: the cost is a few attribute-free calls per step.

``execution_id`` is also kept in a context variable for the length of a call,
so every log line written on its behalf (in this thread or a thread that
copied the context) can carry it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.trace import Span

from registry_server.domain.models import ToolDefinition
from registry_server.domain.outcome import Outcome
from sandbox_runner.tracing import step_span

tracer = trace.get_tracer("toolreg.executor")

# Span names: one per step an operator may need to find in a slow call.
VALIDATE = "toolreg.validate_arguments"
APPROVAL = "toolreg.approval"
ADMISSION = "toolreg.admission"
SANDBOX_START = "toolreg.sandbox.start"
APPROVAL_SPEND = "toolreg.approval.spend"
AUDIT = "toolreg.audit.write"

# Attribute keys.
TOOL = "toolreg.tool"
LEVEL = "toolreg.safety_level"
STATUS = "toolreg.status"
EXECUTION_ID = "toolreg.execution_id"
WARM = "toolreg.warm"
DECISION = "toolreg.approval.decision"

current_execution_id: ContextVar[str | None] = ContextVar("toolreg_execution_id", default=None)


def step(name: str, **attributes: str | bool | int) -> AbstractContextManager[Span]:
    """A child span of the current one for one step of the call."""
    return step_span(tracer, name, attributes)


@contextmanager
def execution(execution_id: str) -> Iterator[None]:
    """The call's id, for log lines and the current span, while it runs."""
    token = current_execution_id.set(execution_id)
    trace.get_current_span().set_attribute(EXECUTION_ID, execution_id)
    try:
        yield
    finally:
        current_execution_id.reset(token)


def describe(tool: ToolDefinition | None, outcome: Outcome, warm: bool | None) -> None:
    """Tag the current span with what the call was and how it ended. The tool
    is named only once it was found: an unknown name stays the caller's."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute(STATUS, outcome.status.name)
    if tool is not None:
        span.set_attribute(TOOL, tool.name)
        span.set_attribute(LEVEL, tool.safety_level.value)
    if warm is not None:
        span.set_attribute(WARM, warm)

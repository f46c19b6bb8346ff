"""Maps domain errors to gRPC statuses, in one table, for every RPC."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from registry_server.api import refusals
from registry_server.domain.errors import ErrorCode, InvalidArgument, QuotaExceeded, ToolregError

log = logging.getLogger(__name__)

CODES: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


# An error travels in response headers (grpc-message, and grpc-status-details-bin:
# the google.rpc.Status below, base64), and gRPC refuses headers over 16 KiB, or
# 8 KiB by a client's default: a refusal listing many long problems (sixteen guards
# over the cost cap, say) would reach the client as RESOURCE_EXHAUSTED "metadata size
# exceeds hard limit" instead of itself. So what an error carries is capped.
MAX_MESSAGE_CHARS = 1_024  # characters of an error's message on the wire
MAX_DETAILS_BYTES = 4_096  # bytes of the serialized Status, message and details (base64: 4/3)
MORE = "more violations not shown; fix these and ask again"


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def to_status(exc: ToolregError) -> grpc.Status:
    code = CODES[exc.code]
    status = status_pb2.Status(
        code=getattr(code_pb2, code.name), message=_clipped(exc.message, MAX_MESSAGE_CHARS)
    )
    if isinstance(exc, InvalidArgument) and exc.violations:
        _bad_request(status, exc)
    if isinstance(exc, QuotaExceeded):
        _quota_details(status, exc)
    result: grpc.Status = rpc_status.to_status(status)
    return result


def _bad_request(status: status_pb2.Status, exc: InvalidArgument) -> None:
    """google.rpc.BadRequest with as many of the violations, in order, as fit within
    MAX_DETAILS_BYTES; then one that says how many more there were."""
    detail = error_details_pb2.BadRequest()
    budget = MAX_DETAILS_BYTES - status.ByteSize() - 64  # the Any's type URL and framing
    for index, violation in enumerate(exc.violations):
        one = error_details_pb2.BadRequest.FieldViolation(
            field=_clipped(violation.field, MAX_MESSAGE_CHARS),
            description=_clipped(violation.description, MAX_MESSAGE_CHARS),
        )
        if detail.ByteSize() + one.ByteSize() + 8 > budget - 96:  # room for the last one
            rest = len(exc.violations) - index
            detail.field_violations.add(field="", description=f"{rest} {MORE}")
            break
        detail.field_violations.append(one)
    packed = any_pb2.Any()
    packed.Pack(detail)
    status.details.append(packed)


def _quota_details(status: status_pb2.Status, exc: QuotaExceeded) -> None:
    """google.rpc.QuotaFailure names the quota; RetryInfo says when to retry."""
    failure = error_details_pb2.QuotaFailure(
        violations=[
            error_details_pb2.QuotaFailure.Violation(
                subject=exc.subject, description=f"{exc.limit}: {exc.message}"
            )
        ]
    )
    details: list[Any] = [failure]
    if exc.retry_after_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(max(1, round(exc.retry_after_s * 1000)))
        details.append(retry)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, ToolregError):
        refusals.note(exc)  # a refusal (permission, quota, capacity) goes on the record
        context.abort_with_status(to_status(exc))
    log.exception("unexpected error in RPC")
    # Never leak internals to the client; the log has the traceback.
    context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")


F = TypeVar("F", bound=Callable[..., Any])


def maps_errors(method: F) -> F:
    """Decorate a servicer method (unary or server-streaming) so domain errors
    become gRPC statuses with details."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as exc:
                _abort(context, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, exc)

    return unary  # type: ignore[return-value]

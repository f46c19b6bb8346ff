"""Domain errors. Each carries the status code it maps to; the gRPC layer maps
the code in one table (``grpc_errors.py``) so domain code never imports grpc."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    ABORTED = "ABORTED"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``field`` is a dotted path (``sandbox.image``)."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}" if self.field else self.description


class ToolregError(Exception):
    code = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ToolregError):
    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, violations: list[Violation] | None = None) -> None:
        super().__init__(message)
        self.violations = list(violations or [])


class InvalidDefinition(InvalidArgument):
    """A tool definition or manifest breaks one or more rules."""

    def __init__(self, violations: list[Violation], source: str = "tool definition") -> None:
        lines = "; ".join(str(v) for v in violations)
        super().__init__(f"invalid {source}: {lines}", violations)
        self.source = source


class NotFound(ToolregError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(ToolregError):
    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(ToolregError):
    code = ErrorCode.FAILED_PRECONDITION


class PermissionDenied(ToolregError):
    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(ToolregError):
    code = ErrorCode.UNAUTHENTICATED


class AtCapacity(ToolregError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Aborted(ToolregError):
    """The operation ended early and may simply be tried again (a watch whose
    reader fell behind)."""

    code = ErrorCode.ABORTED


class QuotaExceeded(AtCapacity):
    """A share of the service is used up: ``subject`` ("server", or
    "client:<id>") hit ``limit`` (max_queued, max_concurrent, rate, ...). The
    answer carries google.rpc.QuotaFailure, and RetryInfo when waiting
    ``retry_after_s`` seconds helps."""

    def __init__(
        self, message: str, *, subject: str, limit: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.subject = subject
        self.limit = limit
        self.retry_after_s = retry_after_s


class EngineUnavailable(ToolregError):
    code = ErrorCode.UNAVAILABLE


class Unimplemented(ToolregError):
    code = ErrorCode.UNIMPLEMENTED


class ConfigError(ToolregError):
    """The server's configuration or policy is unusable; it does not start."""

    code = ErrorCode.FAILED_PRECONDITION


class StoreError(ToolregError):
    """The data directory cannot be read or written (disk full, permissions)."""

    code = ErrorCode.UNAVAILABLE

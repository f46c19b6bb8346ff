"""What an error carries on the wire is bounded (api/grpc_errors.py): gRPC sends it
in response headers, which clients refuse past 8 to 16 KiB."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from registry_server.api.grpc_errors import MAX_DETAILS_BYTES, MAX_MESSAGE_CHARS, MORE, to_status
from registry_server.domain.errors import InvalidDefinition, NotFound, Violation


def _violations(status: grpc.Status) -> list[error_details_pb2.BadRequest.FieldViolation]:
    proto = rpc_status.status_pb2.Status.FromString(dict(status.trailing_metadata)[
        "grpc-status-details-bin"
    ])  # fmt: skip
    (packed,) = proto.details
    bad = error_details_pb2.BadRequest()
    assert packed.Unpack(bad)
    return list(bad.field_violations)


def test_few_violations_are_carried_whole() -> None:
    problems = [Violation("guards.0.condition", "does not compile"), Violation("name", "empty")]
    status = to_status(InvalidDefinition(problems))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [(v.field, v.description) for v in _violations(status)] == [
        ("guards.0.condition", "does not compile"), ("name", "empty"),
    ]  # fmt: skip


def test_many_long_violations_are_cut_to_fit_and_say_how_many_more() -> None:
    problems = [Violation(f"guards.{i}.condition", "x" * 1_500) for i in range(200)]
    status = to_status(InvalidDefinition(problems))
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    assert len(details) <= MAX_DETAILS_BYTES
    assert len(status.details) <= MAX_MESSAGE_CHARS and status.details.endswith("…")
    shown = _violations(status)
    kept, last = shown[:-1], shown[-1]
    assert kept and [v.field for v in kept] == [f"guards.{i}.condition" for i in range(len(kept))]
    assert all(len(v.description) <= MAX_MESSAGE_CHARS for v in kept)
    assert last.field == "" and last.description == f"{200 - len(kept)} {MORE}"


def test_an_error_without_violations_keeps_its_message() -> None:
    status = to_status(NotFound("no tool named 'x'"))
    assert status.code == grpc.StatusCode.NOT_FOUND and status.details == "no tool named 'x'"

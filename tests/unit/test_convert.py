"""Reading results off the wire: names and data that clients show to people."""

from __future__ import annotations

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.wire import convert


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (pb.EXECUTION_STATUS_TOOL_ERROR, "TOOL_ERROR"),
        (pb.EXECUTION_STATUS_APPROVAL_REQUIRED, "APPROVAL_REQUIRED"),
        (99, "STATUS_99"),  # a newer server's status: named, not a crash
    ],
)
def test_status_name(value: int, name: str) -> None:
    assert convert.status_name(value) == name


@pytest.mark.parametrize(
    ("text", "data"),
    [("", None), ('{"a": [1]}', {"a": [1]}), ("[]", []), ("not json", None)],
)
def test_data_from_pb(text: str, data: object) -> None:
    assert convert.data_from_pb(text) == data

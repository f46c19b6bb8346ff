"""Streamed calls that survive a broken stream: when StreamExecuteTool's
stream breaks in transit after the call started, re-attach (AttachExecution)
from the bytes already received, a bounded number of times with backoff, so
the caller gets every byte once and the result (docs/how-to/from-your-agent.md,
"Re-attaching to a running call"). A status the server answered (PERMISSION_DENIED,
RESOURCE_EXHAUSTED, ...) is raised as it is, never retried."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

# StreamExecuteTool request metadata: keep a started call running when its
# stream breaks (api/servicer.py REATTACH_METADATA).
REATTACH_METADATA = ("toolreg-reattach", "1")
REATTACH_TRIES = 5  # re-attachments in a row without any new event before giving up
FIRST_PAUSE_S = 0.2  # seconds before the first re-attachment; doubled for each next
MAX_PAUSE_S = 3.0  # seconds: the longest pause
LOCAL_CANCEL = "Locally cancelled"  # grpc's details when this process cancelled the call


def broke_in_transit(error: grpc.RpcError) -> bool:
    """Whether the stream was lost on the way (connection reset, server gone,
    proxy restarted), not ended by an answer of the server."""
    code = error.code() if isinstance(error, grpc.Call) else None
    details = (error.details() if isinstance(error, grpc.Call) else "") or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code == grpc.StatusCode.INTERNAL:
        return "RST_STREAM" in details or "stream" in details.lower()
    if code == grpc.StatusCode.CANCELLED:
        return LOCAL_CANCEL not in details
    return False


def reattaching(
    stub: Any,
    stream: Iterator[pb.ExecutionEvent],
    *,
    deadline: float | None = None,
    tries: int = REATTACH_TRIES,
    first_pause_s: float = FIRST_PAUSE_S,
) -> Iterator[pb.ExecutionEvent]:
    """``stream``'s events (StreamExecuteTool's), re-attaching when it breaks
    after ``started``. ``deadline`` (time.monotonic()) bounds the attachments
    as the original call's timeout did."""
    execution_id = ""
    offsets = {"stdout": 0, "stderr": 0}
    failures = 0
    while True:
        try:
            for event in stream:
                kind = event.WhichOneof("event")
                if kind == "started":
                    execution_id = event.started.execution_id
                elif kind == "stdout" or kind == "stderr":
                    offsets[kind] += len(getattr(event, kind))
                    failures = 0
                yield event
                if kind == "result":
                    return
            return
        except grpc.RpcError as error:
            if not execution_id or not broke_in_transit(error) or failures >= tries:
                raise
            failures += 1
        time.sleep(min(first_pause_s * 2 ** (failures - 1), MAX_PAUSE_S))
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        request = pb.AttachExecutionRequest(
            execution_id=execution_id,
            stdout_offset=offsets["stdout"],
            stderr_offset=offsets["stderr"],
        )
        stream = stub.AttachExecution(request, timeout=remaining)

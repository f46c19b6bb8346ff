"""What the framework adapters share, free of any framework: the tool listing,
the text a model gets for each outcome of a call, the approval payload a human
sees, how a human's answer is read, and a small bounded map for per-call state.

Every outcome of a call is something to hand back to the model, never an
exception (docs/explanation/sandbox.md, "What a tool is"; examples/agent_loop.py
does the same).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from registry_server.client import (
    ApprovalRequestView,
    CallResult,
    RegistryClient,
    SafetyLevel,
    Status,
    ToolDefinition,
    describe_rpc_error,
)

MAX_ERROR_CHARS = 1000  # characters of an error handed to the model: several schema
# violations fit, a tool's stderr flood does not fill the model's context
ARGUMENTS_PREVIEW_CHARS = 500  # characters of the arguments shown in an approval payload
TRUNCATED_NOTE = "\n[output truncated by toolreg]"
PAYLOAD_KIND = "toolreg_approval"  # names an interrupt value as this adapter's


def parse_level(max_level: SafetyLevel | str | None) -> SafetyLevel | None:
    """A level given as the enum or its name ("cautious"); None = no limit."""
    if max_level is None or isinstance(max_level, SafetyLevel):
        return max_level
    return SafetyLevel.parse(max_level)


def list_tools(
    client: RegistryClient, max_level: SafetyLevel | str | None, categories: Iterable[str]
) -> list[ToolDefinition]:
    """ListTools: the same registry query as GetToolSchemas, so the filters
    (at or below ``max_level``, any of ``categories``) are exactly the server's,
    and, as GetToolSchemas, without disabled tools (every call would be refused)."""
    found = client.list_tool_definitions(parse_level(max_level), tuple(categories))
    return [tool for tool in found if not tool.disabled]


def canonical_key(arguments: Any) -> str:
    """A stable text of the arguments for keys (key order ignored, as the
    server's digest ignores it)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def model_text(result: CallResult) -> str:
    """What the model reads for one call: the tool's output on success, a
    readable reason otherwise."""
    if result.success:
        return result.content + (TRUNCATED_NOTE if result.output_truncated else "")
    if result.status is Status.APPROVAL_REQUIRED and result.approval_request is not None:
        return approval_text(result.approval_request)
    return error_text(f"Error ({result.status.name}): {result.error}")


def error_text(text: str) -> str:
    return text[:MAX_ERROR_CHARS]


def approval_text(request: ApprovalRequestView) -> str:
    """APPROVAL_REQUIRED for the model: it did not run, and why. (The server's own
    error tells a client to retry with approval_request_id; the model cannot.)"""
    return (
        f"Not run: tool '{request.tool_name}' needs approval from toolreg approvers"
        f" (approval request {request.id}: {len(request.approved_by)} of"
        f" {request.approvals_required} approvals, {request.state.lower()})."
        " It runs only once they have approved it."
    )


def not_approved_text(tool_name: str, reason: str) -> str:
    return error_text(f"Not run: the call to '{tool_name}' was not approved: {reason}")


def rpc_error_text(err: grpc.RpcError) -> str:
    """A failed request (auth, capacity, no engine): still an answer for the model."""
    return error_text(f"Error: {describe_rpc_error(err).splitlines()[0]}")


def artifact(result: CallResult, request_id: str | None = None) -> dict[str, Any]:
    """The structured record of a call, for the application (not the model)."""
    return {
        "status": result.status.name,
        "execution_id": result.execution_id,
        "data": result.data,
        "exit_code": result.exit_code,
        "duration_ms": result.duration_ms,
        "output_truncated": result.output_truncated,
        "approval_request_id": request_id,
    }


def approval_payload(
    request: ApprovalRequestView, *, tool_call_id: str | None = None
) -> dict[str, Any]:
    """What a human deciding on a paused call sees: JSON values only, so any
    checkpointer can store it. The arguments are cut to a preview; approvers
    read them in full with `toolreg approvals show ID`."""
    preview = request.arguments_json
    if len(preview) > ARGUMENTS_PREVIEW_CHARS:
        preview = preview[:ARGUMENTS_PREVIEW_CHARS] + "..."
    return {
        "kind": PAYLOAD_KIND,
        "request_id": request.id,
        "tool": request.tool_name,
        "tool_call_id": tool_call_id,
        "arguments_digest": request.arguments_digest,
        "arguments_preview": preview,
        "approvals_required": request.approvals_required,
        "approved_by": list(request.approved_by),
        "state": request.state,
        "expires_at": request.expires_at.isoformat(),
        "approve_with": f"toolreg approvals approve {request.id} --key KEY",
    }


@dataclass(frozen=True)
class Decision:
    """A human's answer to a paused call. ``approved`` only lets the adapter
    ask toolreg: the call runs when toolreg's request is APPROVED."""

    approved: bool
    request_id: str | None = None  # the request the answer is about, when it says
    message: str | None = None  # a reason for the model, on rejection


def parse_resume(value: Any) -> Decision:
    """``True``/``False``, or ``{"approved": bool, "request_id"?: str,
    "message"?: str}``. Anything else is a rejection that says so (fail closed:
    a mistyped answer never runs a call)."""
    if isinstance(value, bool):
        return Decision(approved=value)
    if isinstance(value, dict) and isinstance(value.get("approved"), bool):
        request_id = value.get("request_id")
        message = value.get("message")
        return Decision(
            approved=value["approved"],
            request_id=request_id if isinstance(request_id, str) and request_id else None,
            message=message if isinstance(message, str) and message else None,
        )
    return Decision(
        approved=False,
        message='the resume value was not understood (expected {"approved": true|false})',
    )


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """A small thread-safe map that forgets its oldest entries past ``limit``:
    per-call state of calls a run abandoned must not grow without bound."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._items.pop(key, None)

    def snapshot(self) -> dict[K, V]:
        with self._lock:
            return dict(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

"""A worked example of an agent loop over toolreg, with no network model.

A real loop sends the conversation and ``client.tool_schemas()`` to a model,
gets back an assistant turn with OpenAI-format ``tool_calls``, runs each call,
and appends one ``{"role": "tool", ...}`` message per call before asking the
model again. Here the assistant turns are replayed from a file of recorded
tool calls (``recorded_tool_calls.json``), so the loop runs anywhere.

What it shows:

- every outcome of a call (unknown tool, invalid arguments, tool failure) is a
  result to hand back to the model, not an exception;
- a dangerous tool answers APPROVAL_REQUIRED with an approval request; the
  loop prints the request id for the humans who approve
  (``toolreg approvals approve ID --key KEY``), waits for the approval with a
  timeout, then retries the same call with ``approval_request_id``.

Usage:

    python examples/agent_loop.py --address 127.0.0.1:50051 [--token T]
        [--approval-timeout 300] [--calls FILE]

DEMO ONLY: ``--approver-key FILE --approver-id ID`` make this process approve
its own requests from a separate thread and connection, standing in for a
human approver so the example (and its test) runs unattended. A real agent
never holds an approver's key.

The transcript is printed as JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from registry_server.client import (
    ApprovalWaitError,
    CallResult,
    RegistryClient,
    Status,
    describe_rpc_error,
)

HERE = Path(__file__).resolve().parent
DEFAULT_CALLS = HERE / "recorded_tool_calls.json"
DEFAULT_APPROVAL_TIMEOUT_S = 300.0  # seconds to wait for approvers before giving up
DEMO_APPROVER_DELAY_S = 0.5  # seconds the demo approver "thinks" before signing
MAX_ERROR_CHARS = 500  # characters of an error handed back to the model


_EMIT_LOCK = threading.Lock()  # the demo approver thread prints too


def emit(record: dict[str, Any]) -> None:
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def recorded_tool_calls(path: Path) -> Iterator[dict[str, Any]]:
    """The tool calls of each recorded assistant turn, in order."""
    turns = json.loads(path.read_text(encoding="utf-8"))
    for turn in turns:
        yield from turn.get("tool_calls") or ()


def tool_message(call_id: str, result: CallResult) -> dict[str, Any]:
    """The message handed back to the model for one call."""
    if result.success:
        content = result.content
    else:
        content = f"Error ({result.status.name}): {result.error}"[:MAX_ERROR_CHARS]
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def error_message(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}"[:MAX_ERROR_CHARS]}


class DemoApprover:
    """DEMO ONLY: stands in for a human approver, on its own connection."""

    def __init__(self, address: str, token: str | None, key_file: Path, approver_id: str) -> None:
        from registry_server.client import load_private_key

        self._address = address
        self._token = token
        self._key = load_private_key(key_file.read_bytes())
        self._id = approver_id

    def approve_later(self, request_id: str) -> threading.Thread:
        thread = threading.Thread(target=self._approve, args=(request_id,), daemon=True)
        thread.start()
        return thread

    def _approve(self, request_id: str) -> None:
        from registry_server.client import mint_for

        time.sleep(DEMO_APPROVER_DELAY_S)
        with RegistryClient.connect(self._address, token=self._token) as client:
            req = client.get_approval_request(request_id)
            token = mint_for(self._key, issuer=self._id, request=req, bind_request=True)
            try:
                updated = client.submit_approval_token(request_id, token)
            except grpc.RpcError as err:
                emit({"event": "demo_approver_failed", "error": describe_rpc_error(err)})
                return
        emit(
            {
                "event": "demo_approver_signed",
                "request_id": request_id,
                "approver": self._id,
                "state": updated.state,
            }
        )


def run_call(
    client: RegistryClient,
    call: dict[str, Any],
    *,
    approval_timeout: float,
    approver: DemoApprover | None,
) -> dict[str, Any]:
    """Run one OpenAI-format tool call; returns the tool message for the model."""
    call_id = str(call.get("id", ""))
    function = call.get("function") or {}
    name = str(function.get("name", ""))
    arguments = function.get("arguments") or "{}"
    # Pass the model's JSON text through unchanged: the server validates it
    # and names any problem by its JSON path, which the model can act on.
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    emit({"event": "tool_call", "tool_call_id": call_id, "name": name, "arguments": arguments})
    try:
        result = client.execute_tool(name, arguments)
        if result.status is Status.APPROVAL_REQUIRED and result.approval_request is not None:
            request = result.approval_request
            emit(
                {
                    "event": "approval_required",
                    "tool_call_id": call_id,
                    "request_id": request.id,
                    "approvals_required": request.approvals_required,
                    "hint": f"toolreg approvals approve {request.id} --key KEY",
                }
            )
            if approver is not None:
                approver.approve_later(request.id)
            try:
                approved = client.wait_for_approval(request.id, timeout_s=approval_timeout)
            except ApprovalWaitError as exc:
                emit({"event": "approval_not_granted", "tool_call_id": call_id, "reason": str(exc)})
                message = error_message(call_id, f"approval not granted: {exc}")
                emit_result(call_id, name, result.status, message)
                return message
            emit(
                {
                    "event": "approved",
                    "tool_call_id": call_id,
                    "request_id": approved.id,
                    "approved_by": list(approved.approved_by),
                }
            )
            result = client.execute_tool(name, arguments, approval_request_id=approved.id)
    except grpc.RpcError as err:
        # The request itself failed (auth, capacity, no engine): still answer the model.
        text = describe_rpc_error(err).splitlines()[0]
        message = error_message(call_id, text)
        emit_result(call_id, name, None, message)
        return message
    message = tool_message(call_id, result)
    emit_result(call_id, name, result.status, message, execution_id=result.execution_id)
    return message


def emit_result(
    call_id: str,
    name: str,
    status: Status | None,
    message: dict[str, Any],
    *,
    execution_id: str = "",
) -> None:
    emit(
        {
            "event": "tool_result",
            "tool_call_id": call_id,
            "name": name,
            "status": status.name if status is not None else "RPC_ERROR",
            "execution_id": execution_id,
            "message": message,
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--address", default=None, help="HOST:PORT (default $TOOLREG_ADDRESS)")
    parser.add_argument("--token", default=None, help="bearer token of this client")
    parser.add_argument(
        "--approval-timeout",
        type=float,
        default=DEFAULT_APPROVAL_TIMEOUT_S,
        help="seconds to wait for an approval",
    )
    parser.add_argument("--calls", type=Path, default=DEFAULT_CALLS, help="recorded tool calls")
    parser.add_argument(
        "--approver-key", type=Path, default=None, help="DEMO ONLY: approve own requests"
    )
    parser.add_argument("--approver-id", default=None, help="DEMO ONLY: id of --approver-key")
    args = parser.parse_args(argv)
    if (args.approver_key is None) != (args.approver_id is None):
        parser.error("--approver-key and --approver-id go together")

    with RegistryClient.connect(args.address, token=args.token) as client:
        approver = None
        if args.approver_key is not None:
            approver = DemoApprover(client.address, args.token, args.approver_key, args.approver_id)
        # What a real loop would send to the model alongside the conversation.
        try:
            tools = client.tool_schemas()
            emit({"event": "tools", "names": [t["function"]["name"] for t in tools]})
        except grpc.RpcError as err:
            emit({"event": "tools_unavailable", "error": describe_rpc_error(err)})
        conversation: list[dict[str, Any]] = []
        for call in recorded_tool_calls(args.calls):
            conversation.append(
                run_call(client, call, approval_timeout=args.approval_timeout, approver=approver)
            )
        emit({"event": "done", "tool_messages": len(conversation)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

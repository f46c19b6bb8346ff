"""Executing a tool call: look-up, argument checks, then the sandbox.

(The sandbox half arrives with the execution issue; until then a known tool
answers UNIMPLEMENTED.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from registry_server.errors import Unimplemented
from registry_server.outcome import Outcome, Status
from registry_server.registry import Registry

OutputSink = Callable[[str, bytes], None]


@dataclass(frozen=True)
class CallRequest:
    name: str
    arguments_json: str
    caller: str = "anonymous"
    approval_tokens: tuple[str, ...] = ()
    approval_request_id: str = ""


class Executor:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def execute(self, call: CallRequest, on_output: OutputSink | None = None) -> Outcome:
        execution_id = uuid.uuid4().hex
        tool = self._registry.find(call.name)
        if tool is None:
            return Outcome(
                status=Status.TOOL_NOT_FOUND,
                error=f"Tool '{call.name}' not found",
                execution_id=execution_id,
            )
        raise Unimplemented("this server cannot execute tools yet")

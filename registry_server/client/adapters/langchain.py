"""The registry's tools as LangChain ``StructuredTool``s, pausing a LangGraph
graph while toolreg approvers decide.

``pip install 'toolreg[langchain]'``. docs/how-to/agent-frameworks.md has the worked
graph; in short::

    tools = toolreg_structured_tools(client, max_level="dangerous")
    graph = builder.compile(checkpointer=InMemorySaver())   # with ToolNode(tools)
    out = graph.invoke({"messages": [...]}, config)
    for pause in out.get("__interrupt__", ()):               # pause.value["request_id"]
        ...                                                   # approvers sign it
    out = graph.invoke(Command(resume={"approved": True, "request_id": ...}), config)

How toolreg maps onto LangChain and LangGraph:

- one ``StructuredTool`` per tool ListTools returns (``max_level``,
  ``categories``: the server's own filter), with the registered JSON Schema as
  ``args_schema`` (a dict: LangChain passes it to the model unchanged and
  leaves validation to the server); ``response_format="content_and_artifact"``:
  the model reads the tool's output, the ``ToolMessage.artifact`` holds status,
  execution id and parsed JSON for the application;
- every other outcome raises ``ToolException`` with a readable reason, and the
  tools have ``handle_tool_error=True``: the model gets it as a ToolMessage with
  ``status="error"``, LangChain's convention, and nothing raises to the caller;
- a call that needs approval (ExecuteTool answers APPROVAL_REQUIRED) calls
  ``langgraph.types.interrupt`` with ``approval_payload``: a graph with a
  checkpointer pauses (``__interrupt__``). Resuming with ``{"approved": true}``
  makes the tool check toolreg's request (waiting up to ``approval_wait_s`` on
  the request's watch stream, so it answers the moment toolreg decides):
  APPROVED runs the call with ``approval_request_id``; still PENDING pauses
  again; rejected by an approver (their reason), expired or used is an error
  for the model. ``{"approved": false}`` is a refusal for the model. The
  resume value never authorises a run by itself;
- LangGraph re-runs the whole node on resume. The tools keep, per graph thread
  and tool call, the call's approval request (so a re-run asks no new one) and
  the outcome of calls that finished (so a re-run does not run a call twice),
  in this process, bounded;
- outside a graph nothing can pause: the tool answers that the call needs
  approval, with the request id, and runs the identical call once toolreg's
  request is APPROVED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import grpc

from registry_server.client import (
    ApprovalRequestView,
    ApprovalWaitError,
    CallResult,
    RegistryClient,
    SafetyLevel,
    ToolDefinition,
)
from registry_server.client.adapters._common import (
    BoundedMap,
    approval_payload,
    approval_text,
    artifact,
    canonical_key,
    list_tools,
    model_text,
    not_approved_text,
    parse_resume,
    rpc_error_text,
)
from registry_server.client.registry_client import DEFAULT_POLL_S, arguments_text

try:
    from langchain_core.tools import StructuredTool, ToolException
    from langgraph.config import get_config
    from langgraph.runtime import get_runtime
    from langgraph.types import interrupt
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "registry_server.client.adapters.langchain needs LangChain and LangGraph:"
        " pip install 'toolreg[langchain]'"
    ) from exc

MAX_TRACKED_CALLS = 1024  # calls whose approval request or finished outcome is kept at once
DEFAULT_APPROVAL_WAIT_S = 0.0  # seconds a resumed call waits for toolreg to approve: check once
OPEN_STATES = ("PENDING", "APPROVED")  # a request in these states can still authorise its call

# (graph thread, checkpoint namespace) or None outside a graph; tool call id; tool; arguments
CallKey = tuple[tuple[str, str] | None, str, str, str]


@dataclass(frozen=True)
class _Outcome:
    """How a call ended: the model's text, and the artifact when it succeeded."""

    text: str
    artifact: dict[str, Any] | None  # None = an error for the model

    @classmethod
    def of(cls, result: CallResult, request_id: str | None = None) -> _Outcome:
        return cls(model_text(result), artifact(result, request_id) if result.success else None)

    def deliver(self) -> tuple[str, dict[str, Any]]:
        if self.artifact is None:
            raise ToolException(self.text)
        return self.text, self.artifact


class ToolregStructuredTool(StructuredTool):
    """A StructuredTool that hands its whole argument object to toolreg.

    StructuredTool passes arguments as keyword arguments, so a parameter named
    ``config``, ``callbacks`` or ``run_manager`` would be taken for its own;
    registry tools may have any parameter names."""

    def _to_args_and_kwargs(
        self, tool_input: str | dict[str, Any], tool_call_id: str | None
    ) -> tuple[tuple[str, ...], dict[str, Any]]:
        parsed = self._parse_input(tool_input, tool_call_id)
        return cast("tuple[tuple[str, ...], dict[str, Any]]", ((parsed, tool_call_id), {}))


class _Calls:
    """The calls of one tool set, across LangGraph's re-runs of a node."""

    def __init__(
        self,
        client: RegistryClient,
        *,
        approval_wait_s: float,
        poll_s: float,
        timeout_s: float | None,
    ) -> None:
        self.client = client
        self.approval_wait_s = approval_wait_s
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.requests: BoundedMap[CallKey, str] = BoundedMap(MAX_TRACKED_CALLS)
        self.finished: BoundedMap[CallKey, _Outcome] = BoundedMap(MAX_TRACKED_CALLS)

    def run(
        self, name: str, arguments: Any, tool_call_id: str | None
    ) -> tuple[str, dict[str, Any]]:
        if not isinstance(arguments, dict):
            raise ToolException("Error: the arguments must be one JSON object")
        scope = _graph_scope()
        # Outside a graph a model's retry has a new call id: the arguments alone
        # name the call, so the retry finds its (by then approved) request.
        call = (tool_call_id or "") if scope is not None else ""
        key: CallKey = (scope, call, name, canonical_key(arguments))
        if scope is not None and (done := self.finished.get(key)) is not None:
            return done.deliver()  # a re-run of a node: this call already ran
        outcome = self._outcome(name, arguments, key, tool_call_id)
        if scope is not None:
            self.finished.put(key, outcome)
        return outcome.deliver()

    def _outcome(
        self, name: str, arguments: dict[str, Any], key: CallKey, tool_call_id: str | None
    ) -> _Outcome:
        text = arguments_text(arguments)
        try:
            request = self._known_request(key)
            if request is None:
                result = self.client.execute_tool(name, text, timeout=self.timeout_s)
                if not (result.needs_approval and result.approval_request is not None):
                    return _Outcome.of(result)
                request = result.approval_request
                self.requests.put(key, request.id)
            in_graph = key[0] is not None
            if in_graph:
                return self._decided(name, text, key, request, tool_call_id)
            if request.state == "APPROVED":  # approved since the model last asked
                return self._run_approved(name, text, key, request.id)
            return _Outcome(approval_text(request), None)
        except grpc.RpcError as err:
            return _Outcome(rpc_error_text(err), None)

    def _known_request(self, key: CallKey) -> ApprovalRequestView | None:
        """The request this call already has, while it can still authorise it.
        (ExecuteTool would reuse only a PENDING one: an APPROVED request must be
        found here, or a re-run would open a second request for the same call.)"""
        known = self.requests.get(key)
        if known is None:
            return None
        request = self.client.get_approval_request(known)
        if request.state in OPEN_STATES:
            return request
        self.requests.pop(key)
        return None

    def _decided(
        self,
        name: str,
        text: str,
        key: CallKey,
        request: ApprovalRequestView,
        tool_call_id: str | None,
    ) -> _Outcome:
        """Pause the graph until a human answers, then let toolreg decide."""
        while True:
            decision = parse_resume(interrupt(approval_payload(request, tool_call_id=tool_call_id)))
            if decision.request_id not in (None, request.id):
                named = self._same_call(decision.request_id, request)
                if named is None:
                    # An answer about another call (LangGraph matches answers to the
                    # pauses of one node by order): ask about this one again.
                    request = self.client.get_approval_request(request.id)
                    continue
                request = named
                self.requests.put(key, request.id)
            if not decision.approved:
                self.requests.pop(key)
                return _Outcome(not_approved_text(name, decision.message or "rejected"), None)
            try:
                approved = self.client.wait_for_approval(
                    request.id, timeout_s=self.approval_wait_s, poll_s=self.poll_s
                )
            except ApprovalWaitError as exc:
                if exc.request is not None and exc.request.state == "PENDING":
                    request = exc.request  # toolreg has not approved it yet: pause again
                    continue
                self.requests.pop(key)
                return _Outcome(not_approved_text(name, str(exc)), None)
            return self._run_approved(name, text, key, approved.id)

    def _same_call(self, request_id: str, ours: ApprovalRequestView) -> ApprovalRequestView | None:
        """The named request when it is for exactly this call and still open (one
        made before this process knew of it), else None."""
        try:
            named = self.client.get_approval_request(request_id)
        except grpc.RpcError:
            return None
        same = (named.tool_name, named.tool_digest, named.arguments_digest) == (
            ours.tool_name,
            ours.tool_digest,
            ours.arguments_digest,
        )
        return named if same and named.state in OPEN_STATES else None

    def _run_approved(self, name: str, text: str, key: CallKey, request_id: str) -> _Outcome:
        result = self.client.execute_tool(
            name, text, approval_request_id=request_id, timeout=self.timeout_s
        )
        self.requests.pop(key)
        return _Outcome.of(result, request_id)


def _graph_scope() -> tuple[str, str] | None:
    """(thread id, checkpoint namespace) when running inside a LangGraph graph."""
    try:
        if get_runtime() is None:
            return None  # a runnable context (tool.invoke), but no graph
        configurable = get_config().get("configurable", {})
    except (RuntimeError, KeyError):  # no runnable context at all
        return None
    return str(configurable.get("thread_id", "")), str(configurable.get("checkpoint_ns", ""))


def toolreg_structured_tools(
    client: RegistryClient,
    *,
    max_level: SafetyLevel | str | None = None,
    categories: Iterable[str] = (),
    approval_wait_s: float = DEFAULT_APPROVAL_WAIT_S,
    poll_s: float = DEFAULT_POLL_S,
    timeout_s: float | None = None,
) -> list[StructuredTool]:
    """The registry's tools at or below ``max_level`` with any of ``categories``
    as ``StructuredTool``s. ``approval_wait_s``: how long a call resumed as
    approved waits for toolreg's request to be APPROVED before pausing again
    (it follows the request's watch stream; an approver's rejection ends the
    wait with their reason for the model). ``poll_s``: seconds between polls,
    used only against a server that cannot watch (WatchApprovalRequests
    UNIMPLEMENTED); kept for compatibility. ``timeout_s`` bounds each
    ExecuteTool RPC (None: the tool's own limit)."""
    calls = _Calls(client, approval_wait_s=approval_wait_s, poll_s=poll_s, timeout_s=timeout_s)
    return [_structured_tool(d, calls) for d in list_tools(client, max_level, categories)]


def _structured_tool(definition: ToolDefinition, calls: _Calls) -> StructuredTool:
    name = definition.name

    def run(arguments: dict[str, Any], tool_call_id: str | None) -> tuple[str, dict[str, Any]]:
        return calls.run(name, arguments, tool_call_id)

    async def arun(
        arguments: dict[str, Any], tool_call_id: str | None
    ) -> tuple[str, dict[str, Any]]:
        # The client's stubs block: the call runs in a worker thread, which keeps
        # this context (interrupt() finds the graph's config there).
        return await asyncio.to_thread(run, arguments, tool_call_id)

    level = definition.safety_level.value
    return ToolregStructuredTool(
        name=name,
        description=definition.description,
        args_schema=definition.parameters,
        func=run,
        coroutine=arun,
        response_format="content_and_artifact",
        handle_tool_error=True,
        tags=["toolreg", f"toolreg:{level}"],
        metadata={
            "toolreg_safety_level": level,
            "toolreg_categories": list(definition.categories),
            "toolreg_digest": definition.digest,
        },
    )


__all__ = ["ToolregStructuredTool", "toolreg_structured_tools"]

"""The registry's tools as OpenAI Agents SDK ``FunctionTool``s.

``pip install 'toolreg[openai-agents]'``. docs/how-to/agent-frameworks.md has the
worked loop; in short::

    approvals = ToolregApprovals(client)
    agent = Agent(name="ops", tools=toolreg_function_tools(client, approvals=approvals))
    result = await Runner.run(agent, "...")
    while result.interruptions:            # dangerous calls wait for toolreg approvers
        state = result.to_state()
        await approvals.resolve(state, timeout_s=300)
        result = await Runner.run(agent, state)

How toolreg maps onto the SDK:

- one ``FunctionTool`` per tool ListTools returns (``max_level``,
  ``categories``: the server's own filter), with the registered JSON Schema as
  ``params_json_schema``; ``strict_json_schema`` only where strict mode would
  not change what the model may send (``strict_compatible``);
- the model's argument text goes to ExecuteTool unchanged (the server
  validates it, and its digest is what approvers sign); the model gets the
  tool's output, or a readable error string for every other outcome, the SDK's
  convention for tool errors (an exception would fail the run);
- dangerous tools have ``needs_approval=True``: the SDK pauses the run with a
  ``ToolApprovalItem``. ``ToolregApprovals.resolve`` opens (or finds) the
  toolreg approval request for exactly that call, waits for toolreg to say
  APPROVED (following WatchApprovalRequests: it answers the moment the last
  approver signs, or rejects), and only then approves the SDK item; when an
  approver rejects the request (the model hears their reason), it expires, was
  used, or the wait times out, it rejects the item with a reason for the
  model. The tool then calls ExecuteTool with ``approval_request_id``, so the
  approvers' signatures are what authorise the run: approving the SDK item by
  hand only gets the model a "needs approval" answer.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from registry_server.client import (
    ApprovalRequestView,
    ApprovalWaitError,
    CallResult,
    RegistryClient,
    SafetyLevel,
)
from registry_server.client.adapters._common import (
    BoundedMap,
    approval_text,
    list_tools,
    model_text,
    not_approved_text,
    rpc_error_text,
)
from registry_server.client.registry_client import DEFAULT_POLL_S

try:
    from agents import FunctionTool, RunState, Tool, ToolApprovalItem, UserError
    from agents.strict_schema import ensure_strict_json_schema
    from agents.tool_context import ToolContext
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "registry_server.client.adapters.openai_agents needs the OpenAI Agents SDK:"
        " pip install 'toolreg[openai-agents]'"
    ) from exc

MAX_TRACKED_CALLS = 1024  # tool calls whose approval request or answer is kept at once
# Keywords every strict-mode implementation accepts; a schema using others stays
# non-strict rather than risk the API refusing the tool (the server validates anyway).
STRICT_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "enum", "const",
     "anyOf", "$ref", "$defs", "description", "title"}
)  # fmt: skip

Verdict = Literal["approved", "rejected", "answered", "pending", "skipped"]


def strict_compatible(schema: dict[str, Any]) -> bool:
    """Whether ``strict_json_schema=True`` keeps the tool's meaning: the SDK's own
    strict conversion leaves the schema as it is (every object closed, every
    property required) and it uses only ``STRICT_KEYWORDS``. Otherwise strict
    mode would make optional parameters required, or refuse open objects."""
    if not _only_strict_keywords(schema):
        return False
    try:
        converted = ensure_strict_json_schema(copy.deepcopy(schema))
    except UserError:
        return False
    same: bool = _required_as_sets(converted) == _required_as_sets(schema)
    return same


def _only_strict_keywords(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if not set(node) <= STRICT_KEYWORDS:
        return False
    properties, defs = node.get("properties", {}), node.get("$defs", {})
    any_of = node.get("anyOf", [])
    if not (isinstance(properties, dict) and isinstance(defs, dict) and isinstance(any_of, list)):
        return False
    children = [*properties.values(), *defs.values(), *any_of]
    if "items" in node:
        children.append(node["items"])
    return all(_only_strict_keywords(child) for child in children)


def _required_as_sets(node: Any) -> Any:
    # The SDK lists "required" in property order; the author's order means the same.
    if isinstance(node, dict):
        return {
            k: frozenset(v) if k == "required" and isinstance(v, list) else _required_as_sets(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_required_as_sets(v) for v in node]
    return node


@dataclass(frozen=True)
class Resolution:
    """What ``ToolregApprovals.resolve`` did with one interruption (``decision``):

    - ``approved``: toolreg's request is APPROVED; the SDK item was approved;
    - ``rejected``: an approver rejected the request (``message`` gives who and
      their reason), it expired or was used, or the wait timed out; the SDK
      item was rejected with ``message`` as the model's answer;
    - ``answered``: toolreg answered the call without asking for approval (it was
      redefined, or the arguments are invalid); the SDK item was approved and the
      tool hands that answer (``message``) to the model without calling again;
    - ``pending``: still waiting, and ``on_timeout="leave"``: nothing settled;
    - ``skipped``: not a pause of a toolreg tool; left to the application."""

    call_id: str
    tool_name: str
    decision: Verdict
    request_id: str | None = None
    approved_by: tuple[str, ...] = ()
    message: str = ""


def _tracked() -> BoundedMap[Any, Any]:
    return BoundedMap(MAX_TRACKED_CALLS)


@dataclass(eq=False)
class ToolregApprovals:
    """Links the SDK's approval pauses to toolreg approval requests, by tool
    call id. Share one between ``toolreg_function_tools`` and the code that
    resumes the run. ``request_ids`` (call id -> toolreg request id) is for a UI;
    ``remember`` restores it when a run is resumed in another process."""

    client: RegistryClient
    # Seconds between GetApprovalRequest polls, used only against a server that
    # cannot watch (WatchApprovalRequests UNIMPLEMENTED); otherwise the wait
    # follows the watch stream and never polls. Kept for compatibility.
    poll_s: float = DEFAULT_POLL_S
    _tools: set[str] = field(init=False, repr=False, default_factory=set)  # settled here
    _requests: BoundedMap[str, str] = field(init=False, repr=False, default_factory=_tracked)
    # Answers toolreg gave while a request was being opened (the call needed no
    # approval after all, or was refused): the tool hands them to the model as is.
    _answers: BoundedMap[str, CallResult] = field(init=False, repr=False, default_factory=_tracked)

    @property
    def request_ids(self) -> dict[str, str]:
        return self._requests.snapshot()

    def remember(self, call_id: str, request_id: str) -> None:
        self._requests.put(call_id, request_id)

    async def open(
        self, interruptions: Iterable[ToolApprovalItem]
    ) -> dict[str, ApprovalRequestView]:
        """The toolreg approval request of each interruption of a toolreg tool,
        by call id, made now if it does not exist yet (no waiting): what a UI
        shows approvers. Raises grpc.RpcError when the server cannot answer."""
        mine = [i for i in interruptions if self._covers(i)]
        opened = await asyncio.gather(*(asyncio.to_thread(self._open, i) for i in mine))
        return {
            str(item.call_id): found
            for item, found in zip(mine, opened, strict=True)
            if isinstance(found, ApprovalRequestView)
        }

    async def resolve(
        self,
        state: RunState[Any, Any],
        *,
        timeout_s: float,
        on_timeout: Literal["reject", "leave"] = "reject",
    ) -> list[Resolution]:
        """Settle the run's interruptions from toolreg: approve each SDK item whose
        toolreg request is APPROVED, reject it (with the reason for the model)
        when an approver rejected the request (their reason), it expired or was
        used, or after ``timeout_s`` seconds of waiting (``on_timeout="leave"``
        leaves those pending for a later call). Each wait follows the request's
        watch stream, so it ends the moment toolreg decides.
        Waits run concurrently. Interruptions of other tools are skipped. Raises
        grpc.RpcError, settling nothing, when the server cannot answer."""
        items = state.get_interruptions()
        resolutions = await asyncio.gather(
            *(self._settle(item, timeout_s, on_timeout) for item in items)
        )
        for item, done in zip(items, resolutions, strict=True):
            if done.decision in ("approved", "answered"):
                state.approve(item)
            elif done.decision == "rejected":
                state.reject(item, rejection_message=done.message)
        return list(resolutions)

    # -- the parts the tools and resolve share -----------------------------------

    def _covers(self, item: ToolApprovalItem) -> bool:
        return bool(item.call_id) and item.tool_name in self._tools

    def _open(self, item: ToolApprovalItem) -> ApprovalRequestView | CallResult:
        """The call's toolreg request: the one already known for this call id, else
        the first ExecuteTool attempt's (the server reuses the caller's open
        request for an identical call, so asking again does not make another)."""
        call_id, name = str(item.call_id), str(item.tool_name)
        known = self._requests.get(call_id)
        if known is not None:
            return self.client.get_approval_request(known)
        result = self.client.execute_tool(name, item.arguments or "{}")
        if result.needs_approval and result.approval_request is not None:
            self._requests.put(call_id, result.approval_request.id)
            return result.approval_request
        self._answers.put(call_id, result)
        return result

    async def _settle(
        self, item: ToolApprovalItem, timeout_s: float, on_timeout: Literal["reject", "leave"]
    ) -> Resolution:
        call_id, name = str(item.call_id or ""), str(item.tool_name or "")
        if not self._covers(item):
            return Resolution(call_id, name, "skipped")
        opened = await asyncio.to_thread(self._open, item)
        if isinstance(opened, CallResult):
            return Resolution(call_id, name, "answered", message=model_text(opened))
        try:
            approved = await asyncio.to_thread(
                self.client.wait_for_approval, opened.id, timeout_s=timeout_s, poll_s=self.poll_s
            )
        except ApprovalWaitError as exc:
            still_pending = exc.request is not None and exc.request.state == "PENDING"
            if still_pending and on_timeout == "leave":
                return Resolution(call_id, name, "pending", opened.id, message=str(exc))
            self._requests.pop(call_id)
            return Resolution(
                call_id, name, "rejected", opened.id, message=not_approved_text(name, str(exc))
            )
        return Resolution(call_id, name, "approved", approved.id, approved.approved_by)

    def _run_call(self, name: str, call_id: str, arguments: str, timeout_s: float | None) -> str:
        """One invocation: an answer toolreg already gave, else ExecuteTool with the
        call's approval request (if any). Every outcome is text for the model."""
        answered = self._answers.pop(call_id)
        if answered is not None:
            return model_text(answered)
        request_id = self._requests.get(call_id) or ""
        try:
            result = self.client.execute_tool(
                name, arguments, approval_request_id=request_id, timeout=timeout_s
            )
        except grpc.RpcError as err:
            return rpc_error_text(err)
        if result.needs_approval and result.approval_request is not None:
            # Approved in the SDK without toolreg's approval: not run, and the
            # request stays known so resolve() or a UI can find it.
            self._requests.put(call_id, result.approval_request.id)
            return approval_text(result.approval_request)
        self._requests.pop(call_id)
        return model_text(result)


def toolreg_function_tools(
    client: RegistryClient,
    *,
    max_level: SafetyLevel | str | None = None,
    categories: Iterable[str] = (),
    approvals: ToolregApprovals | None = None,
    strict: bool | None = None,
    timeout_s: float | None = None,
) -> list[Tool]:
    """The registry's tools at or below ``max_level`` with any of ``categories``
    as ``FunctionTool``s (typed ``list[Tool]``, as the SDK's own MCP helper
    returns, so the list type-checks as an ``Agent``'s ``tools``).

    Pass the ``approvals`` you will resolve the run's interruptions with (one
    is made otherwise, and then a dangerous call the SDK approves only answers
    "needs approval"). ``strict``: None = strict where ``strict_compatible``.
    ``timeout_s`` bounds each ExecuteTool RPC (None: the tool's own limit, which
    the server enforces)."""
    approvals = approvals if approvals is not None else ToolregApprovals(client)
    if approvals.client is not client:
        raise ValueError("approvals belongs to another RegistryClient")
    tools: list[Tool] = []
    for definition in list_tools(client, max_level, categories):
        schema = definition.parameters
        dangerous = definition.safety_level is SafetyLevel.DANGEROUS
        if dangerous:
            approvals._tools.add(definition.name)  # its pauses are resolve()'s to settle
        tools.append(
            FunctionTool(
                name=definition.name,
                description=definition.description,
                params_json_schema=schema,
                on_invoke_tool=_invoker(approvals, definition.name, timeout_s),
                strict_json_schema=strict_compatible(schema) if strict is None else strict,
                needs_approval=dangerous,
            )
        )
    return tools


def _invoker(
    approvals: ToolregApprovals, name: str, timeout_s: float | None
) -> Callable[[ToolContext[Any], str], Awaitable[str]]:
    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        # The client's stubs block: the call runs in a worker thread.
        return await asyncio.to_thread(
            approvals._run_call, name, ctx.tool_call_id, arguments, timeout_s
        )

    return invoke


__all__ = [
    "Resolution",
    "ToolregApprovals",
    "strict_compatible",
    "toolreg_function_tools",
]

"""Long calls as MCP tasks: the ``io.modelcontextprotocol/tasks`` extension
(SEP-2663) on 2026-07-28 (docs/how-to/mcp.md, "Long calls as tasks").

The bridge declares the extension in its capabilities. A ``tools/call`` from a
client that declared it too, to a tool whose definition allows calls of
``TASK_MIN_TIMEOUT_MS`` or more (``sandbox.limits.timeout_ms``), answers at
once with a task (``resultType: "task"``, ``taskId``, ``status``, ``ttlMs``,
``pollIntervalMs``); every other call answers as before. The call runs on a
thread of the bridge through ``StreamExecuteTool`` with re-attachment (a
dropped connection to the server re-attaches; the call is not cancelled).

* ``tasks/get`` reports ``working``; ``input_required`` while the call waits
  for approvers (a dangerous tool: the approval request's console page as a
  URL-mode elicitation when the bridge knows the console, else the text in
  ``statusMessage``), after which the call runs once, with that request;
  ``completed`` with the tool's result inlined (a tool that failed is
  ``isError``); ``failed`` with a JSON-RPC error when the registry refused the
  request itself; ``cancelled``.
* ``tasks/cancel`` stops the call: ``CancelExecution`` on the server, which
  kills and removes the sandbox. A task already ended is acknowledged and
  keeps its status; an unknown one is -32602.
* A ``tasks/*`` request whose client capabilities do not name the extension
  is -32021 (Missing Required Client Capability); over HTTP, one whose
  ``Mcp-Name`` header is not its ``taskId`` is -32020 (Header Mismatch).
* ``tasks/update`` is acknowledged (the approval happens in the console; the
  next ``tasks/get`` looks at the request again).

Tasks are kept in the bridge's memory per principal (the policy client or
signed-in person the bearer token proved; one principal over stdio and in
development mode), not per MCP session: a client that reconnects finds its
tasks, and no other client can see or cancel them. Bounded: at most
``MAX_OPEN_PER_PRINCIPAL`` unfinished tasks per principal (more calls answer
as plain calls), ``MAX_KEPT_PER_PRINCIPAL`` kept in all (the oldest finished
go first), ``MAX_TASKS`` in the bridge; a finished task is kept for its
``ttlMs`` from its creation. A bridge restart loses every task: their ids
become unknown, and calls still running go on to their own timeout (their
results stay in the audit log).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import anyio.to_thread
import grpc
import mcp.types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import decode_header_value
from mcp_types.jsonrpc import HEADER_MISMATCH, MISSING_REQUIRED_CLIENT_CAPABILITY
from starlette.requests import Request

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.registry_client import (
    RegistryClient,
    arguments_text,
    describe_rpc_error,
)
from registry_server.domain.models import SafetyLevel, valid_tool_name
from registry_server.wire import convert

log = logging.getLogger("toolreg.mcp.tasks")

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
MODERN_VERSION = "2026-07-28"  # the revision the extension is served on
TASK_MIN_TIMEOUT_MS = 10_000  # a tool allowed calls this long or longer runs as a task
DEFAULT_TTL_MS = 3_600_000  # a task is kept this long from its creation (once finished)
POLL_INTERVAL_MS = 1_000  # what clients are told to wait between tasks/get
APPROVAL_CHECK_S = 1.0  # seconds between looks at a pending approval request, per task
MAX_OPEN_PER_PRINCIPAL = 16  # unfinished tasks per principal
MAX_KEPT_PER_PRINCIPAL = 64  # tasks kept per principal, finished or not
MAX_TASKS = 10_000  # tasks kept by the bridge in all
MAX_TASK_ID_CHARS = 64  # a longer taskId is unknown without a look-up
INPUT_KEY = "toolreg_approval"  # the key of the one input request of an input_required task
TERMINAL = frozenset({"completed", "failed", "cancelled"})
UNKNOWN_TASK = "unknown task"
RPC_FAILED = -32603  # JSON-RPC internal error: the registry refused or failed the request


class TaskParams(types.RequestParams):
    """tasks/get, tasks/cancel and tasks/update (its inputResponses are not read)."""

    task_id: str
    request_state: str | None = None
    input_responses: dict[str, Any] | None = None


def principal_of(ctx: ServerRequestContext[Any]) -> str:
    """Whose tasks these are: the policy client or the IdP-signed-in person the
    bearer token proved; "" without authentication (stdio, ``--insecure-dev``)."""
    request = ctx.request
    user = request.scope.get("user") if isinstance(request, Request) else None
    if not isinstance(user, AuthenticatedUser):
        return ""
    token = user.access_token
    return f"{token.client_id}\x00{token.subject or ''}"


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Task:
    task_id: str
    principal: str
    tool: str
    arguments_json: str
    client: RegistryClient = field(repr=False)
    ttl_ms: int = DEFAULT_TTL_MS
    status: str = "working"
    message: str = ""
    created_at: str = field(default_factory=_now_iso)
    updated_at: str = ""
    born: float = field(default_factory=time.monotonic)
    execution_id: str = ""
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    input_requests: dict[str, Any] | None = None
    approval_request_id: str = ""  # input_required: the request the call waits for
    next_check: float = 0.0  # monotonic: when to look at that request again
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.updated_at = self.updated_at or self.created_at

    def wire(self, *, detailed: bool) -> dict[str, Any]:
        """The task as the client sees it (``detailed``: tasks/get, with its
        result, error or input requests)."""
        out: dict[str, Any] = {
            "taskId": self.task_id, "status": self.status,
            "createdAt": self.created_at, "lastUpdatedAt": self.updated_at,
            "ttlMs": self.ttl_ms, "pollIntervalMs": POLL_INTERVAL_MS,
        }  # fmt: skip
        if self.message:
            out["statusMessage"] = self.message
        if detailed:
            if self.result is not None:
                out["result"] = self.result
            if self.error is not None:
                out["error"] = self.error
            if self.input_requests is not None and self.status == "input_required":
                out["inputRequests"] = self.input_requests
        return out


class TaskStore:
    """The bridge's tasks, per principal, bounded. Thread-safe: the calls'
    threads update their tasks while handlers read them."""

    def __init__(
        self,
        *,
        max_open: int = MAX_OPEN_PER_PRINCIPAL,
        max_kept: int = MAX_KEPT_PER_PRINCIPAL,
        max_tasks: int = MAX_TASKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock = threading.Lock()
        self._tasks: dict[str, Task] = {}  # insertion order: oldest first
        self._max_open = max_open
        self._max_kept = max_kept
        self._max_tasks = max_tasks
        self._clock = clock

    def add(self, task: Task) -> bool:
        """Keep a new task; False when its principal has as many unfinished
        tasks as it may, or the bridge is full of unfinished ones."""
        with self.lock:
            self._expire()
            mine = [t for t in self._tasks.values() if t.principal == task.principal]
            if sum(t.status not in TERMINAL for t in mine) >= self._max_open:
                return False
            if len(mine) >= self._max_kept and not self._drop_oldest_finished(mine):
                return False
            if len(self._tasks) >= self._max_tasks and not self._drop_oldest_finished(
                list(self._tasks.values())
            ):
                return False
            self._tasks[task.task_id] = task
            return True

    def get(self, principal: str, task_id: str) -> Task | None:
        """The principal's task, or None (unknown, expired, or another's)."""
        if len(task_id) > MAX_TASK_ID_CHARS:
            return None
        with self.lock:
            self._expire()
            task = self._tasks.get(task_id)
        return task if task is not None and task.principal == principal else None

    def update(self, task: Task, **changes: Any) -> bool:
        """Change a task unless it has ended (a cancelled task stays cancelled)."""
        with self.lock:
            if task.status in TERMINAL:
                return False
            for key, value in changes.items():
                setattr(task, key, value)
            task.updated_at = _now_iso()
            return True

    def __len__(self) -> int:
        with self.lock:
            return len(self._tasks)

    def _expire(self) -> None:
        now = self._clock()
        gone = [
            t.task_id
            for t in self._tasks.values()
            if t.status in TERMINAL and now - t.born > t.ttl_ms / 1000
        ]
        for task_id in gone:
            del self._tasks[task_id]

    def _drop_oldest_finished(self, tasks: list[Task]) -> bool:
        for task in tasks:
            if task.status in TERMINAL:
                del self._tasks[task.task_id]
                return True
        return False


ClientFor = Callable[[ServerRequestContext[Any]], RegistryClient]
CallTool = Callable[[ServerRequestContext[Any], types.CallToolRequestParams], Awaitable[Any]]
ResultToMcp = Callable[[str, pb.ToolResult], types.CallToolResult]


class Tasks:
    """The tasks extension over a bridge: installed on its MCP server by
    ``install`` (the SDK's extension hooks: ``Server.extensions`` advertises
    it, ``add_request_handler`` serves the tasks/* methods and wraps
    ``tools/call``)."""

    def __init__(
        self,
        client_for: ClientFor,
        result_to_mcp: ResultToMcp,
        *,
        max_level: SafetyLevel | None = None,
        categories: tuple[str, ...] = (),
        execute_timeout: float | None = None,
        console_page: Callable[[str], str] | None = None,
        approval_message: Callable[[str, pb.ApprovalRequest], str] | None = None,
        min_timeout_ms: int = TASK_MIN_TIMEOUT_MS,
        store: TaskStore | None = None,
    ) -> None:
        self._client_for = client_for
        self._result_to_mcp = result_to_mcp
        self._max_level = max_level
        self._categories = categories
        self._execute_timeout = execute_timeout
        self._console_page = console_page
        self._approval_message = approval_message
        self._min_timeout_ms = min_timeout_ms
        self.store = store or TaskStore()

    def install(self, server: Server[Any]) -> None:
        server.extensions[TASKS_EXTENSION] = {}
        entry = server.get_request_handler("tools/call")
        if entry is None:
            raise ValueError("the server has no tools/call handler to wrap")
        plain: CallTool = entry.handler

        async def call_tool(
            ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
        ) -> Any:
            created = await self.maybe_task(ctx, params)
            return created if created is not None else await plain(ctx, params)

        server.add_request_handler("tools/call", types.CallToolRequestParams, call_tool)
        server.add_request_handler("tasks/get", TaskParams, self.get)
        server.add_request_handler("tasks/cancel", TaskParams, self.cancel)
        server.add_request_handler("tasks/update", TaskParams, self.update)

    # -- tools/call ---------------------------------------------------------------------

    @staticmethod
    def negotiated(ctx: ServerRequestContext[Any]) -> bool:
        """Whether this request's client declared the extension (2026-07-28)."""
        if ctx.protocol_version != MODERN_VERSION:
            return False
        caps = ctx.session.client_capabilities
        return caps is not None and TASKS_EXTENSION in (caps.extensions or {})

    async def maybe_task(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> dict[str, Any] | None:
        """A created task (CreateTaskResult), or None: the call is answered as
        a plain call (no extension, a short tool, anything the plain path
        refuses with its own error, the principal's task limit)."""
        if not self.negotiated(ctx) or not valid_tool_name(params.name):
            return None
        arguments = dict(params.arguments or {})
        request_id = arguments.pop("_approval_request_id", "")
        if not isinstance(request_id, str) or params.input_responses or params.request_state:
            return None
        client = self._client_for(ctx)
        try:
            long_call = await anyio.to_thread.run_sync(self._long_call, client, params.name)
        except grpc.RpcError:
            return None  # the plain path says why (not found, unavailable, ...)
        if not long_call:
            return None
        task = Task(
            secrets.token_hex(16), principal_of(ctx), params.name, arguments_text(arguments), client
        )
        if not self.store.add(task):
            log.info("task limit reached: %s runs as a plain call", params.name)
            return None
        self._start(task, request_id)
        log.info("task %s: %s", task.task_id, params.name)
        return {"resultType": "task", **task.wire(detailed=False)}

    def _long_call(self, client: RegistryClient, name: str) -> bool:
        """Whether the tool is offered here and may run long enough for a task."""
        tool = client.get(name)
        stored = convert.stored_tool_from_pb(tool)
        if tool.disabled:
            return False
        if self._max_level is not None and not stored.safety_level.at_most(self._max_level):
            return False
        if self._categories and set(self._categories).isdisjoint(stored.categories):
            return False
        return tool.sandbox.limits.timeout_ms >= self._min_timeout_ms

    def _start(self, task: Task, request_id: str) -> None:
        thread = threading.Thread(
            target=self._run, args=(task, request_id), name="mcp-task", daemon=True
        )
        thread.start()

    def _run(self, task: Task, request_id: str) -> None:
        """The call, on its own thread: its execution id once started (a
        cancel asked for before then is sent now), then its outcome."""
        result: pb.ToolResult | None = None
        try:
            events = task.client.stream(
                task.tool, task.arguments_json, request_id=request_id,
                timeout=self._execute_timeout, reattach=True,
            )  # fmt: skip
            for event in events:
                kind = event.WhichOneof("event")
                if kind == "started":
                    execution_id = event.started.execution_id
                    with self.store.lock:
                        task.execution_id, stop = execution_id, task.cancelled
                    self.store.update(task, message=f"running as execution {execution_id}")
                    if stop:
                        self._stop(task)
                elif kind == "result":
                    result = event.result
        except grpc.RpcError as err:
            message = describe_rpc_error(err)
            log.warning("task %s: %s failed: %s", task.task_id, task.tool, message)
            self.store.update(
                task, status="failed", message=message,
                error={"code": RPC_FAILED, "message": message},
            )  # fmt: skip
            return
        if result is None:
            message = "the server ended the call without a result"
            self.store.update(
                task, status="failed", message=message,
                error={"code": RPC_FAILED, "message": message},
            )  # fmt: skip
            return
        if result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED and result.approval_request.id:
            self._await_approval(task, result.approval_request)
            return
        self._complete(task, result)

    def _complete(self, task: Task, result: pb.ToolResult) -> None:
        mapped = self._result_to_mcp(task.tool, result)
        body = mapped.model_dump(by_alias=True, mode="json", exclude_none=True)
        status = convert.status_name(result.status)
        self.store.update(
            task, status="completed", message=f"{status}" if not result.success else "",
            result=body,
        )  # fmt: skip
        log.info("task %s: %s -> %s (execution %s)", task.task_id, task.tool, status,
                 result.execution_id)  # fmt: skip

    def _await_approval(self, task: Task, req: pb.ApprovalRequest) -> None:
        message = (
            self._approval_message(task.tool, req)
            if self._approval_message is not None
            else f"Tool {task.tool!r} waits for approval request {req.id}."
        )
        inputs = None
        if self._console_page is not None:
            ask = {
                "mode": "url", "message": message,
                "url": self._console_page(req.id), "elicitationId": req.id,
            }  # fmt: skip
            inputs = {INPUT_KEY: {"method": "elicitation/create", "params": ask}}
        self.store.update(
            task, status="input_required", message=message, input_requests=inputs,
            approval_request_id=req.id, execution_id="",
            next_check=time.monotonic() + APPROVAL_CHECK_S,
        )  # fmt: skip

    def _check_approval(self, task: Task) -> None:
        """An input_required task: once its request is approved the call runs
        (once, with it); rejected, expired or voided, the task completes with
        the reason as an error result."""
        with self.store.lock:
            if task.status != "input_required" or time.monotonic() < task.next_check:
                return
            task.next_check = time.monotonic() + APPROVAL_CHECK_S
            request_id = task.approval_request_id
        try:
            req = task.client.stub.GetApprovalRequest(
                pb.GetApprovalRequestRequest(id=request_id), timeout=10
            )
        except grpc.RpcError as err:
            log.warning("task %s: approval request %s: %s", task.task_id, request_id,
                        describe_rpc_error(err))  # fmt: skip
            return
        if req.state == "APPROVED":
            if self.store.update(task, status="working", message="", input_requests=None):
                self._start(task, request_id)
        elif req.state in ("REJECTED", "EXPIRED", "VOIDED", "CONSUMED"):
            why = f" by {req.rejected_by}: {req.rejection_reason}" if req.rejected_by else ""
            text = f"APPROVAL_DENIED: approval request {req.id} was {req.state.lower()}{why}"
            body = types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                        is_error=True)  # fmt: skip
            self.store.update(
                task, status="completed", message=text, input_requests=None,
                result=body.model_dump(by_alias=True, mode="json", exclude_none=True),
            )  # fmt: skip

    # -- tasks/* ------------------------------------------------------------------------

    def _mine(self, ctx: ServerRequestContext[Any], params: TaskParams) -> Task:
        if not self.negotiated(ctx):
            # SEP-2663: the tasks surface is gated on the request declaring the extension.
            raise MCPError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"tasks/* needs the {TASKS_EXTENSION} extension in the client's capabilities",
                {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
            )
        request = ctx.request
        if isinstance(request, Request):
            # SEP-2243/SEP-2663: over HTTP a tasks/* request names its task in the
            # Mcp-Name header too, and the two must agree (routing intermediaries read it).
            named = decode_header_value(request.headers.get("mcp-name"))
            if named != params.task_id:
                raise MCPError(HEADER_MISMATCH, "the Mcp-Name header does not match params.taskId")
        task = self.store.get(principal_of(ctx), params.task_id)
        if task is None:
            raise MCPError(types.INVALID_PARAMS, UNKNOWN_TASK)
        return task

    async def get(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        task = self._mine(ctx, params)
        if task.status == "input_required":
            await anyio.to_thread.run_sync(self._check_approval, task)
        with self.store.lock:
            return task.wire(detailed=True)

    async def update(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        task = self._mine(ctx, params)
        if task.status == "input_required":
            await anyio.to_thread.run_sync(self._check_approval, task)
        return {}

    async def cancel(self, ctx: ServerRequestContext[Any], params: TaskParams) -> dict[str, Any]:
        task = self._mine(ctx, params)
        with self.store.lock:
            if task.status in TERMINAL:
                return {}  # idempotent: an ended task keeps its status (-32602 is for unknown ids)
            task.cancelled = True
            running = bool(task.execution_id) and task.status == "working"
        if running:
            refused = await anyio.to_thread.run_sync(self._stop, task)
            if refused:
                with self.store.lock:
                    task.cancelled = False
                raise MCPError(RPC_FAILED, f"the call could not be cancelled: {refused}")
        self.store.update(task, status="cancelled", message="cancelled by the client",
                          input_requests=None)  # fmt: skip
        log.info("task %s cancelled (execution %s)", task.task_id, task.execution_id or "-")
        return {}

    def _stop(self, task: Task) -> str:
        """CancelExecution for the task's call: "" when stopped (or already
        ended), else why not."""
        reason = f"MCP task {task.task_id} cancelled by its client"
        try:
            task.client.cancel(task.execution_id, reason, timeout=10)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return ""  # it ended meanwhile
            return describe_rpc_error(err)
        return ""


class BridgeLike(Protocol):
    """What the tasks read of the bridge (bridge.Bridge), without importing it."""

    client_for: ClientFor
    max_level: SafetyLevel | None
    categories: tuple[str, ...]
    execute_timeout: float | None


def install_tasks(
    server: Server[Any],
    bridge: BridgeLike,
    result_to_mcp: ResultToMcp,
    approval_message: Callable[[str, pb.ApprovalRequest], str],
) -> Tasks:
    """Serve the tasks extension on the bridge's MCP server (build_server)."""
    # With the console's URL (approvals.py), a waiting task asks for the approval
    # page as a URL-mode elicitation; without, its statusMessage says what to do.
    approvals = getattr(bridge, "approvals", None)
    page = getattr(approvals, "page", None)
    message = getattr(approvals, "message", None) or approval_message
    tasks = Tasks(
        bridge.client_for, result_to_mcp, max_level=bridge.max_level,
        categories=bridge.categories, execute_timeout=bridge.execute_timeout,
        console_page=page, approval_message=message,
    )  # fmt: skip
    tasks.install(server)
    return tasks

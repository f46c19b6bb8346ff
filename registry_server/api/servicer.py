"""The gRPC servicer: proto -> domain, one domain call, domain -> proto."""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.auth import DEVELOPER, Principal, current_principal
from registry_server.api.grpc_errors import maps_errors
from registry_server.api.policy_reload import PolicyReloads
from registry_server.approvals.service import Approvals, Viewer
from registry_server.approvals.watch import Watches
from registry_server.catalog.registry import Registrant, Registry
from registry_server.catalog.views import RegistryViews
from registry_server.domain import schemas
from registry_server.domain.errors import InvalidArgument, Unimplemented, Violation
from registry_server.domain.models import NAME_PATTERN, valid_tool_name
from registry_server.domain.pages import PageQuery, PageTokens
from registry_server.execution.call_log import (
    CallCancel,
    CallEvent,
    CallLog,
    KeptCall,
    check_attach,
    check_cancel,
)
from registry_server.execution.call_relay import Attachments, CallRelay, failed_call
from registry_server.execution.call_request import CallRequest
from registry_server.execution.executor import Executor
from registry_server.policy.clients import Role
from registry_server.policy.live import LivePolicy
from registry_server.wire import convert

CANCELLED_CALL_WAIT_S = 5.0  # seconds an ended stream waits for its cancelled call
# Request metadata of StreamExecuteTool: "1" = this client re-attaches if its
# stream breaks, so a started call runs on instead of being cancelled.
REATTACH_METADATA = "toolreg-reattach"


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    # grpc reports "no deadline" as a huge number of seconds
    return None if remaining is None or remaining > 10**8 else time.monotonic() + remaining


def _cancel_event(context: grpc.ServicerContext) -> threading.Event:
    """Set when the RPC ends for any reason: the client cancelled, its deadline
    passed, or the call completed. The runner kills the container when set."""
    event = threading.Event()
    if not context.add_callback(event.set):
        event.set()  # the RPC has already terminated
    return event


class StreamedCall:
    """Runs an execution on its own thread and yields its output as events:
    ``started`` once the call is admitted, the chunks, then exactly one result.
    The queue is bounded by the output caps. The thread runs in a copy of the
    RPC's context: its trace span and caller.

    What the stream carries is kept in the call log too, for AttachExecution.
    When the RPC ends early the call is cancelled (the container killed), unless
    the client said it re-attaches (``REATTACH_METADATA``) and the call has
    started: then it runs on to its own end (its timeout, the client's deadline)
    and waits for the client in the log (docs/how-to/from-your-agent.md,
    "Re-attaching to a running call")."""

    _DONE = object()

    def __init__(
        self,
        executor: Executor,
        call: CallRequest,
        context: grpc.ServicerContext,
        calls: CallLog,
        keep_running: bool,
    ) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._calls = calls
        self._caller = call.caller
        self._kept: KeptCall | None = None
        self._cancel = CallCancel()  # the RPC's end, or CancelExecution (who and why)
        self._keep_running = keep_running
        if not context.add_callback(self._rpc_ended):
            self._cancel.set()  # the RPC has already terminated
        context_copy = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context_copy.run,
            args=(self._run, executor, call),
            name="stream-exec",
            daemon=True,
        )
        self._thread.start()

    def _rpc_ended(self) -> None:
        if not (self._keep_running and self._kept is not None):
            self._cancel.set()

    def _run(self, executor: Executor, call: CallRequest) -> None:
        try:
            outcome = executor.execute(
                call, on_output=self._on_output, cancel=self._cancel, on_started=self._on_started
            )
            self._queue.put(pb.ExecutionEvent(result=convert.outcome_to_pb(outcome)))
        except BaseException as exc:  # re-raised on the RPC thread, mapped there
            self._error = exc
            outcome = failed_call(exc, self._kept.execution_id if self._kept else "")
        finally:
            self._queue.put(self._DONE)
        if self._kept is not None:
            self._calls.finish(self._kept, outcome)

    def _on_started(self, execution_id: str) -> None:
        self._kept = self._calls.start(execution_id, self._caller, self._cancel)
        self._queue.put(pb.ExecutionEvent(started=pb.ExecutionStarted(execution_id=execution_id)))

    def _on_output(self, stream: str, chunk: bytes) -> None:
        if self._kept is not None:
            self._calls.append(self._kept, stream, chunk)
        if stream == "stdout":
            self._queue.put(pb.ExecutionEvent(stdout=chunk))
        else:
            self._queue.put(pb.ExecutionEvent(stderr=chunk))

    def __iter__(self) -> Iterator[pb.ExecutionEvent]:
        try:
            while (item := self._queue.get()) is not self._DONE:
                assert isinstance(item, pb.ExecutionEvent)
                yield item
        except GeneratorExit:
            # The RPC ended early (the client cancelled, its deadline passed). A
            # call being cancelled: wait for that, within bounds, so the RPC (and
            # its span) covers the call's end, status included. A call kept
            # running for its client to re-attach is not waited for.
            if self._cancel.is_set():
                self._thread.join(CANCELLED_CALL_WAIT_S)
            raise
        self._thread.join()
        if self._error is not None:
            raise self._error


def _event_to_pb(event: CallEvent) -> pb.ExecutionEvent:
    if event.outcome is not None:
        return pb.ExecutionEvent(result=convert.outcome_to_pb(event.outcome))
    if event.stream == "stdout":
        return pb.ExecutionEvent(stdout=event.data)
    return pb.ExecutionEvent(stderr=event.data)


def _keeps_running(context: grpc.ServicerContext) -> bool:
    return any(
        key == REATTACH_METADATA and value == "1"
        for key, value in context.invocation_metadata() or ()
    )


def _required(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(
            f"{field}: must not be empty", [Violation(field, "must not be empty")]
        )
    return value


def _viewer(principal: Principal) -> Viewer:
    """Who reads approval requests (approvals.service.Viewer): admins and the
    developer see all, and so does an approve-role client the policy names
    as no approver (a relay its operator set up)."""
    relay = Role.APPROVE in principal.roles and principal.approver is None
    admin = principal.admin or principal is DEVELOPER
    return Viewer(principal.id, sees_all=admin or relay, approver=principal.approver, admin=admin)


def _tool_name(value: str) -> str:
    """A name is checked before any look-up (and never echoed back when bad)."""
    _required(value, "name")
    if not valid_tool_name(value):
        rule = f"not a tool name (must match {NAME_PATTERN})"
        raise InvalidArgument(f"name: {rule}", [Violation("name", rule)])
    return value


class ToolRegistryServicer(pb_grpc.ToolRegistryServicer):
    def __init__(
        self, registry: Registry, executor: Executor, approvals: Approvals | None,
        watches: Watches | None = None,
        policy: LivePolicy | None = None,
        reloads: PolicyReloads | None = None,
        pages: PageTokens | None = None,
        calls: CallLog | None = None,
        relay: CallRelay | None = None,
    ) -> None:  # fmt: skip
        self._registry = registry
        self._executor = executor
        self._approvals = approvals
        self._watches = watches
        self._policy = policy
        self._reloads = reloads
        # Without the store's key (server.py passes it), tokens work on this server only.
        self._pages = pages or PageTokens.ephemeral()
        self._views = RegistryViews(registry, self._pages)
        # Without a log of its own (tests), a servicer keeps its calls for the default grace.
        self._calls = calls or CallLog()
        self._attach = Attachments(self._calls, relay)

    def _approval_service(self) -> Approvals:
        if self._approvals is None:
            raise Unimplemented("this server has no approval service")
        return self._approvals

    def _watch_service(self) -> Watches:
        if self._watches is None:
            raise Unimplemented("this server does not watch approval requests")
        return self._watches

    @staticmethod
    def _call(request: pb.ExecuteToolRequest, context: grpc.ServicerContext) -> CallRequest:
        caller = current_principal()
        return CallRequest(
            name=request.name,
            arguments_json=request.arguments_json,
            caller=caller.id,
            actor=caller.actor,
            max_level=caller.max_level,
            claims=caller.claims,
            approval_tokens=tuple(request.approval_tokens),
            approval_request_id=request.approval_request_id,
            deadline=_deadline(context),
        )

    @maps_errors
    def RegisterTool(
        self, request: pb.RegisterToolRequest, context: grpc.ServicerContext
    ) -> pb.Tool:
        if not request.HasField("tool"):
            raise InvalidArgument("tool: is required", [Violation("tool", "is required")])
        caller = current_principal()
        tool = convert.tool_from_pb(request.tool)
        registrant = Registrant(caller.id, admin=caller.admin, grant=caller.register)
        self._registry.register(tool, replace=request.replace, by=registrant)
        return convert.tool_to_pb(self._registry.get(tool.name))

    @maps_errors
    def GetTool(self, request: pb.GetToolRequest, context: grpc.ServicerContext) -> pb.Tool:
        return convert.tool_to_pb(self._registry.get(_tool_name(request.name)))

    @maps_errors
    def ListTools(
        self, request: pb.ListToolsRequest, context: grpc.ServicerContext
    ) -> pb.ListToolsResponse:
        level = convert.max_level_from_pb(request.max_safety_level)
        categories = sorted(set(request.categories))
        query = PageQuery.of("tools", level=level.value if level else "", categories=categories)

        def listing() -> list[tuple[str, pb.Tool]]:
            return [(t.name, convert.tool_to_pb(t)) for t in self._registry.list(level, categories)]

        def answer(tools: Sequence[pb.Tool], next_page_token: str) -> pb.ListToolsResponse:
            return pb.ListToolsResponse(tools=tools, next_page_token=next_page_token)

        return self._views.page(query, request.page_size, request.page_token, listing, answer)

    @maps_errors
    def GetToolSchemas(
        self, request: pb.GetToolSchemasRequest, context: grpc.ServicerContext
    ) -> pb.GetToolSchemasResponse:
        fmt = convert.format_from_pb(request.format)
        level = convert.max_level_from_pb(request.max_safety_level)
        categories = sorted(set(request.categories))
        query = PageQuery.of(
            "schemas", format=fmt.value, level=level.value if level else "", categories=categories
        )

        def listing() -> list[tuple[str, str]]:
            tools = self._registry.list(level, categories)
            # A disabled tool is not offered to models: every call would be refused.
            return [(t.name, schemas.tool_json(t, fmt)) for t in tools if not t.disabled]

        def answer(items: Sequence[str], next_page_token: str) -> pb.GetToolSchemasResponse:
            return pb.GetToolSchemasResponse(
                schemas_json=schemas.json_array(items), next_page_token=next_page_token
            )

        return self._views.page(query, request.page_size, request.page_token, listing, answer)

    @maps_errors
    def ExecuteTool(
        self, request: pb.ExecuteToolRequest, context: grpc.ServicerContext
    ) -> pb.ToolResult:
        outcome = self._executor.execute(
            self._call(request, context), cancel=_cancel_event(context)
        )
        return convert.outcome_to_pb(outcome)

    @maps_errors
    def StreamExecuteTool(
        self, request: pb.ExecuteToolRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ExecutionEvent]:
        events = StreamedCall(
            self._executor, self._call(request, context), context, self._calls,
            keep_running=_keeps_running(context),
        )  # fmt: skip
        yield from events

    @maps_errors
    def AttachExecution(
        self, request: pb.AttachExecutionRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ExecutionEvent]:
        check_attach(request.execution_id, request.stdout_offset, request.stderr_offset)
        followed = self._attach.follow(
            request.execution_id, current_principal().id,
            request.stdout_offset, request.stderr_offset, _cancel_event(context),
        )  # fmt: skip
        for event in followed:
            yield _event_to_pb(event)

    @maps_errors
    def CancelExecution(
        self, request: pb.CancelExecutionRequest, context: grpc.ServicerContext
    ) -> pb.CancelExecutionResponse:
        check_cancel(request.execution_id, request.reason)
        caller = current_principal()
        call = self._calls.cancel(
            request.execution_id, caller.id,
            admin=caller.admin or caller is DEVELOPER, reason=request.reason,
        )  # fmt: skip
        return pb.CancelExecutionResponse(execution_id=call.execution_id)

    @maps_errors
    def ListApprovalRequests(
        self, request: pb.ListApprovalRequestsRequest, context: grpc.ServicerContext
    ) -> pb.ListApprovalRequestsResponse:
        page = self._approval_service().page_requests(
            request.state, request.page_size, request.page_token,
            _viewer(current_principal()), self._pages, limit=request.limit,
        )  # fmt: skip
        return pb.ListApprovalRequestsResponse(
            requests=[convert.approval_request_to_pb(r) for r in page.items],
            next_page_token=page.next_page_token,
        )

    @maps_errors
    def GetApprovalRequest(
        self, request: pb.GetApprovalRequestRequest, context: grpc.ServicerContext
    ) -> pb.ApprovalRequest:
        found = self._approval_service().get_for(
            _required(request.id, "id"), _viewer(current_principal())
        )
        return convert.approval_request_to_pb(found)

    @maps_errors
    def SubmitApproval(
        self, request: pb.SubmitApprovalRequest, context: grpc.ServicerContext
    ) -> pb.ApprovalRequest:
        updated = self._approval_service().submit(
            _required(request.request_id, "request_id"),
            _required(request.token, "token"),
            submitted_by=current_principal().id,
        )
        return convert.approval_request_to_pb(updated)

    @maps_errors
    def RejectApprovalRequest(
        self, request: pb.RejectApprovalRequestRequest, context: grpc.ServicerContext
    ) -> pb.ApprovalRequest:
        rejected = self._approval_service().reject(
            _required(request.request_id, "request_id"),
            request.reason,
            _viewer(current_principal()),
        )
        return convert.approval_request_to_pb(rejected)

    @maps_errors
    def WatchApprovalRequests(
        self, request: pb.WatchApprovalRequestsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ApprovalEvent]:
        watch = self._watch_service().open(_viewer(current_principal()), request.request_id)
        # The RPC ending (cancel, deadline, server stop) ends the watch's wait.
        if not context.add_callback(watch.close):
            watch.close()
        for item in watch:
            yield convert.approval_event_to_pb(item)

    @maps_errors
    def DeleteTool(
        self, request: pb.DeleteToolRequest, context: grpc.ServicerContext
    ) -> pb.DeleteToolResponse:
        caller = current_principal()
        self._registry.delete(
            _tool_name(request.name), reason=request.reason,
            by=Registrant(caller.id, admin=caller.admin),
        )  # fmt: skip
        return pb.DeleteToolResponse()

    @maps_errors
    def SetToolEnabled(
        self, request: pb.SetToolEnabledRequest, context: grpc.ServicerContext
    ) -> pb.Tool:
        caller = current_principal()
        tool = self._registry.set_enabled(
            _tool_name(request.name), request.enabled, reason=request.reason,
            by=Registrant(caller.id, admin=caller.admin),
        )  # fmt: skip
        return convert.tool_to_pb(tool)

    @maps_errors
    def ReloadPolicy(
        self, request: pb.ReloadPolicyRequest, context: grpc.ServicerContext
    ) -> pb.ServerInfo:
        if self._reloads is None:
            raise Unimplemented("this server cannot reload its policy")
        self._reloads.reload(current_principal().id, announce=True)
        return self._server_info()

    @maps_errors
    def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext
    ) -> pb.ServerInfo:
        return self._server_info()

    def _server_info(self) -> pb.ServerInfo:
        if self._policy is None:
            raise Unimplemented("this server does not say which policy it enforces")
        return convert.server_info_to_pb(self._policy.current, self._policy.loaded_at)

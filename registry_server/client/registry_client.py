"""A typed Python client for toolreg.

Two layers share one class:

- the *domain* API (``RegistryClient.connect`` and ``register_tool``,
  ``get_tool``, ``delete_tool``, ``set_tool_enabled``,
  ``list_tool_definitions``, ``tool_schemas``, ``execute_tool``, ``stream_tool``,
  ``list_approval_requests``, ``get_approval_request``, ``submit_approval_token``,
  ``reject_approval_request``, ``watch_approval_requests``, ``wait_for_approval``):
  one method per RPC, taking and returning domain objects (``ToolDefinition``,
  ``CallResult``, ``ApprovalRequestView``), never protobuf messages;
- the thin message-level methods the CLI uses (``register``, ``get``, ...).

Errors: a tool call's outcome (unknown tool, bad arguments, approval required,
tool failure, timeout) is a ``CallResult``, never an exception. A failed
*request* (bad definition, NOT_FOUND from GetTool, UNAUTHENTICATED, server at
capacity, no engine) raises ``grpc.RpcError``; ``describe_rpc_error`` turns it
into readable text including the ``google.rpc.BadRequest`` field violations.
``wait_for_approval`` raises ``ApprovalWaitError``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.reattach import REATTACH_METADATA, reattaching
from registry_server.client.trace_context import TraceContext
from registry_server.domain.files import read_credential
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.domain.outcome import ApprovalEventView, ApprovalRequestView, Status
from registry_server.domain.pages import Page
from registry_server.domain.schemas import SchemaFormat
from registry_server.wire import convert
from registry_server.wire.endpoint import DEFAULT_HOST, DEFAULT_PORT

ADDRESS_ENV = "TOOLREG_ADDRESS"
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_TIMEOUT_S = 30.0  # seconds for registry calls; executions get their own
DEFAULT_POLL_S = 1.0  # seconds between polls, against a server that cannot watch
REWATCH_PAUSE_AFTER_S = 1.0  # seconds: a watch that ended sooner is retried after a pause
REWATCH_PAUSE_S = 0.25  # seconds of that pause

T = TypeVar("T")


def _settled(request: ApprovalRequestView) -> bool:
    """Whether waiting is over: approved, or in a state that never changes."""
    return request.state in ("APPROVED", "REJECTED", "VOIDED", "EXPIRED", "CONSUMED")


def _still_waiting(request_id: str, last: ApprovalRequestView, timeout_s: float) -> Exception:
    return ApprovalWaitError(
        f"approval request {request_id} still {last.state.lower()} after"
        f" {timeout_s:g}s ({len(last.approved_by)} of {last.approvals_required} approvals)",
        last,
    )


def follow_pages(fetch: Callable[[str], tuple[Iterable[T], str]]) -> Iterator[T]:
    """Every item of a paged listing (AIP-158): ``fetch(page_token)`` gives a
    page's items and the next token, "" on the last page. A server that
    answers a token it was given with the same token again is an error, not an
    endless loop."""
    token, seen = "", set()
    while True:
        items, token = fetch(token)
        yield from items
        if not token:
            return
        if token in seen:
            raise RuntimeError("the server repeated a page token; the listing does not advance")
        seen.add(token)


def join_json_arrays(texts: list[str]) -> str:
    """JSON array texts (pages of GetToolSchemas) as one JSON array text, each
    element's text unchanged."""
    if len(texts) == 1:
        return texts[0]
    inner = []
    for text in texts:
        text = text.strip()
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError("GetToolSchemas did not return a JSON array")
        if body := text[1:-1].strip():
            inner.append(body)
    return "[" + ",".join(inner) + "]"


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def describe_rpc_error(err: grpc.RpcError) -> str:
    """One readable line (plus field violations) for an RPC error."""
    code = err.code() if isinstance(err, grpc.Call) else None
    message = err.details() if isinstance(err, grpc.Call) else str(err)
    name = code.name if code is not None else "ERROR"
    lines = [f"{name}: {message}"]
    status = rpc_status.from_call(err) if isinstance(err, grpc.Call) else None
    details: list[Any] = list(status.details) if status else []
    for detail in details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            lines += [f"  - {v.field}: {v.description}" for v in bad.field_violations]
    return "\n".join(lines)


TokenProvider = Callable[[], str]  # the bearer token to send now (e.g. an IdP access token)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call; a provider is asked
    on every call, so a token it refreshes is used from the next call on."""

    def __init__(self, token: str | TokenProvider) -> None:
        self._token = token

    def _with_token(self, details: Any) -> Any:
        token = self._token if isinstance(self._token, str) else self._token()
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def open_channel(
    address: str,
    *,
    token: str | TokenProvider | None = None,
    tls_ca: bytes | None = None,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    tls: bool = False,
) -> grpc.Channel:
    """A channel to the server: TLS when any TLS option is given (the CA
    defaults to the system's), mTLS with a client certificate and key.
    ``token`` is a bearer token, or a provider asked for one on every call
    (``registry_server.client.idp_tokens.ClientCredentials``).

    Every call carries the current trace context (W3C ``traceparent``), so a
    server with tracing on continues the caller's trace; with an OpenTelemetry
    SDK installed in this process, each call is also a client span."""
    if tls or tls_ca or tls_cert:
        creds = grpc.ssl_channel_credentials(tls_ca, tls_key, tls_cert)
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return grpc.intercept_channel(channel, TraceContext())


class ApprovalWaitError(Exception):
    """``wait_for_approval`` gave up: the request expired, was already used,
    or the wait timed out. ``request`` is the last state seen (None if the
    wait timed out before the first answer)."""

    def __init__(self, message: str, request: ApprovalRequestView | None) -> None:
        super().__init__(message)
        self.request = request


@dataclass(frozen=True)
class CallResult:
    """The outcome of one tool call (the domain form of ``ToolResult``)."""

    success: bool
    status: Status
    content: str  # stdout as text, for the model
    data: Any  # stdout parsed as JSON when it is a JSON value, else None
    error: str  # an LLM-readable reason when not success
    exit_code: int
    stderr: str
    duration_ms: int
    output_truncated: bool
    execution_id: str
    approval_request: ApprovalRequestView | None  # set with APPROVAL_REQUIRED

    @property
    def needs_approval(self) -> bool:
        return self.status is Status.APPROVAL_REQUIRED


@dataclass(frozen=True)
class StreamEvent:
    """One event of ``stream_tool``: a chunk of stdout or stderr, or (last) the result."""

    stdout: bytes = b""
    stderr: bytes = b""
    result: CallResult | None = None


def approval_from_message(msg: pb.ApprovalRequest) -> ApprovalRequestView:
    """The domain form of an ApprovalRequest message (times in UTC)."""
    return convert.approval_request_from_pb(msg)


def result_from_message(msg: pb.ToolResult) -> CallResult:
    """The domain form of a ToolResult message; an unknown status is SANDBOX_ERROR
    (a newer server's outcome this client cannot name is still a failure)."""
    return CallResult(
        success=msg.success,
        status=convert.status_from_pb(int(msg.status)),
        content=msg.content,
        data=convert.data_from_pb(msg.data_json),
        error=msg.error,
        exit_code=msg.exit_code,
        stderr=msg.stderr,
        duration_ms=msg.duration_ms,
        output_truncated=msg.output_truncated,
        execution_id=msg.execution_id,
        approval_request=(
            approval_from_message(msg.approval_request)
            if msg.HasField("approval_request")
            else None
        ),
    )


def arguments_text(arguments: Mapping[str, Any] | str) -> str:
    # A string is sent as-is (the model's own JSON text, so the server judges it
    # and its digest matches what approvers sign); a mapping is encoded here.
    if isinstance(arguments, str):
        return arguments
    return json.dumps(dict(arguments), ensure_ascii=False, separators=(",", ":"))


def _pem(value: bytes | str | Path | None, what: str) -> bytes | None:
    """PEM bytes as given, or read from a path (ConfigError naming it)."""
    if value is None or isinstance(value, bytes):
        return value
    return read_credential(Path(value), what)


class RegistryClient:
    def __init__(
        self,
        address: str | None = None,
        *,
        channel: grpc.Channel | None = None,
        token: str | TokenProvider | None = None,
    ) -> None:
        self.address = address or default_address()
        self._channel = channel or open_channel(self.address, token=token)
        self.stub = pb_grpc.ToolRegistryStub(self._channel)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------ domain API

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        *,
        token: str | TokenProvider | None = None,
        tls_ca: bytes | str | Path | None = None,
        tls_cert: bytes | str | Path | None = None,
        tls_key: bytes | str | Path | None = None,
        tls: bool = False,
    ) -> RegistryClient:
        """A client for ``address`` (default: $TOOLREG_ADDRESS or 127.0.0.1:50051).

        ``token`` is sent as ``authorization: Bearer``: a string, or a provider
        asked on every call (an IdP's access tokens, refreshed before expiry:
        ``registry_server.client.idp_tokens.ClientCredentials``). TLS is used when ``tls``
        or any TLS option is given; ``tls_ca``/``tls_cert``/``tls_key`` are PEM
        bytes or paths to PEM files (cert + key = mutual TLS)."""
        target = address or default_address()
        channel = open_channel(
            target,
            token=token,
            tls_ca=_pem(tls_ca, "TLS CA"),
            tls_cert=_pem(tls_cert, "client certificate"),
            tls_key=_pem(tls_key, "client key"),
            tls=tls,
        )
        return cls(target, channel=channel)

    def register_tool(self, tool: ToolDefinition, *, replace: bool = False) -> ToolDefinition:
        """RegisterTool; returns the stored definition (with its digest).
        Raises grpc.RpcError: INVALID_ARGUMENT, ALREADY_EXISTS, PERMISSION_DENIED."""
        return tool_from_message(self.register(tool, replace=replace))

    def get_tool(self, name: str) -> ToolDefinition:
        """GetTool. Raises grpc.RpcError NOT_FOUND for an unknown name."""
        return tool_from_message(self.get(name))

    def delete_tool(self, name: str, reason: str = "") -> None:
        """DeleteTool (the tool's owner or an admin): it is no longer listed or
        run, its warm containers go, its open approval requests are VOIDED with
        ``reason`` (at most 1,000 characters, no control characters); a call
        already running finishes. Raises grpc.RpcError: NOT_FOUND,
        PERMISSION_DENIED, INVALID_ARGUMENT."""
        self.stub.DeleteTool(
            pb.DeleteToolRequest(name=name, reason=reason), timeout=DEFAULT_TIMEOUT_S
        )

    def set_tool_enabled(self, name: str, enabled: bool, reason: str = "") -> ToolDefinition:
        """SetToolEnabled, the kill switch (admins): disable the tool for
        ``reason`` (required; calls are refused with TOOL_DISABLED and it, open
        approval requests are VOIDED), or enable it again. Returns the tool as
        it is now (``disabled``, ``disabled_reason``). Raises grpc.RpcError:
        NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT."""
        msg: pb.Tool = self.stub.SetToolEnabled(
            pb.SetToolEnabledRequest(name=name, enabled=enabled, reason=reason),
            timeout=DEFAULT_TIMEOUT_S,
        )
        return tool_from_message(msg)

    def list_tool_definitions(
        self,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        *,
        page_size: int = 0,
    ) -> list[ToolDefinition]:
        """ListTools: tools at or below ``max_level`` with any of ``categories``,
        every page (``page_size`` tools a page; 0 = the server's default)."""
        return [tool_from_message(t) for t in self.list_tools(max_level, categories, page_size)]

    def tools_page(
        self,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        *,
        page_size: int = 0,
        page_token: str = "",
    ) -> Page[ToolDefinition]:
        """One page of ListTools, and the token of the next ("" on the last);
        pass the same filters with that token."""
        msg = self.list_tools_page(max_level, categories, page_size, page_token)
        return Page([tool_from_message(t) for t in msg.tools], msg.next_page_token)

    def tool_schemas(
        self,
        fmt: SchemaFormat = SchemaFormat.OPENAI,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        *,
        page_size: int = 0,
    ) -> list[dict[str, Any]]:
        """GetToolSchemas, parsed, every page: the list to hand to a model as its tools."""
        categories = list(categories)

        def fetch(token: str) -> tuple[list[dict[str, Any]], str]:
            page = self.tool_schemas_page(
                fmt, max_level, categories, page_size=page_size, page_token=token
            )
            return page.items, page.next_page_token

        return list(follow_pages(fetch))

    def tool_schemas_page(
        self,
        fmt: SchemaFormat = SchemaFormat.OPENAI,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        *,
        page_size: int = 0,
        page_token: str = "",
    ) -> Page[dict[str, Any]]:
        """One page of GetToolSchemas, parsed, and the token of the next."""
        msg = self.schemas_page(fmt, max_level, categories, page_size, page_token)
        parsed = json.loads(msg.schemas_json)
        if not isinstance(parsed, list):
            raise ValueError("GetToolSchemas did not return a JSON array")
        return Page([dict(item) for item in parsed], msg.next_page_token)

    def execute_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | str = "{}",
        *,
        approval_tokens: Iterable[str] = (),
        approval_request_id: str = "",
        timeout: float | None = None,
    ) -> CallResult:
        """ExecuteTool. Every outcome of the call is a CallResult; only a failed
        request (UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...) raises grpc.RpcError.
        ``timeout`` (seconds) bounds the RPC; None waits for the tool's own limit."""
        msg = self.execute(
            name,
            arguments_text(arguments),
            tokens=approval_tokens,
            request_id=approval_request_id,
            timeout=timeout,
        )
        return result_from_message(msg)

    def stream_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | str = "{}",
        *,
        approval_tokens: Iterable[str] = (),
        approval_request_id: str = "",
        timeout: float | None = None,
        reattach: bool = True,
    ) -> Iterator[StreamEvent]:
        """StreamExecuteTool: stdout/stderr chunks as they arrive, then one
        event whose ``result`` is the CallResult. A stream that breaks in
        transit mid-call is re-attached on its own (every byte comes once).
        Events this client does not know are skipped. With ``reattach`` (the
        default) the server lets a started call run on when the stream ends,
        so abandoning the iterator stops reading, not the tool (it ends at its
        own timeout); ``reattach=False``: the call is cancelled instead."""
        for event in self.stream(
            name,
            arguments_text(arguments),
            tokens=approval_tokens,
            request_id=approval_request_id,
            timeout=timeout,
            reattach=reattach,
        ):
            kind = event.WhichOneof("event")
            if kind == "stdout":
                yield StreamEvent(stdout=event.stdout)
            elif kind == "stderr":
                yield StreamEvent(stderr=event.stderr)
            elif kind == "result":
                yield StreamEvent(result=result_from_message(event.result))

    def list_approval_requests(
        self, state: str = "", limit: int = 0, *, page_size: int = 0
    ) -> list[ApprovalRequestView]:
        """ListApprovalRequests, newest first (state: PENDING, APPROVED, CONSUMED,
        REJECTED, VOIDED, EXPIRED or "" = all), every page: at most ``limit``
        (0 = all), ``page_size`` a page (0 = ``limit``, else the server's default)."""
        found = self.approval_requests(state, limit, page_size=page_size)
        return [approval_from_message(r) for r in found]

    def approval_requests_page(
        self, state: str = "", *, page_size: int = 0, page_token: str = ""
    ) -> Page[ApprovalRequestView]:
        """One page of ListApprovalRequests, and the token of the next ("" on the last)."""
        msg = self.approval_requests_page_message(state, page_size, page_token)
        return Page([approval_from_message(r) for r in msg.requests], msg.next_page_token)

    def get_approval_request(self, request_id: str) -> ApprovalRequestView:
        """GetApprovalRequest. Raises grpc.RpcError NOT_FOUND for an unknown id."""
        return approval_from_message(self.approval_request(request_id))

    def submit_approval_token(self, request_id: str, token: str) -> ApprovalRequestView:
        """SubmitApproval, returning the updated request. A token that does not
        approve this request raises grpc.RpcError (the reason is in details())."""
        return approval_from_message(self.submit_approval(request_id, token))

    def reject_approval_request(self, request_id: str, reason: str) -> ApprovalRequestView:
        """RejectApprovalRequest: refuse the request for good, telling the agent
        ``reason`` (1 to 1,000 characters, no control characters)."""
        msg: pb.ApprovalRequest = self.stub.RejectApprovalRequest(
            pb.RejectApprovalRequestRequest(request_id=request_id, reason=reason),
            timeout=DEFAULT_TIMEOUT_S,
        )
        return approval_from_message(msg)

    def watch_approval_requests(
        self, request_id: str = "", *, timeout_s: float | None = None
    ) -> Iterator[ApprovalEventView]:
        """WatchApprovalRequests: the open requests the caller may see (CURRENT),
        one SYNCED, then every change as it happens, until ``timeout_s`` (None:
        until the server ends it) or the iterator is closed, which cancels the
        stream. Requests come in their listed form (no arguments)."""
        call = self.stub.WatchApprovalRequests(
            pb.WatchApprovalRequestsRequest(request_id=request_id), timeout=timeout_s
        )
        try:
            for msg in call:
                yield convert.approval_event_from_pb(msg)
        finally:
            call.cancel()

    def wait_for_approval(
        self, request_id: str, *, timeout_s: float, poll_s: float = DEFAULT_POLL_S
    ) -> ApprovalRequestView:
        """Wait until the request is APPROVED and return it (whole), following
        WatchApprovalRequests: no polling, the answer comes the moment the last
        approver signs. Raises ApprovalWaitError when it is rejected (with the
        approver's reason), expired or consumed, or after ``timeout_s`` seconds;
        grpc.RpcError when the server fails. ``poll_s`` is used only against a
        server too old to watch (UNIMPLEMENTED)."""
        deadline = time.monotonic() + timeout_s
        last: ApprovalRequestView | None = None
        while (remaining := deadline - time.monotonic()) > 0:
            opened = time.monotonic()
            try:
                for event in self.watch_approval_requests(request_id, timeout_s=remaining):
                    if event.request is None:
                        continue
                    last = event.request
                    if _settled(last):
                        return self._approved_or_raise(request_id, last)
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    return self._poll_for_approval(request_id, deadline, timeout_s, poll_s)
                if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED):
                    raise
            # The stream ended (server stopping, fell behind, deadline): look again,
            # after a pause when it ended at once (a server that keeps ending it).
            if time.monotonic() - opened < REWATCH_PAUSE_AFTER_S:
                time.sleep(min(REWATCH_PAUSE_S, max(0.0, deadline - time.monotonic())))
        last = self.get_approval_request(request_id)
        if _settled(last):
            return self._approved_or_raise(request_id, last)
        raise _still_waiting(request_id, last, timeout_s)

    def _approved_or_raise(self, request_id: str, seen: ApprovalRequestView) -> ApprovalRequestView:
        if seen.state == "APPROVED":
            return self.get_approval_request(request_id)
        if seen.state == "REJECTED":
            raise ApprovalWaitError(
                f"approval request {request_id} was rejected by {seen.rejected_by}:"
                f" {seen.rejection_reason}",
                seen,
            )
        if seen.state == "VOIDED" and seen.voided_reason:
            raise ApprovalWaitError(
                f"approval request {request_id} is voided: {seen.voided_reason}", seen
            )
        raise ApprovalWaitError(f"approval request {request_id} is {seen.state.lower()}", seen)

    def _poll_for_approval(
        self, request_id: str, deadline: float, timeout_s: float, poll_s: float
    ) -> ApprovalRequestView:
        while True:
            last = self.get_approval_request(request_id)
            if _settled(last):
                return self._approved_or_raise(request_id, last)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _still_waiting(request_id, last, timeout_s)
            time.sleep(min(poll_s, remaining))

    # ----------------------------------------------------- message-level API

    def register(self, tool: ToolDefinition, *, replace: bool = False) -> pb.Tool:
        request = pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=replace)
        result: pb.Tool = self.stub.RegisterTool(request, timeout=DEFAULT_TIMEOUT_S)
        return result

    def get(self, name: str) -> pb.Tool:
        result: pb.Tool = self.stub.GetTool(pb.GetToolRequest(name=name), timeout=DEFAULT_TIMEOUT_S)
        return result

    def list_tools(
        self,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        page_size: int = 0,
    ) -> list[pb.Tool]:
        """ListTools, every page."""
        categories = list(categories)

        def fetch(token: str) -> tuple[list[pb.Tool], str]:
            msg = self.list_tools_page(max_level, categories, page_size, token)
            return list(msg.tools), msg.next_page_token

        return list(follow_pages(fetch))

    def list_tools_page(
        self,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        page_size: int = 0,
        page_token: str = "",
    ) -> pb.ListToolsResponse:
        request = pb.ListToolsRequest(
            max_safety_level=convert.max_level_to_pb(max_level),
            categories=list(categories),
            page_size=page_size,
            page_token=page_token,
        )
        result: pb.ListToolsResponse = self.stub.ListTools(request, timeout=DEFAULT_TIMEOUT_S)
        return result

    def schemas(
        self,
        fmt: SchemaFormat,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        page_size: int = 0,
    ) -> str:
        """GetToolSchemas, every page, as one JSON array text."""
        categories = list(categories)

        def fetch(token: str) -> tuple[list[str], str]:
            msg = self.schemas_page(fmt, max_level, categories, page_size, token)
            return [msg.schemas_json], msg.next_page_token

        return join_json_arrays(list(follow_pages(fetch)))

    def schemas_page(
        self,
        fmt: SchemaFormat,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
        page_size: int = 0,
        page_token: str = "",
    ) -> pb.GetToolSchemasResponse:
        request = pb.GetToolSchemasRequest(
            format=convert.format_to_pb(fmt),
            max_safety_level=convert.max_level_to_pb(max_level),
            categories=list(categories),
            page_size=page_size,
            page_token=page_token,
        )
        result: pb.GetToolSchemasResponse = self.stub.GetToolSchemas(
            request, timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def execute(
        self,
        name: str,
        arguments: str = "{}",
        *,
        tokens: Iterable[str] = (),
        request_id: str = "",
        timeout: float | None = None,
    ) -> pb.ToolResult:
        request = _execute_request(name, arguments, tokens, request_id)
        result: pb.ToolResult = self.stub.ExecuteTool(request, timeout=timeout)
        return result

    def reload_policy(self) -> pb.ServerInfo:
        """ReloadPolicy (admins): this server and every server on its store
        re-read their policy files. FAILED_PRECONDITION names every problem."""
        info: pb.ServerInfo = self.stub.ReloadPolicy(
            pb.ReloadPolicyRequest(), timeout=DEFAULT_TIMEOUT_S
        )
        return info

    def server_info(self) -> pb.ServerInfo:
        """GetServerInfo: the digest of the policy this server enforces."""
        info: pb.ServerInfo = self.stub.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=DEFAULT_TIMEOUT_S
        )
        return info

    def approval_request(self, request_id: str) -> pb.ApprovalRequest:
        result: pb.ApprovalRequest = self.stub.GetApprovalRequest(
            pb.GetApprovalRequestRequest(id=request_id), timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def approval_requests(
        self, state: str = "", limit: int = 0, *, page_size: int = 0
    ) -> list[pb.ApprovalRequest]:
        """ListApprovalRequests, every page: at most ``limit`` (0 = all)."""
        size = page_size or limit

        def fetch(token: str) -> tuple[list[pb.ApprovalRequest], str]:
            msg = self.approval_requests_page_message(state, size, token)
            return list(msg.requests), msg.next_page_token

        found = []
        for request in follow_pages(fetch):
            found.append(request)
            if len(found) == limit:
                break
        return found

    def approval_requests_page_message(
        self, state: str = "", page_size: int = 0, page_token: str = ""
    ) -> pb.ListApprovalRequestsResponse:
        request = pb.ListApprovalRequestsRequest(
            state=state, page_size=page_size, page_token=page_token
        )
        result: pb.ListApprovalRequestsResponse = self.stub.ListApprovalRequests(
            request, timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def submit_approval(self, request_id: str, token: str) -> pb.ApprovalRequest:
        result: pb.ApprovalRequest = self.stub.SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request_id, token=token), timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def stream(
        self,
        name: str,
        arguments: str = "{}",
        *,
        tokens: Iterable[str] = (),
        request_id: str = "",
        timeout: float | None = None,
        reattach: bool = True,
    ) -> Iterator[pb.ExecutionEvent]:
        """StreamExecuteTool's events. ``reattach``: a stream that breaks in
        transit once the call started is re-attached (client/reattach.py) and
        the call runs on meanwhile; False: it ends with the error, and the
        server cancels the call."""
        request = _execute_request(name, arguments, tokens, request_id)
        if not reattach:
            yield from self.stub.StreamExecuteTool(request, timeout=timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = self.stub.StreamExecuteTool(
            request, timeout=timeout, metadata=(REATTACH_METADATA,)
        )
        yield from reattaching(self.stub, stream, deadline=deadline)

    def attach(
        self,
        execution_id: str,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        *,
        timeout: float | None = None,
    ) -> Iterator[pb.ExecutionEvent]:
        """AttachExecution: a started call's events after the offsets, then its
        result. NOT_FOUND once it is no longer kept, or if it is another client's."""
        request = pb.AttachExecutionRequest(
            execution_id=execution_id, stdout_offset=stdout_offset, stderr_offset=stderr_offset
        )
        yield from self.stub.AttachExecution(request, timeout=timeout)

    def cancel(
        self, execution_id: str, reason: str = "", *, timeout: float | None = None
    ) -> pb.CancelExecutionResponse:
        """CancelExecution: stop a call StreamExecuteTool started (this client's,
        or any as an admin); its result becomes CANCELLED. NOT_FOUND for an
        unknown or another client's call, FAILED_PRECONDITION once it ended."""
        request = pb.CancelExecutionRequest(execution_id=execution_id, reason=reason)
        response: pb.CancelExecutionResponse = self.stub.CancelExecution(request, timeout=timeout)
        return response


def _execute_request(
    name: str, arguments: str, tokens: Iterable[str], request_id: str
) -> pb.ExecuteToolRequest:
    return pb.ExecuteToolRequest(
        name=name,
        arguments_json=arguments,
        approval_tokens=list(tokens),
        approval_request_id=request_id,
    )


def tool_from_message(msg: pb.Tool) -> ToolDefinition:
    """The domain form of a Tool the server sent (re-validated)."""
    return convert.stored_tool_from_pb(msg)


__all__ = [
    "ApprovalRequestView",
    "ApprovalWaitError",
    "CallResult",
    "RegistryClient",
    "Status",
    "StreamEvent",
    "approval_from_message",
    "arguments_text",
    "default_address",
    "describe_rpc_error",
    "open_channel",
    "result_from_message",
    "tool_from_message",
]

"""Serve the toolreg registry as an MCP server (``toolreg mcp``): over stdio
by default, or over Streamable HTTP with ``--http`` (``http.py``).

The bridge is a gRPC *client* of a running ``toolreg serve``: ``tools/list``
answers with the tools this client may see (ListTools, optionally filtered by
``--max-level`` and ``--category``) and ``tools/call`` runs the call through
``ExecuteTool``, so every call takes the server's own path: argument
validation, policy, approvals, audit and a fresh sandbox.

Who the registry sees: over stdio, the bridge's own ``--token``; over HTTP,
the bearer token of the MCP client that sent the request (each MCP client is
its own registry client, with its own roles, level cap and approvals). The
``Bridge`` asks ``client_for(ctx)`` for the registry client of each request.

Mapping:

* ``inputSchema`` is the tool's registered JSON Schema, unchanged.
* annotations come from the safety level: safe = ``readOnlyHint``; cautious =
  neither read-only nor destructive; dangerous = ``destructiveHint``;
  ``openWorldHint`` is false for all (sandboxes have no network).
* a successful call gives its stdout as text, and as ``structuredContent``
  when stdout is a JSON object; any other outcome is ``isError`` with the
  server's reason (``STATUS: reason``).
* progress: when a ``tools/call`` carries ``_meta.progressToken``, the call
  runs through ``StreamExecuteTool`` instead, and every stdout/stderr chunk
  becomes a ``notifications/progress`` with that token: ``progress`` is the
  number of output bytes so far (stdout and stderr together, so it only
  grows), ``message`` a short preview of the chunk (``stdout: <last line>``,
  at most ``PROGRESS_MESSAGE_CHARS``, control characters escaped). At most one
  notification per ``PROGRESS_MIN_INTERVAL_S``; chunks in between are counted
  in the next one, and the last count is sent before the result. The result
  is the same as without a token. Cancelling the MCP request cancels the gRPC
  stream, which stops the sandbox.
* a dangerous call without approvals gives ``isError`` with the approval
  request id. Approvers approve it (``toolreg approvals approve ID --key
  KEY``); the caller then calls the tool again with the same arguments plus
  the key ``_approval_request_id`` (the id). The bridge strips that key from
  the arguments before sending them and passes it as
  ``ExecuteToolRequest.approval_request_id``. It is deliberately not part of
  any ``inputSchema``.
* ``tools/list`` answers a page at a time (the server's default page size):
  MCP's ``cursor`` is sent as ListTools' ``page_token`` and its
  ``next_page_token`` comes back as ``nextCursor`` (absent on the last page).
  A cursor the server refuses (altered, or from a bridge with other filters)
  is JSON-RPC error -32602 (invalid params), as the MCP spec asks.
* gRPC failures (server down, permission denied, ...) become ``isError``
  results with a readable message on ``tools/call``, and JSON-RPC errors on
  ``tools/list``; the bridge itself keeps running.

Over stdio, stdout is the MCP channel: logs go to stderr only.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import anyio
import anyio.to_thread
import grpc
import mcp.types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.idp_tokens import TokenError
from registry_server.client.registry_client import (
    RegistryClient,
    arguments_text,
    describe_rpc_error,
)
from registry_server.domain.models import NAME_PATTERN, SafetyLevel, valid_tool_name
from registry_server.mcp.approvals import (
    DEFAULT_STATE_TTL_S,
    INVALID_STATE,
    ApprovalInputs,
    ApprovalState,
    boundary,
    is_modern,
)
from registry_server.mcp.progress import EventStream, ProgressReporter
from registry_server.mcp.tasks import install_tasks
from registry_server.wire import convert

log = logging.getLogger("toolreg.mcp")

APPROVAL_REQUEST_KEY = "_approval_request_id"
"""Argument key a caller adds to retry a dangerous call with its approvals."""

SERVER_NAME = "toolreg"

LIST_TTL_MS = 30_000  # ms a host may reuse a tools/list page (see list_tools)

_ANNOTATIONS: dict[int, tuple[bool, bool]] = {
    pb.SAFETY_LEVEL_SAFE: (True, False),
    pb.SAFETY_LEVEL_CAUTIOUS: (False, False),
    pb.SAFETY_LEVEL_DANGEROUS: (False, True),
}


def annotations_for(level: int) -> types.ToolAnnotations:
    """MCP hints for a proto safety level (unspecified counts as safe)."""
    read_only, destructive = _ANNOTATIONS.get(level, (True, False))
    return types.ToolAnnotations(
        read_only_hint=read_only, destructive_hint=destructive, open_world_hint=False
    )


def tool_to_mcp(tool: pb.Tool) -> types.Tool:
    schema = json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}
    if not isinstance(schema, dict):  # the server validates this; never trust blindly
        schema = {"type": "object"}
    return types.Tool(
        name=tool.name,
        description=tool.description,
        input_schema=schema,
        annotations=annotations_for(tool.safety_level),
    )


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def approval_message(tool_name: str, req: pb.ApprovalRequest) -> str:
    """The text of an APPROVAL_REQUIRED result: the request id and what to do.

    Written here rather than passing on the server's reason, which speaks of
    the gRPC field ``approval_request_id``; over MCP the retry key is
    ``_approval_request_id`` in the arguments."""
    state = req.state or "PENDING"
    return (
        f"APPROVAL_REQUIRED: tool {tool_name!r} is dangerous and needs"
        f" {req.approvals_required} approval(s) before it runs;"
        f" {len(req.approved_by)} so far.\n"
        f"Approval request id: {req.id} (state {state}).\n"
        f"Ask an approver to approve it: `toolreg approvals approve {req.id} --key KEY`.\n"
        f"Once approved, call {tool_name} again with the same arguments plus"
        f' "{APPROVAL_REQUEST_KEY}": "{req.id}".'
    )


def result_to_mcp(tool_name: str, result: pb.ToolResult) -> types.CallToolResult:
    """Map a ToolResult onto an MCP CallToolResult."""
    if result.success:
        content: list[types.ContentBlock] = [_text(result.content)]
        if result.output_truncated:
            content.append(_text("[output truncated: the tool wrote more than its byte cap]"))
        data = convert.data_from_pb(result.data_json)
        structured = data if isinstance(data, dict) else None
        return types.CallToolResult(content=content, structured_content=structured)

    status = convert.status_name(result.status)
    if result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED and result.approval_request.id:
        text = approval_message(tool_name, result.approval_request)
    else:
        text = f"{status}: {result.error}" if result.error else status
    content = [_text(text)]
    if result.content and result.status != pb.EXECUTION_STATUS_APPROVAL_REQUIRED:
        content.append(_text(f"stdout:\n{result.content}"))
    return types.CallToolResult(content=content, is_error=True)


ClientFor = Callable[[ServerRequestContext[Any]], RegistryClient]
"""The registry client to use for one MCP request (who the registry sees)."""


class Bridge:
    """The MCP handlers over the registry (blocking gRPC, run in threads).

    ``client`` is one RegistryClient for every request (stdio), or a function
    giving the registry client of each request (HTTP: the MCP client's own)."""

    def __init__(
        self,
        client: RegistryClient | ClientFor,
        *,
        max_level: SafetyLevel | None = None,
        categories: Sequence[str] = (),
        execute_timeout: float | None = None,
        identity_provider: str | None = None,
        console_url: str = "",
        state_ttl_s: float = DEFAULT_STATE_TTL_S,
    ) -> None:
        if isinstance(client, RegistryClient):
            fixed = client
            self.client_for: ClientFor = lambda ctx: fixed
        else:
            self.client_for = client
        self.max_level = max_level
        self.categories = tuple(categories)
        self.execute_timeout = execute_timeout
        # The policy id of the provider people's tokens are exchanged at (OAuth), for messages.
        self.identity_provider = identity_provider
        # With the console's URL, approvals are asked for as input requests
        # (approvals.py); without, a dangerous call answers the text of old.
        self.approvals = ApprovalInputs(console_url) if console_url else None
        self.state_ttl_s = state_ttl_s

    @staticmethod
    def _rpc_message(client: RegistryClient, err: grpc.RpcError) -> str:
        if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE:
            return (
                f"UNAVAILABLE: cannot reach the toolreg server at {client.address}"
                f" ({err.details()}); is `toolreg serve` running?"
            )
        return describe_rpc_error(err)

    def _page(self, client: RegistryClient, cursor: str) -> pb.ListToolsResponse:
        return client.list_tools_page(self.max_level, self.categories, page_token=cursor)

    def _offered(self, client: RegistryClient, name: str) -> bool:
        """Whether this bridge's filters let the tool through (as ListTools
        filters: at or below the level, any of the categories). One GetTool,
        not a walk through every page of the listing."""
        try:
            tool = convert.stored_tool_from_pb(client.get(name))
        except grpc.RpcError as err:
            if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        if self.max_level is not None and not tool.safety_level.at_most(self.max_level):
            return False
        return not self.categories or not set(self.categories).isdisjoint(tool.categories)

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        client = self.client_for(ctx)
        cursor = (params.cursor if params is not None else None) or ""
        try:
            page = await anyio.to_thread.run_sync(self._page, client, cursor)
        except grpc.RpcError as err:
            message = self._rpc_message(client, err)
            if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise MCPError(types.INVALID_PARAMS, f"invalid cursor: {message}") from None
            log.warning("ListTools failed: %s", message)
            raise MCPError(types.INTERNAL_ERROR, message) from None
        except TokenError as err:
            raise MCPError(types.INTERNAL_ERROR, self._exchange_refused(err)) from None
        # A disabled tool is not offered to the model (every call would be refused).
        offered = [tool_to_mcp(t) for t in page.tools if not t.disabled]
        # Private: the list is what this caller may see (its level cap, roles).
        # The TTL: an operator registers, replaces or disables a tool at any
        # moment and no listChanged notification follows, so a host should look
        # again soon; 30 s keeps a new tool visible within a person's "register,
        # then try it" and spares a host that lists before every turn. A stale
        # list is harmless: every call is checked by the server anew.
        return types.ListToolsResult(
            tools=offered,
            next_cursor=page.next_page_token or None,
            ttl_ms=LIST_TTL_MS,
            cache_scope="private",
        )

    def _exchange_refused(self, err: TokenError) -> str:
        """The answer when the registry token of an IdP-signed-in person could
        not be had (RFC 8693 exchange refused or the provider unreachable): one
        log line naming the provider and its reason (TokenError carries no
        secret), no traceback, and a readable message for the host."""
        provider = f"identity provider {self.identity_provider or '?'}"
        log.warning("token exchange at %s failed: %s", provider, err)
        what = "could not be reached" if err.unreachable else "refused the token exchange"
        return (
            f"UNAUTHENTICATED: {provider} {what} for this person's registry token ({err});"
            " the call was not made"
        )

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        client = self.client_for(ctx)
        name = params.name
        if not valid_tool_name(name):
            # Checked first: a name that is not a name (unbounded text from the MCP
            # client) never reaches a log line or the registry.
            # An unknown tool is invalid params, as MCP says (2025-11-25 and 2026-07-28).
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: names match {NAME_PATTERN}")
        arguments = dict(params.arguments or {})
        request_id = arguments.pop(APPROVAL_REQUEST_KEY, "")
        if not isinstance(request_id, str):
            return types.CallToolResult(
                content=[_text(f"INVALID_ARGUMENTS: {APPROVAL_REQUEST_KEY} must be a string")],
                is_error=True,
            )
        if params.request_state is not None:
            # A retry after an input request: the SDK has verified the seal and
            # its envelope; the state must also name this very call and caller.
            state = ApprovalState.check(params.request_state, ctx, name, arguments)
            if request_id and request_id != state.request_id:
                raise MCPError(types.INVALID_PARAMS, INVALID_STATE)
            request_id = state.request_id
            if ApprovalInputs.declined(params):
                return types.CallToolResult(
                    content=[_text(
                        f"APPROVAL_REQUIRED: the approval page was declined; the call was not"
                        f" made. Approval request {request_id} stays open until it expires."
                    )],
                    is_error=True,
                )  # fmt: skip
        outcome = await self._run(ctx, client, name, arguments, request_id)
        if not isinstance(outcome, pb.ToolResult):
            return outcome
        pending = (
            outcome.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
            and outcome.approval_request.id
            and self.approvals is not None
        )
        if pending and self.approvals is not None:
            if is_modern(ctx):
                return self.approvals.input_required(ctx, name, arguments, outcome.approval_request)
            if ApprovalInputs.url_elicitation_declared(ctx):
                again = await self._elicit_then_retry(ctx, client, name, arguments, outcome)
                if not isinstance(again, pb.ToolResult):
                    return again
                outcome = again
        return result_to_mcp(name, outcome)

    async def _elicit_then_retry(
        self,
        ctx: ServerRequestContext[Any],
        client: RegistryClient,
        name: str,
        arguments: dict[str, Any],
        outcome: pb.ToolResult,
    ) -> pb.ToolResult | types.CallToolResult:
        """2025-11-25 with URL elicitation: show the person the approval page
        (``elicitation/create``); once they answer, try the call once more.
        A host that never answers gets the text answer after the state's
        lifetime (the wait is bounded as a 2026-07-28 retry is)."""
        assert self.approvals is not None
        req = outcome.approval_request
        accepted = False
        with anyio.move_on_after(self.state_ttl_s):
            answer = await ctx.session.elicit_url(
                self.approvals.message(name, req),
                self.approvals.page(req.id),
                req.id,
                related_request_id=ctx.request_id,
            )
            accepted = answer.action == "accept"
        if not accepted:
            return outcome
        return await self._run(ctx, client, name, arguments, req.id)

    async def _run(
        self,
        ctx: ServerRequestContext[Any],
        client: RegistryClient,
        name: str,
        arguments: dict[str, Any],
        request_id: str,
    ) -> pb.ToolResult | types.CallToolResult:
        """One ExecuteTool (or StreamExecuteTool, with a progress token): its
        ToolResult, or the error result of a call that could not be made."""
        # The SDK has already taken the token from _meta; only whether there is one matters here.
        wants_progress = ctx.meta is not None and ctx.meta.get("progress_token") is not None
        try:
            # A filtered bridge must not run tools its listing hides.
            filtered = self.max_level is not None or bool(self.categories)
            if filtered and not await anyio.to_thread.run_sync(self._offered, client, name):
                raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {name!r} is not offered here")
            args_json = arguments_text(arguments)
            if wants_progress:
                request = pb.ExecuteToolRequest(
                    name=name, arguments_json=args_json, approval_request_id=request_id
                )
                result = await self._streamed(ctx, client, request)
            else:

                def run() -> pb.ToolResult:
                    return client.execute(
                        name, args_json, request_id=request_id, timeout=self.execute_timeout
                    )

                result = await anyio.to_thread.run_sync(run)
        except grpc.RpcError as err:
            message = self._rpc_message(client, err)
            log.warning("ExecuteTool %s failed: %s", name, message)
            return types.CallToolResult(content=[_text(message)], is_error=True)
        except TokenError as err:
            return types.CallToolResult(content=[_text(self._exchange_refused(err))], is_error=True)
        if result is not None and result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {name!r}")
        if result is None:
            log.warning("StreamExecuteTool %s ended without a result", name)
            return types.CallToolResult(
                content=[_text("SANDBOX_ERROR: the server ended the call without a result")],
                is_error=True,
            )
        log.info(
            "call %s -> %s (execution %s%s)",
            name,
            convert.status_name(result.status),
            result.execution_id,
            ", streamed" if wants_progress else "",
        )
        return result

    async def _streamed(
        self,
        ctx: ServerRequestContext[Any],
        client: RegistryClient,
        request: pb.ExecuteToolRequest,
    ) -> pb.ToolResult | None:
        """StreamExecuteTool, each chunk reported as progress (``mcp_progress``);
        the final ToolResult, or None if the stream ended without one."""
        events = EventStream(client.stub.StreamExecuteTool(request, timeout=self.execute_timeout))
        reporter = ProgressReporter(ctx.session.report_progress)
        result: pb.ToolResult | None = None
        try:
            while True:
                # One blocking read per event, in a worker thread; abandoned on
                # cancellation, which events.stop() below then ends.
                event = await anyio.to_thread.run_sync(events.read, abandon_on_cancel=True)
                if event is None:
                    break
                kind = event.WhichOneof("event")
                if kind == "stdout":
                    await reporter.chunk("stdout", event.stdout)
                elif kind == "stderr":
                    await reporter.chunk("stderr", event.stderr)
                elif kind == "result":
                    result = event.result
            await reporter.finish()
        finally:
            # A no-op once the call is over; otherwise (the MCP request was
            # cancelled, a notification could not be sent) the server stops
            # the sandbox, as for any client that cancels.
            events.stop()
        return result


def build_server(bridge: Bridge) -> Server[Any]:
    try:
        version = metadata.version("toolreg")
    except metadata.PackageNotFoundError:
        version = "0"
    server: Server[Any] = Server(
        SERVER_NAME,
        version=version,
        instructions=(
            "Tools of a toolreg registry; every call runs in a fresh sandbox without network."
            f" Dangerous tools need approval: retry with {APPROVAL_REQUEST_KEY!r} once approved."
        ),
        on_list_tools=bridge.list_tools,
        on_call_tool=bridge.call_tool,
    )
    # Seals every requestState the bridge hands out and checks every echo (approvals.py).
    server.middleware.append(boundary(bridge.state_ttl_s))
    # Long calls as MCP tasks: the io.modelcontextprotocol/tasks extension (tasks.py).
    install_tasks(server, bridge, result_to_mcp, approval_message)
    return server


async def serve_stdio(bridge: Bridge) -> None:
    server = build_server(bridge)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def serve(
    client: RegistryClient,
    *,
    max_level: SafetyLevel | None = None,
    categories: Sequence[str] = (),
    console_url: str = "",
    state_ttl_s: float = DEFAULT_STATE_TTL_S,
) -> None:
    """Serve MCP on stdin/stdout until the client closes stdin (blocking)."""
    bridge = Bridge(
        client,
        max_level=max_level,
        categories=categories,
        console_url=console_url,
        state_ttl_s=state_ttl_s,
    )
    log.info("MCP bridge to toolreg at %s on stdio", client.address)
    anyio.run(serve_stdio, bridge)


def configure_logging(level: str = "INFO") -> None:
    """Logs to stderr: stdout is the MCP channel. HTTP client libraries never
    log a URL (their token endpoint and JWKS fetches, with OAuth)."""
    from registry_server.api.logs import quiet_http_clients

    logging.basicConfig(
        stream=sys.stderr, level=level.upper(), format="%(asctime)s %(name)s %(message)s"
    )
    quiet_http_clients()

"""Pages (AIP-158) over real gRPC: 2,500 tools and 120 approval requests on a
real server with a real SQLite file, paged through ListTools, GetToolSchemas
and ListApprovalRequests with sizes 1, 7, 1,000 and the default while other
tools are registered between pages and by another thread; bad tokens; the
store's key shared by a second server; and every consumer following the
tokens: the Python client, the CLI, the MCP bridge and the agent adapters."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import mcp.types as types
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from mcp import ClientSession
from mcp.shared.exceptions import MCPError

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import App
from registry_server.approvals.service import DEFAULT_REQUESTS_PAGE
from registry_server.catalog.views import DEFAULT_TOOLS_PAGE, MAX_TOOLS_PAGE
from registry_server.client.registry_client import RegistryClient
from registry_server.domain import strict_json
from registry_server.domain.models import SafetyLevel, compute_digest
from registry_server.domain.pages import MAX_PAGE_TOKEN_CHARS
from registry_server.domain.schemas import SchemaFormat
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    PENDING,
    ApprovalRequestRecord,
    StoredTool,
)
from tests.factories import tool
from tests.integration.conftest import Running, start_running
from tests.integration.test_mcp_bridge import with_session

ROOT = Path(__file__).resolve().parents[2]
TOOL_COUNT = 2_500
REQUEST_COUNT = 120
LEVELS = ("safe", "cautious", "dangerous")
BASE = [f"tool_{i:04d}" for i in range(TOOL_COUNT)]  # category "base" (and "even"/"odd")


def store_tools(app: App, names: list[str], category: str) -> None:
    """Tools straight into the store in one unit of work, then served (a
    registration each would take a minute of fsyncs)."""
    template = tool()
    with app.store.unit_of_work() as uow:
        for i, name in enumerate(names):
            made = dataclasses.replace(
                template,
                name=name,
                safety_level=SafetyLevel(LEVELS[i % 3]),
                categories=tuple(sorted([category, "even" if i % 2 == 0 else "odd"])),
                description=f"Tool number {i}.",
            )  # parse_definition once, not 2,500 times: the registry parses them on reload
            manifest = strict_json.dumps(made.as_manifest())
            made = dataclasses.replace(made, digest=compute_digest(made.as_manifest()))
            uow.put_tool(StoredTool(name, manifest, made.digest, "[operator]"), time.time())
    app.registry.reload()


def store_requests(app: App, count: int, start: int = 0) -> list[ApprovalRequestRecord]:
    """``count`` requests, two at a time sharing one created_at (ties go by id):
    every 3rd APPROVED, every 4th CONSUMED, the rest PENDING."""
    made = app.registry.get("tool_0002")  # dangerous
    now = time.time()
    records = [
        ApprovalRequestRecord(
            id=f"{i:032x}",
            tool_name=made.name,
            tool_digest=made.digest,
            arguments_json='{"message":"hi"}',
            arguments_digest="0" * 64,
            requested_by="agent",
            approvals_required=1,
            state=CONSUMED if i % 4 == 0 else APPROVED if i % 3 == 0 else PENDING,
            created_at=now - 1_000 + i // 2,
            expires_at=now + 3_600,
            tool_manifest=strict_json.dumps(made.as_manifest()),
            tool_owner=made.owner,
        )
        for i in range(start, start + count)
    ]
    with app.store.unit_of_work() as uow:
        for record in records:
            uow.add_request(record)
    return records


def newest_first(records: list[ApprovalRequestRecord]) -> list[str]:
    return [r.id for r in sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pages") / "data"


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Running]:
    running = start_running(data_dir)
    try:
        store_tools(running.app, BASE, "base")
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stored(server: Running) -> list[ApprovalRequestRecord]:
    """The 120 approval requests (made once, before the first test that lists them)."""
    return store_requests(server.app, REQUEST_COUNT)


def stored_ids(server: Running, state: str = "") -> list[str]:
    """Every stored request's id, newest first, as the store has them now."""
    with server.app.store.reading() as reads:
        found = reads.requests(state=state, now=time.time(), limit=1_000_000)
    return newest_first(found)


def page_tools(
    stub: pb_grpc.ToolRegistryStub, size: int, between: Callable[[list[str]], None] = lambda _: None,
    **filters: Any,
) -> list[list[str]]:  # fmt: skip
    pages, token = [], ""
    while True:
        reply = stub.ListTools(pb.ListToolsRequest(page_size=size, page_token=token, **filters))
        pages.append([t.name for t in reply.tools])
        token = reply.next_page_token
        if not token:
            return pages
        between(pages[-1])


def page_schemas(stub: pb_grpc.ToolRegistryStub, size: int, **filters: Any) -> list[list[str]]:
    pages, token = [], ""
    while True:
        reply = stub.GetToolSchemas(
            pb.GetToolSchemasRequest(page_size=size, page_token=token, **filters)
        )
        pages.append([s["function"]["name"] for s in json.loads(reply.schemas_json)])
        token = reply.next_page_token
        if not token:
            return pages


def refusal(call: Callable[[], object]) -> tuple[str, dict[str, str]]:
    """INVALID_ARGUMENT's message and its BadRequest field violations."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()  # type: ignore[attr-defined]
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    fields: dict[str, str] = {}
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        fields.update({v.field: v.description for v in bad.field_violations})
    return err.details(), fields  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- tools


def test_without_a_size_the_first_page_is_the_default_with_a_token(server: Running) -> None:
    listed = server.stub.ListTools(pb.ListToolsRequest())
    assert [t.name for t in listed.tools] == BASE[:DEFAULT_TOOLS_PAGE]
    assert listed.next_page_token
    schemas = server.stub.GetToolSchemas(pb.GetToolSchemasRequest())
    assert len(json.loads(schemas.schemas_json)) == DEFAULT_TOOLS_PAGE
    assert schemas.next_page_token
    big = server.stub.ListTools(pb.ListToolsRequest(page_size=100_000))
    assert len(big.tools) == MAX_TOOLS_PAGE and big.next_page_token  # cut to the maximum


@pytest.mark.parametrize("size", [1, 7, 1_000, 0])
def test_every_tool_present_throughout_is_listed_once_while_tools_are_added(
    server: Running, size: int
) -> None:
    """AIP-158's guarantee with 2,500 tools: between pages, tools are registered
    just before and just after the cursor, and another thread keeps
    registering; every tool present from the first page to the last is listed
    exactly once, in order, and none twice (ListTools and GetToolSchemas)."""
    registry = server.app.registry
    stop = threading.Event()
    added_by_thread: list[str] = []

    def keep_registering() -> None:
        while not stop.is_set() and len(added_by_thread) < 60:
            name = f"churn_{size}_{len(added_by_thread):03d}"
            registry.register(tool(name=name, categories=["churn"]), check_image=False)
            added_by_thread.append(name)
            stop.wait(0.05)

    # Each change makes the next page rebuild the 2,500-tool listing: with
    # small pages, change between every few pages only.
    every = max(1, 70 // (size or DEFAULT_TOOLS_PAGE))
    pages_seen = [0]
    after: list[str] = []

    def between(page: list[str]) -> None:
        pages_seen[0] += 1
        if pages_seen[0] % every:
            return
        last = page[-1]
        for name, later in ((f"{last}_{size}_a", True), (f"a{size}_{pages_seen[0]:05d}", False)):
            registry.register(tool(name=name, categories=["churn"]), check_image=False)
            if later:
                after.append(name)

    thread = threading.Thread(target=keep_registering, daemon=True)
    thread.start()
    try:
        pages = page_tools(server.stub, size, between)
    finally:
        stop.set()
        thread.join()
    flat = [n for p in pages for n in p]
    assert len(flat) == len(set(flat)), "a tool was listed twice"
    assert [n for n in flat if n.startswith("tool_") and "_a" not in n] == BASE
    assert set(after) <= set(flat)  # registered after the cursor: reached
    assert flat == sorted(flat)
    expected = size or DEFAULT_TOOLS_PAGE
    assert all(len(p) == expected for p in pages[:-1]) and len(pages[-1]) <= expected
    # the same with schemas (and a filter, so the churn is left out)
    names = [n for p in page_schemas(server.stub, size, categories=["base"]) for n in p]
    assert names == BASE


def test_filters_apply_to_every_page(server: Running) -> None:
    want = [n for i, n in enumerate(BASE) if i % 2 == 0 and LEVELS[i % 3] != "dangerous"]
    filters = {"categories": ["even"], "max_safety_level": pb.SAFETY_LEVEL_CAUTIOUS}
    assert [n for p in page_tools(server.stub, 7, **filters) for n in p] == want
    assert [n for p in page_schemas(server.stub, 77, **filters) for n in p] == want


def test_bad_tokens_and_sizes_are_invalid_argument_naming_the_field(server: Running) -> None:
    first = server.stub.ListTools(pb.ListToolsRequest(page_size=3, categories=["base"]))
    token = first.next_page_token
    altered = token[:10] + ("A" if token[10] != "A" else "B") + token[11:]
    schema_token = server.stub.GetToolSchemas(pb.GetToolSchemasRequest(page_size=3))
    for request in (
        pb.ListToolsRequest(page_token=altered, categories=["base"]),
        pb.ListToolsRequest(page_token=token[:-4], categories=["base"]),
        pb.ListToolsRequest(page_token="not a token"),
        pb.ListToolsRequest(page_token="x" * (MAX_PAGE_TOKEN_CHARS + 1)),
        pb.ListToolsRequest(page_token=token),  # another query: other filters
        pb.ListToolsRequest(page_token=token, categories=["odd"]),
        pb.ListToolsRequest(
            page_token=token, categories=["base"], max_safety_level=pb.SAFETY_LEVEL_SAFE
        ),
        pb.ListToolsRequest(page_token=schema_token.next_page_token),  # another listing
    ):
        message, fields = refusal(lambda request=request: server.stub.ListTools(request))
        assert list(fields) == ["page_token"], message
        assert message.startswith("page_token: ")
    for request in (
        pb.GetToolSchemasRequest(page_token=token),
        pb.GetToolSchemasRequest(
            page_token=schema_token.next_page_token, format=pb.SCHEMA_FORMAT_ANTHROPIC
        ),
    ):
        message, fields = refusal(lambda request=request: server.stub.GetToolSchemas(request))
        assert list(fields) == ["page_token"], message
    _, fields = refusal(lambda: server.stub.ListTools(pb.ListToolsRequest(page_size=-1)))
    assert list(fields) == ["page_size"]
    _, fields = refusal(lambda: server.stub.GetToolSchemas(pb.GetToolSchemasRequest(page_size=-5)))
    assert list(fields) == ["page_size"]
    # only page_size may change between pages
    again = server.stub.ListTools(
        pb.ListToolsRequest(page_size=50, page_token=token, categories=["base"])
    )
    assert [t.name for t in again.tools] == BASE[3:53]


def test_another_server_on_the_store_accepts_the_token(server: Running, data_dir: Path) -> None:
    """Behind a load balancer the next page may go to another server: the key
    is the store's, not the server's. A server on another store refuses it."""
    token = server.stub.ListTools(
        pb.ListToolsRequest(page_size=10, categories=["base"])
    ).next_page_token
    second = start_running(data_dir)  # the same SQLite file
    other = start_running(data_dir.parent / "elsewhere")
    try:
        reply = second.stub.ListTools(
            pb.ListToolsRequest(page_size=10, page_token=token, categories=["base"])
        )
        assert [t.name for t in reply.tools] == BASE[10:20]
        _, fields = refusal(
            lambda: other.stub.ListTools(
                pb.ListToolsRequest(page_size=10, page_token=token, categories=["base"])
            )
        )
        assert list(fields) == ["page_token"]
    finally:
        second.stop()
        other.stop()


# ----------------------------------------------------------- approval requests


def page_requests(
    stub: pb_grpc.ToolRegistryStub, size: int, state: str = "", between: Callable[[], None] = lambda: None
) -> list[list[str]]:  # fmt: skip
    pages, token = [], ""
    while True:
        reply = stub.ListApprovalRequests(
            pb.ListApprovalRequestsRequest(state=state, page_size=size, page_token=token)
        )
        pages.append([r.id for r in reply.requests])
        token = reply.next_page_token
        if not token:
            return pages
        between()


@pytest.mark.parametrize("size", [1, 7, 0, 500])
def test_approval_requests_page_newest_first(
    server: Running, stored: list[ApprovalRequestRecord], size: int
) -> None:
    records = stored
    pages = page_requests(server.stub, size)
    assert [i for p in pages for i in p] == newest_first(records)
    expected = size or DEFAULT_REQUESTS_PAGE
    assert all(len(p) == expected for p in pages[:-1])


def test_approval_requests_page_within_a_state(
    server: Running, stored: list[ApprovalRequestRecord]
) -> None:
    records = stored
    for state in (PENDING, APPROVED, CONSUMED):
        want = newest_first([r for r in records if r.state == state])
        assert [i for p in page_requests(server.stub, 7, state) for i in p] == want
    first = server.stub.ListApprovalRequests(pb.ListApprovalRequestsRequest(state=PENDING))
    assert len(first.requests) == DEFAULT_REQUESTS_PAGE and first.next_page_token
    for request in (
        pb.ListApprovalRequestsRequest(state=APPROVED, page_token=first.next_page_token),
        pb.ListApprovalRequestsRequest(state=PENDING, page_token=first.next_page_token[:-2]),
    ):
        _, fields = refusal(lambda request=request: server.stub.ListApprovalRequests(request))
        assert list(fields) == ["page_token"]
    # the deprecated limit is the page size when page_size is 0
    limited = server.stub.ListApprovalRequests(pb.ListApprovalRequestsRequest(limit=9))
    assert len(limited.requests) == 9 and limited.next_page_token
    _, fields = refusal(
        lambda: server.stub.ListApprovalRequests(pb.ListApprovalRequestsRequest(limit=-1))
    )
    assert list(fields) == ["limit"]


def test_requests_opened_between_pages_leave_the_rest_alone(
    server: Running, stored: list[ApprovalRequestRecord]
) -> None:
    """New requests are newer than the cursor: every request that existed
    throughout is listed once, in order."""
    records = stored
    before = set(newest_first(records))
    opened = [0]

    def open_two() -> None:
        store_requests(server.app, 2, start=10_000 + 2 * opened[0])
        opened[0] += 1

    listed = [i for p in page_requests(server.stub, 11, PENDING, open_two) for i in p]
    want = newest_first([r for r in records if r.state == PENDING])
    assert [i for i in listed if i in before] == want
    assert len(listed) == len(set(listed))


# ----------------------------------------------------------------- consumers


def test_the_python_client_follows_every_page(
    server: Running, stored: list[ApprovalRequestRecord]
) -> None:
    client = RegistryClient.connect(server.address)
    try:
        base = client.list_tool_definitions(categories=["base"])
        assert [t.name for t in base] == BASE
        assert [
            t.name for t in client.list_tool_definitions(categories=["base"], page_size=999)
        ] == BASE
        schemas = client.tool_schemas(categories=["base"])
        assert [s["function"]["name"] for s in schemas] == BASE
        joined = json.loads(client.schemas(SchemaFormat.MCP, categories=["base"], page_size=300))
        assert [s["name"] for s in joined] == BASE
        page = client.tools_page(categories=["base"], page_size=5)
        assert [t.name for t in page.items] == BASE[:5] and page.next_page_token
        page = client.tools_page(categories=["base"], page_size=5, page_token=page.next_page_token)
        assert [t.name for t in page.items] == BASE[5:10]
        spage = client.tool_schemas_page(categories=["base"], page_size=2)
        assert [s["function"]["name"] for s in spage.items] == BASE[:2]
        assert [r.id for r in client.list_approval_requests(page_size=13)] == stored_ids(server)
        assert [r.id for r in client.list_approval_requests()] == stored_ids(server)
        pending = client.list_approval_requests("pending", page_size=3)
        assert [r.id for r in pending] == stored_ids(server, PENDING)
        assert [r.id for r in client.list_approval_requests(limit=30)] == stored_ids(server)[:30]
        rpage = client.approval_requests_page(CONSUMED, page_size=4)
        assert len(rpage.items) == 4 and rpage.next_page_token
    finally:
        client.close()


def cli(server: Running, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args, "--address", server.address],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_cli_lists_everything(server: Running, stored: list[ApprovalRequestRecord]) -> None:
    lines = cli(server, "tools", "list", "--category", "base").splitlines()
    assert [line.split()[0] for line in lines] == BASE
    lines = cli(server, "tools", "list", "--category", "base", "--page-size", "7").splitlines()
    assert len(lines) == TOOL_COUNT
    schemas = json.loads(cli(server, "tools", "schemas", "--format", "mcp", "--category", "base"))
    assert [s["name"] for s in schemas] == BASE
    belt = cli(server, "tools", "schemas", "--format", "text", "--category", "base")
    assert f"- {BASE[-1]} [" in belt
    listed = cli(server, "approvals", "list", "--page-size", "7").splitlines()
    assert [line.split()[0] for line in listed] == stored_ids(server)
    assert len(listed) >= REQUEST_COUNT
    consumed = cli(server, "approvals", "list", "--state", "consumed").splitlines()
    assert [line.split()[0] for line in consumed] == stored_ids(server, CONSUMED)


def test_mcp_tools_list_follows_cursors(server: Running) -> None:
    async def body(session: ClientSession) -> tuple[list[types.ListToolsResult], str]:
        pages = [await session.list_tools()]
        while pages[-1].next_cursor:
            params = types.PaginatedRequestParams(cursor=pages[-1].next_cursor)
            pages.append(await session.list_tools(params=params))
        try:
            await session.list_tools(params=types.PaginatedRequestParams(cursor="tampered"))
            refused = "accepted"
        except MCPError as exc:
            refused = f"{exc.code} {exc.message}"
        return pages, refused

    pages, refused = with_session(server.address, body, "--category", "base")
    assert [len(p.tools) for p in pages[:-1]] == [DEFAULT_TOOLS_PAGE] * (len(pages) - 1)
    assert [t.name for p in pages for t in p.tools] == BASE
    assert pages[-1].next_cursor is None
    assert refused.startswith(
        f"{types.INVALID_PARAMS} invalid cursor: INVALID_ARGUMENT: page_token"
    )

    async def filtered(session: ClientSession) -> tuple[int, str]:
        pages = [await session.list_tools()]
        while pages[-1].next_cursor:
            params = types.PaginatedRequestParams(cursor=pages[-1].next_cursor)
            pages.append(await session.list_tools(params=params))
        try:  # an unoffered tool is the protocol's unknown tool: -32602, not a result
            await session.call_tool("tool_0001", {"message": "x"})  # cautious, odd
            hidden = "answered"
        except MCPError as exc:
            hidden = f"{exc.code} {exc.message}"
        return sum(len(p.tools) for p in pages), hidden

    count, hidden = with_session(
        server.address, filtered, "--max-level", "safe", "--category", "even"
    )
    assert count == len([i for i in range(TOOL_COUNT) if i % 2 == 0 and i % 3 == 0])
    assert hidden.startswith(f"{types.INVALID_PARAMS} "), hidden
    assert "not offered here" in hidden, hidden


def test_agent_adapters_get_every_tool(server: Running) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("agents")
    from registry_server.client.adapters.langchain import toolreg_structured_tools
    from registry_server.client.adapters.openai_agents import toolreg_function_tools

    client = RegistryClient.connect(server.address)
    try:
        structured = toolreg_structured_tools(client, categories=["base"])
        assert [t.name for t in structured] == BASE
        function_tools = toolreg_function_tools(client, categories=["base"], max_level="safe")
        assert [t.name for t in function_tools] == BASE[::3]
    finally:
        client.close()

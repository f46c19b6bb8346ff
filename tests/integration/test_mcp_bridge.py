"""The MCP bridge as MCP hosts run it: `python -m registry_server.mcp.bridge`
over stdio, driven by the official SDK's own client, in front of a real
`toolreg serve` process that runs the calls in real containers."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import mcp.types as types
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from registry_server.cli.launcher import ServerProcess, spawn_server

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "examples" / "tools"
CALL_TIMEOUT_S = 120  # a cold container start plus the call, generously

T = TypeVar("T")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("mcp") / "data"
    server = spawn_server(data, "--tools", str(TOOLS), cwd=ROOT)
    try:
        yield server
    finally:
        server.stop()


def with_session(
    address: str,
    body: Callable[[ClientSession], Awaitable[T]],
    *extra: str,
    message_handler: Any = None,
    modern: bool = False,
) -> T:
    """Start the bridge (`toolreg [--token T] mcp --address A ...`) over stdio,
    initialize a session, run `body` in it (notifications to `message_handler`)."""
    root: list[str] = []
    rest = list(extra)
    if "--token" in rest:  # a root option of the command line
        at = rest.index("--token")
        root, rest = rest[at : at + 2], rest[:at] + rest[at + 2 :]
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "registry_server.cli", *root, "mcp", "--address", address, *rest],
        cwd=str(ROOT),
    )

    async def run() -> T:
        with anyio.fail_after(CALL_TIMEOUT_S * 3):
            async with (
                stdio_client(params) as (read, write),
                ClientSession(read, write, message_handler=message_handler) as session,
            ):
                if modern:  # 2026-07-28: server/discover, no handshake
                    found = await session.discover()
                    assert "2026-07-28" in found.supported_versions
                    assert found.capabilities.tools is not None
                else:
                    init = await session.initialize()
                    assert init.server_info.name == "toolreg"
                    assert init.capabilities.tools is not None
                return await body(session)

    return anyio.run(run)


def manifest_parameters(name: str) -> Any:
    import yaml

    return yaml.safe_load((TOOLS / f"{name}.yaml").read_text())["parameters"]


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


def test_lists_tools_with_schemas_and_annotations(served: ServerProcess) -> None:
    async def body(session: ClientSession) -> list[types.Tool]:
        return (await session.list_tools()).tools

    tools = {t.name: t for t in with_session(served.address, body)}
    assert {"echo", "word_count", "run_python", "write_file"} <= set(tools)
    expected = {
        "echo": (True, False),
        "word_count": (True, False),
        "run_python": (False, False),
        "write_file": (False, True),
    }
    for name, (read_only, destructive) in expected.items():
        tool = tools[name]
        assert tool.input_schema == manifest_parameters(name), name
        assert tool.description
        assert tool.annotations is not None
        assert tool.annotations.read_only_hint is read_only, name
        assert tool.annotations.destructive_hint is destructive, name
        assert tool.annotations.open_world_hint is False, name
        assert "_approval_request_id" not in json.dumps(tool.input_schema)


def test_filters_limit_the_listing_and_the_calls(served: ServerProcess) -> None:
    async def body(session: ClientSession) -> tuple[types.ListToolsResult, MCPError]:
        listed = await session.list_tools()
        with pytest.raises(MCPError) as hidden:
            await session.call_tool("run_python", {"code": "print(1)"})
        return listed, hidden.value

    listed, hidden = with_session(
        served.address, body, "--max-level", "safe", "--category", "text", modern=True
    )
    assert [t.name for t in listed.tools] == ["word_count"]
    # 2026-07-28's cache hints: the list is this caller's, reusable for 30 s.
    assert (listed.ttl_ms, listed.cache_scope) == (30_000, "private")
    # A hidden tool is an unknown one: JSON-RPC invalid params, as MCP says.
    assert hidden.error.code == types.INVALID_PARAMS and "run_python" in hidden.error.message


def test_calls_run_in_the_sandbox(served: ServerProcess) -> None:
    async def body(session: ClientSession) -> dict[str, Any]:
        await session.list_tools()
        return {
            "echo": await session.call_tool(
                "echo", {"message": "héllo", "n": 3}, read_timeout_seconds=CALL_TIMEOUT_S
            ),
            "word_count": await session.call_tool(
                "word_count", {"text": "one two\nthree"}, read_timeout_seconds=CALL_TIMEOUT_S
            ),
            "invalid": await session.call_tool(
                "word_count", {"text": 5}, read_timeout_seconds=CALL_TIMEOUT_S
            ),
            "unknown": await refused(session.call_tool("no_such_tool", {})),
            "not a name": await refused(session.call_tool("Forged\nlog line " + "x" * 10_000, {})),
            "dangerous": await session.call_tool(
                "write_file",
                {"path": "notes/a.txt", "content": "hi"},
                read_timeout_seconds=CALL_TIMEOUT_S,
            ),
        }

    results = with_session(served.address, body)

    echo = results["echo"]
    assert not echo.is_error, text_of(echo)
    assert json.loads(text_of(echo)) == {"message": "héllo", "n": 3}
    assert echo.structured_content == {"message": "héllo", "n": 3}

    counted = results["word_count"]
    assert not counted.is_error, text_of(counted)
    assert isinstance(counted.structured_content, dict)
    assert counted.structured_content.get("words") == 3, counted.structured_content

    invalid = results["invalid"]
    assert invalid.is_error
    assert "INVALID_ARGUMENTS" in text_of(invalid)
    assert "$.text" in text_of(invalid)  # names the JSON path of the bad value

    unknown, forged = results["unknown"], results["not a name"]
    assert isinstance(unknown, MCPError) and isinstance(forged, MCPError)
    assert unknown.error.code == forged.error.code == types.INVALID_PARAMS
    assert "no_such_tool" in unknown.error.message
    assert forged.error.message.startswith("Unknown tool: names match")
    forged = forged.error.message
    assert "Forged" not in forged  # refused before use, and not echoed

    dangerous = results["dangerous"]
    assert dangerous.is_error
    message = text_of(dangerous)
    assert message.startswith("APPROVAL_REQUIRED")
    request_id = message.split("Approval request id: ")[1].split()[0]
    assert len(request_id) >= 16
    assert "toolreg approvals approve" in message
    assert f'"_approval_request_id": "{request_id}"' in message


async def refused(call: Awaitable[types.CallToolResult]) -> MCPError:
    """The JSON-RPC error a call answers (an unknown tool is one, not a result)."""
    with pytest.raises(MCPError) as caught:
        await call
    return caught.value


def test_approval_request_id_is_passed_and_stripped(served: ServerProcess) -> None:
    args = {"path": "notes/b.txt", "content": "hi"}

    async def body(session: ClientSession) -> tuple[str, str]:
        first = await session.call_tool("write_file", args, read_timeout_seconds=CALL_TIMEOUT_S)
        first_text = text_of(first)
        request_id = first_text.split("Approval request id: ")[1].split()[0]
        again = await session.call_tool(
            "write_file",
            {**args, "_approval_request_id": request_id},
            read_timeout_seconds=CALL_TIMEOUT_S,
        )
        return request_id, text_of(again)

    request_id, again = with_session(served.address, body)
    assert request_id
    # Still unapproved: the server names the same request again. Had the key
    # reached the tool's arguments, the schema (additionalProperties: false) or
    # the arguments digest would have rejected it instead.
    assert "INVALID_ARGUMENTS" not in again
    assert request_id in again


def test_server_unreachable_is_an_error_result(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def body(session: ClientSession) -> tuple[str, types.CallToolResult]:
        try:
            await session.list_tools()
            listed = "listed"
        except Exception as exc:  # a JSON-RPC error, not a dead bridge
            listed = str(exc)
        called = await session.call_tool("echo", {"message": "x"})
        return listed, called

    listed, called = with_session(f"127.0.0.1:{port}", body)
    assert "cannot reach the toolreg server" in listed
    assert called.is_error
    assert "UNAVAILABLE" in text_of(called)


def test_bearer_token_and_refusals(tmp_path: Path) -> None:
    """With a policy the bridge is the client its token names; refusals are results."""
    server = spawn_server(
        tmp_path / "data",
        "--tools", str(TOOLS), "--policy", str(ROOT / "examples" / "policy.yaml"),
        cwd=ROOT,
    )  # fmt: skip

    async def agent(session: ClientSession) -> tuple[list[str], types.CallToolResult]:
        names = [t.name for t in (await session.list_tools()).tools]
        echo = await session.call_tool(
            "echo", {"message": "with a token"}, read_timeout_seconds=CALL_TIMEOUT_S
        )
        return names, echo

    async def approver(session: ClientSession) -> types.CallToolResult:
        return await session.call_tool("echo", {"message": "x"})

    async def anonymous(session: ClientSession) -> str:
        try:
            await session.list_tools()
        except Exception as exc:
            return str(exc)
        return "listed"

    try:
        names, echo = with_session(server.address, agent, "--token", "agent-token-123")
        refused = with_session(server.address, approver, "--token", "approver-token-456")
        unknown = with_session(server.address, anonymous)
    finally:
        server.stop()
    assert "echo" in names
    assert not echo.is_error, text_of(echo)
    assert echo.structured_content == {"message": "with a token"}
    assert refused.is_error
    assert text_of(refused).startswith("PERMISSION_DENIED")
    assert "UNAUTHENTICATED" in unknown


def test_progress_token_streams_output_over_stdio(served: ServerProcess) -> None:
    """A call with `_meta.progressToken` runs through StreamExecuteTool: each
    output chunk is a notifications/progress with that token, before the result."""
    code = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.4)\n"
    seen: list[tuple[float, types.ProgressNotificationParams]] = []

    async def handler(message: Any) -> None:
        if isinstance(message, types.ProgressNotification):
            seen.append((time.monotonic(), message.params))

    async def body(session: ClientSession) -> tuple[types.CallToolResult, float, int]:
        result = await session.call_tool(
            "run_python", {"code": code}, read_timeout_seconds=CALL_TIMEOUT_S,
            meta={"progressToken": 7},
        )  # fmt: skip
        return result, time.monotonic(), len(seen)

    result, answered, count = with_session(served.address, body, message_handler=handler)
    assert not result.is_error, text_of(result)
    assert text_of(result) == "0\n1\n2\n"
    notes = seen[:count]
    assert len(notes) >= 3, notes
    assert {p.progress_token for _, p in notes} == {7}  # the token as sent (an integer here)
    values = [p.progress for _, p in notes]
    assert values == sorted(set(values)) and values[-1] == 6, values
    assert {"stdout: 0", "stdout: 1", "stdout: 2"} <= {p.message for _, p in notes}
    assert answered - notes[0][0] >= 0.5  # the first chunk came while the tool still ran

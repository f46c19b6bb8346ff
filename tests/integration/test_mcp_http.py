"""The MCP bridge over Streamable HTTP (`toolreg mcp --http HOST:PORT --policy FILE`)
as a real process, in front of a real `toolreg serve` with the same policy that
runs calls in real containers. Driven by the MCP SDK's own Streamable HTTP
client; plain HTTP (httpx) where a test needs the status line and headers."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import httpx2
import mcp.types as types
import pytest
import yaml
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from registry_server.cli.launcher import ServerProcess, spawn_server, spawn_until
from registry_server.mcp.http_settings import DEFAULT_MAX_BODY_BYTES
from registry_server.signing.keys import generate_keypair
from tests.certs import CertificateAuthority
from tests.factories import sha

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "examples" / "tools"
CALL_TIMEOUT_S = 120  # seconds: a cold container start plus the call, generously
START_TIMEOUT_S = 30  # seconds for the bridge to say where it listens
LOG_WAIT_S = 30  # seconds for a line the bridge wrote to reach its log reader thread
SERVING = re.compile(r"serving MCP on (\S+)")
# Each MCP client of the policy has its own token; none is ever logged.
TOKENS = {
    "agent": "mcp-http-agent-7f3a9c",  # executes up to dangerous
    "rival": "mcp-http-rival-91c2e4",  # executes up to dangerous, another identity
    "viewer": "mcp-http-viewer-5d08b1",  # executes safe tools only
}
WRONG_TOKEN = "mcp-http-wrong-0b1e77"
ACCEPT = "application/json, text/event-stream"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "raw-http-test", "version": "0"},
    },
}
COUNT_SLOWLY = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.4)\n"

T = TypeVar("T")


def write_policy(path: Path, *, with_tokens: bool = True) -> Path:
    _, alice_public = generate_keypair()
    levels = {"agent": "dangerous", "rival": "dangerous", "viewer": "safe"}
    clients: list[dict[str, Any]] = [
        {"id": who, "roles": ["execute"], "max_safety_level": level}
        for who, level in levels.items()
    ]
    for client in clients:
        if with_tokens:
            client["token_sha256"] = sha(TOKENS[client["id"]])
        else:
            client["mtls_subject"] = f"CN={client['id']}"
    policy = {
        "audience": "toolreg-mcp-http",
        "approvers": [{"id": "alice", "public_key": alice_public, "groups": ["security"]}],
        "clients": clients,
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


@dataclass
class BridgeProcess:
    proc: subprocess.Popen[str]
    url: str
    log: list[str]  # every line it wrote to stderr

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


def bridge_env() -> dict[str, str]:
    # The bridge must not pick up a token from the test runner's environment.
    return {k: v for k, v in os.environ.items() if k != "TOOLREG_TOKEN"}


def spawn_bridge(address: str, *args: str, listen: str = "127.0.0.1:0") -> BridgeProcess:
    """`toolreg mcp --address A --http LISTEN ARGS...` as a process; its URL."""
    argv = [sys.executable, "-m", "registry_server.cli", "mcp", "--address", address,
            "--http", listen, *args]  # fmt: skip
    proc, url, log = spawn_until(
        argv, SERVING, what="toolreg mcp --http", cwd=ROOT, env=bridge_env()
    )
    return BridgeProcess(proc, url, log)


def wait_for_log(bridge: BridgeProcess, *lines: str) -> str:
    """The bridge's log once it holds every one of ``lines``: a thread reads its
    stderr, so a line it wrote reaches ``bridge.log`` a moment later."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        log = "".join(bridge.log)
        missing = [line for line in lines if line not in log]
        if not missing:
            return log
        assert time.monotonic() < deadline, (
            f"not in the bridge's log after {LOG_WAIT_S} s: {missing}"
        )
        time.sleep(0.05)


def run_bridge_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command line alone (for refusals before anything listens)."""
    return subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args],
        capture_output=True, text=True, cwd=ROOT, env=bridge_env(), timeout=START_TIMEOUT_S,
    )  # fmt: skip


def in_session(
    url: str,
    token: str | None,
    body: Callable[[ClientSession], Awaitable[T]],
    *,
    message_handler: Any = None,
    verify: ssl.SSLContext | None = None,
    statuses: list[int] | None = None,
) -> T:
    """An MCP session through the SDK's Streamable HTTP client with
    `Authorization: Bearer token` (none when None); runs `body` in it.
    `statuses` collects the HTTP status of every response."""

    async def record(response: httpx2.Response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    async def run() -> T:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        if verify is None:
            http = create_mcp_http_client(headers=headers)
        else:
            http = httpx2.AsyncClient(headers=headers, verify=verify, timeout=30)
        http.event_hooks = {"response": [record]}
        with anyio.fail_after(CALL_TIMEOUT_S * 3):
            async with (
                http,
                streamable_http_client(url, http_client=http) as (read, write),
                ClientSession(read, write, message_handler=message_handler) as session,
            ):
                init = await session.initialize()
                assert init.server_info.name == "toolreg"
                return await body(session)

    return anyio.run(run)


def raw(
    url: str,
    token: str | None,
    payload: Any = INITIALIZE,
    *,
    content: Any = None,
    method: str = "POST",
    **headers: str,
) -> httpx.Response:
    """One plain HTTP request (JSON-RPC `payload`, or raw `content`)."""
    sent = {"Accept": ACCEPT, "Content-Type": "application/json", **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    body = content if content is not None else json.dumps(payload).encode()
    with httpx.Client(timeout=30) as client:
        return client.request(method, url, content=body, headers=sent)


def status_or_reset(url: str, token: str | None, **headers: str) -> int | str:
    """The status, or "400 or reset" when the server answers 400 and closes
    while the client is still sending (how h11 refuses an oversized head)."""
    try:
        code = raw(url, token, **headers).status_code
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        return "400 or reset"
    return "400 or reset" if code == 400 else code


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


@dataclass
class Served:
    server: ServerProcess
    data_dir: Path
    policy: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("mcp-http")
    policy = write_policy(base / "policy.yaml")
    data = base / "data"
    server = spawn_server(data, "--tools", str(TOOLS), "--policy", str(policy), cwd=ROOT)
    try:
        yield Served(server, data, policy)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bridge(served: Served) -> Iterator[BridgeProcess]:
    process = spawn_bridge(served.server.address, "--policy", str(served.policy))
    try:
        yield process
    finally:
        code = process.stop()
        assert code == 0, "the bridge did not stop cleanly:\n" + "".join(process.log[-30:])


# ------------------------------------------------------------------ the calls


def test_lists_tools_and_runs_calls(bridge: BridgeProcess) -> None:
    async def body(session: ClientSession) -> tuple[list[types.Tool], dict[str, Any]]:
        tools = (await session.list_tools()).tools
        results = {
            "echo": await session.call_tool(
                "echo", {"message": "über http"}, read_timeout_seconds=CALL_TIMEOUT_S
            ),
            "python": await session.call_tool(
                "run_python", {"code": "print(sum(range(10)))"}, read_timeout_seconds=CALL_TIMEOUT_S
            ),
        }
        return tools, results

    tools, results = in_session(bridge.url, TOKENS["agent"], body)
    by_name = {t.name: t for t in tools}
    assert {"echo", "word_count", "run_python", "write_file"} <= set(by_name)
    write_file = by_name["write_file"].annotations
    assert write_file is not None and write_file.destructive_hint is True
    assert not results["echo"].is_error, text_of(results["echo"])
    assert results["echo"].structured_content == {"message": "über http"}
    assert not results["python"].is_error, text_of(results["python"])
    assert text_of(results["python"]) == "45\n"  # run in the sandbox, not echoed


def test_progress_token_streams_output_before_the_result(bridge: BridgeProcess) -> None:
    seen: list[tuple[float, types.ProgressNotificationParams]] = []
    callbacks: list[tuple[float, str | None]] = []

    async def handler(message: Any) -> None:
        if isinstance(message, types.ProgressNotification):
            seen.append((time.monotonic(), message.params))

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        callbacks.append((progress, message))

    async def body(session: ClientSession) -> dict[str, Any]:
        started = time.monotonic()
        with_token = await session.call_tool(
            "run_python", {"code": COUNT_SLOWLY}, read_timeout_seconds=CALL_TIMEOUT_S,
            meta={"progressToken": "progress-42"},
        )  # fmt: skip
        answered = time.monotonic()
        progress_seen = len(seen)
        without_token = await session.call_tool(
            "run_python", {"code": COUNT_SLOWLY}, read_timeout_seconds=CALL_TIMEOUT_S
        )
        after_plain = len(seen)
        # The SDK's own way: a callback, with the request id as the token.
        with_callback = await session.call_tool(
            "run_python", {"code": COUNT_SLOWLY}, read_timeout_seconds=CALL_TIMEOUT_S,
            progress_callback=on_progress,
        )  # fmt: skip
        return {
            "started": started, "answered": answered, "with_token": with_token,
            "progress_seen": progress_seen, "without_token": without_token,
            "after_plain": after_plain, "with_callback": with_callback,
        }  # fmt: skip

    out = in_session(bridge.url, TOKENS["agent"], body, message_handler=handler)

    result = out["with_token"]
    assert not result.is_error, text_of(result)
    assert text_of(result) == "0\n1\n2\n"  # the final result is as without progress
    notes = seen[: out["progress_seen"]]
    assert len(notes) >= 3, notes
    assert {p.progress_token for _, p in notes} == {"progress-42"}
    values = [p.progress for _, p in notes]
    assert values == sorted(set(values)), values  # strictly increasing
    assert values[-1] == len("0\n1\n2\n")  # bytes of output, the last count sent
    messages = [p.message or "" for _, p in notes]
    assert {"stdout: 0", "stdout: 1", "stdout: 2"} <= set(messages), messages
    assert all(len(m) <= 120 for m in messages)
    # Streamed as the tool printed (0.4 s apart), not batched with the result.
    first_at = notes[0][0]
    assert out["answered"] - first_at >= 0.5, (first_at - out["started"], out["answered"])

    plain = out["without_token"]
    assert text_of(plain) == "0\n1\n2\n"
    assert out["after_plain"] == out["progress_seen"], "progress sent without a token"

    assert text_of(out["with_callback"]) == "0\n1\n2\n"
    assert len(callbacks) >= 3, callbacks
    assert callbacks[-1][0] == 6.0


def audit_records(data_dir: Path, count: int = 10) -> list[dict[str, Any]]:
    """The last execution records of the server's audit log (`toolreg audit tail`)."""
    done = run_bridge_cli("audit", "tail", "-n", str(count), "--data-dir", str(data_dir))
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stdout.splitlines()]
    return [dict(e["record"], seq=e["seq"]) for e in entries if e["kind"] == "execution"]


def test_cancelling_a_streamed_call_stops_its_sandbox(
    bridge: BridgeProcess, served: Served
) -> None:
    """Cancelling the MCP request cancels the gRPC stream: the server kills the
    container long before the tool would have ended (it sleeps 4 s)."""
    code = "import time\nprint('started', flush=True)\ntime.sleep(4)\nprint('never')\n"
    before = max((r["seq"] for r in audit_records(served.data_dir)), default=0)
    first = anyio.Event()

    async def handler(message: Any) -> None:
        if isinstance(message, types.ProgressNotification):
            first.set()

    async def body(session: ClientSession) -> float:
        async with anyio.create_task_group() as group:

            async def call() -> None:
                await session.call_tool(
                    "run_python", {"code": code}, read_timeout_seconds=CALL_TIMEOUT_S,
                    meta={"progressToken": "to-cancel"},
                )  # fmt: skip

            group.start_soon(call)
            await first.wait()  # the tool runs: it printed
            cancelled_at = time.monotonic()
            group.cancel_scope.cancel()
        return cancelled_at

    in_session(bridge.url, TOKENS["agent"], body, message_handler=handler)
    deadline = time.monotonic() + 30
    records: list[dict[str, Any]] = []
    while not records and time.monotonic() < deadline:
        records = [r for r in audit_records(served.data_dir) if r["seq"] > before]
        time.sleep(0.2)
    assert len(records) == 1, records
    record = records[0]
    assert record["tool"] == "run_python" and record["caller"] == "agent", record
    assert record["status"] == "SANDBOX_ERROR" and record["exit_code"] is None, record
    assert record["duration_ms"] < 3000, record  # killed, not run to the end of its sleep


# --------------------------------------------------------- resuming a stream

PROTOCOL = {"MCP-Protocol-Version": "2025-11-25"}  # the version whose clients resume
# The tool prints, is silent while the test's stream is down, prints again.
PRINT_PAUSE_PRINT = (
    "import time  # resume-arg-marker-3c71\n"
    "print('one', flush=True)\ntime.sleep(1.5)\n"
    "print('two', flush=True)\ntime.sleep(1.5)\n"
    "print('three', flush=True)\n"
)


@dataclass
class SseEvent:
    id: str | None
    data: Any  # the JSON-RPC message; None for a priming event (empty data)


def sse_events(response: httpx.Response) -> Iterator[SseEvent]:
    """The events of an SSE response as they arrive (comments skipped)."""
    event_id: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if event_id is not None or data:
                yield SseEvent(event_id, json.loads("\n".join(data)) if any(data) else None)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def open_session(client: httpx.Client, url: str, token: str) -> dict[str, str]:
    """initialize + initialized; the headers every later request of the session needs."""
    init = dict(INITIALIZE, params=dict(INITIALIZE["params"], protocolVersion="2025-11-25"))
    opened = raw(url, token, init)
    assert opened.status_code == 200, opened.text
    headers = {"Authorization": f"Bearer {token}", "Accept": ACCEPT, **PROTOCOL,
               "Mcp-Session-Id": opened.headers["mcp-session-id"]}  # fmt: skip
    done = client.post(
        url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"}
    )
    assert done.status_code == 202, done.text
    return headers


def resume(client: httpx.Client, url: str, headers: dict[str, str], last_id: str) -> list[SseEvent]:
    """GET with Last-Event-ID: every event up to the request's response."""
    got: list[SseEvent] = []
    sent = {**headers, "Accept": "text/event-stream", "Last-Event-ID": last_id}
    with client.stream("GET", url, headers=sent) as response:
        assert response.status_code == 200, response.read()
        for event in sse_events(response):
            got.append(event)
            if event.data is not None and "id" in event.data and event.data.get("id") == 7:
                break
    return got


def progress_messages(events: list[SseEvent]) -> list[str]:
    return [e.data["params"].get("message", "") for e in events
            if e.data is not None and e.data.get("method") == "notifications/progress"]  # fmt: skip


def test_a_dropped_stream_resumes_with_last_event_id(bridge: BridgeProcess) -> None:
    """The client closes its tools/call stream after the first output; a GET
    with the last event id it saw gets what it missed, the rest live, and the
    result. No one else can resume it, and a gone id is answered 410."""
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "run_python", "arguments": {"code": PRINT_PAUSE_PRINT},
        "_meta": {"progressToken": "resume-1"}}}  # fmt: skip
    with httpx.Client(timeout=CALL_TIMEOUT_S) as client:
        agent = open_session(client, bridge.url, TOKENS["agent"])
        before: list[SseEvent] = []
        with client.stream("POST", bridge.url, headers=agent, json=call) as response:
            assert response.status_code == 200
            for event in sse_events(response):
                before.append(event)
                if any("one" in m for m in progress_messages(before)):
                    break  # dropped here: the connection closes with the stream unread
        ids = [e.id for e in before]
        assert all(ids) and before[0].data is None, before  # a priming event, then ids on all
        time.sleep(2)  # 'two' is printed while nobody listens
        after = resume(client, bridge.url, agent, before[-1].id or "")

        # Everything after the last id seen, once: the missed output, the rest, the result.
        messages = progress_messages(after)
        assert "stdout: two" in messages and "stdout: three" in messages, messages
        assert not any("one" in m for m in messages), messages
        result = after[-1].data
        assert result["id"] == 7 and not result["result"].get("isError"), result
        assert result["result"]["content"][0]["text"] == "one\ntwo\nthree\n"
        replayed = [e.id for e in after if e.data is not None]
        assert len(set(replayed)) == len(replayed) and not set(replayed) & set(ids)

        # The same id again, once the result was sent: still replayable, the result last.
        again = resume(client, bridge.url, agent, before[-1].id or "")
        assert again[-1].data == result

        # Another client, in its own session: the id names nothing of its own.
        rival = open_session(client, bridge.url, TOKENS["rival"])
        stolen = client.get(bridge.url, headers={**rival, "Last-Event-ID": before[-1].id or ""})
        assert stolen.status_code == 410, stolen.text
        # ... nor can it use the agent's session (the SDK binds it to its opener).
        hijack = {**agent, "Authorization": f"Bearer {TOKENS['rival']}", "Last-Event-ID": ids[-1]}
        assert client.get(bridge.url, headers=hijack).status_code == 404
        # Unknown, malformed or future ids in the agent's own session: 410, said in JSON-RPC.
        key = (before[-1].id or "").rpartition(".")[0]
        for bad in ["0" * 22 + ".1", "not-an-id", f"{key}.999"]:
            gone = client.get(bridge.url, headers={**agent, "Last-Event-ID": bad})
            assert gone.status_code == 410, (bad, gone.text)
            assert "not held" in gone.json()["error"]["message"]
    log = wait_for_log(bridge, "resuming a stream", "resume refused")
    for secret in [*TOKENS.values(), "resume-arg-marker-3c71", key]:
        assert secret not in log


# ---------------------------------------------------------------- who calls


def test_requests_without_a_known_token_get_401(bridge: BridgeProcess) -> None:
    for token, label in [(None, "no token"), (WRONG_TOKEN, "wrong token")]:
        response = raw(bridge.url, token)
        assert response.status_code == 401, (label, response.status_code, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer"), label
        assert "mcp-session-id" not in response.headers, label
    for header in ["Basic YWdlbnQ6c2VjcmV0", "Bearer", TOKENS["agent"]]:  # no scheme, no token
        refused = raw(bridge.url, None, Authorization=header)
        assert refused.status_code == 401, header
    # A token of the policy with a different case or extra bytes is another token.
    upper = raw(bridge.url, TOKENS["agent"].upper())
    assert upper.status_code == 401

    statuses: list[int] = []

    async def body(session: ClientSession) -> str:
        return "initialized"

    for token in [WRONG_TOKEN, None]:
        statuses.clear()
        with pytest.raises(ExceptionGroup) as refused:
            in_session(bridge.url, token, body, statuses=statuses)
        assert refused.group_contains(MCPError, match="error response"), refused.value
        assert statuses == [401], statuses  # initialize refused; nothing else tried


def test_each_mcp_client_is_its_own_registry_client(bridge: BridgeProcess) -> None:
    args = {"path": "notes/mcp-http.txt", "content": "hi"}

    async def viewer(session: ClientSession) -> tuple[types.CallToolResult, types.CallToolResult]:
        python = await session.call_tool(
            "run_python", {"code": "print(1)"}, read_timeout_seconds=CALL_TIMEOUT_S
        )
        echo = await session.call_tool(
            "echo", {"message": "safe is fine"}, read_timeout_seconds=CALL_TIMEOUT_S
        )
        return python, echo

    python, echo = in_session(bridge.url, TOKENS["viewer"], viewer)
    assert python.is_error
    assert text_of(python).startswith("PERMISSION_DENIED"), text_of(python)
    assert "viewer" in text_of(python) and "up to safe" in text_of(python)
    assert not echo.is_error, text_of(echo)  # the level cap, not a failed login

    async def agent_asks(session: ClientSession) -> str:
        first = await session.call_tool("write_file", args, read_timeout_seconds=CALL_TIMEOUT_S)
        assert first.is_error and text_of(first).startswith("APPROVAL_REQUIRED"), text_of(first)
        return text_of(first).split("Approval request id: ")[1].split()[0]

    request_id = in_session(bridge.url, TOKENS["agent"], agent_asks)

    async def retry(session: ClientSession) -> str:
        again = await session.call_tool(
            "write_file", {**args, "_approval_request_id": request_id},
            read_timeout_seconds=CALL_TIMEOUT_S,
        )  # fmt: skip
        assert again.is_error
        return text_of(again)

    # Another client cannot ride on the agent's approval request ...
    rival = in_session(bridge.url, TOKENS["rival"], retry)
    assert "made by another client" in rival, rival
    # ... while the agent itself is told about its own request (still unapproved).
    own = in_session(bridge.url, TOKENS["agent"], retry)
    assert "another client" not in own and request_id in own, own


def test_a_session_answers_only_to_the_client_that_opened_it(bridge: BridgeProcess) -> None:
    opened = raw(bridge.url, TOKENS["agent"])
    assert opened.status_code == 200, opened.text
    session_id = opened.headers["mcp-session-id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    hijack = raw(bridge.url, TOKENS["viewer"], listing, **{"Mcp-Session-Id": session_id})
    assert hijack.status_code == 404, hijack.text  # as if the session did not exist
    anonymous = raw(bridge.url, None, listing, **{"Mcp-Session-Id": session_id})
    assert anonymous.status_code == 401
    ended = raw(bridge.url, TOKENS["agent"], method="DELETE", content=b"",
                **{"Mcp-Session-Id": session_id})  # fmt: skip
    assert ended.status_code in (200, 204), ended.text


# ------------------------------------------------------------ what is refused


def test_dns_rebinding_is_refused(bridge: BridgeProcess) -> None:
    evil_origin = raw(bridge.url, TOKENS["agent"], Origin="http://evil.example")
    assert evil_origin.status_code == 403, evil_origin.text
    assert "mcp-session-id" not in evil_origin.headers
    evil_host = raw(bridge.url, TOKENS["agent"], Host="evil.example")
    assert evil_host.status_code == 421, evil_host.text
    # The same request without those headers is fine.
    assert raw(bridge.url, TOKENS["agent"]).status_code == 200


def test_oversize_bodies_are_refused(bridge: BridgeProcess) -> None:
    big = dict(INITIALIZE, padding="x" * DEFAULT_MAX_BODY_BYTES)
    body = json.dumps(big).encode()
    declared = raw(bridge.url, TOKENS["agent"], content=body)
    assert declared.status_code == 413, declared.status_code

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    chunked = raw(bridge.url, TOKENS["agent"], content=chunks())
    assert chunked.status_code == 413, chunked.status_code
    # Without a valid token the body is never read: 401 first.
    assert raw(bridge.url, None, content=body).status_code == 401


def test_bad_input_leaves_the_bridge_serving(bridge: BridgeProcess) -> None:
    agent = TOKENS["agent"]
    answers = {
        "not json": raw(bridge.url, agent, content=b"{not json").status_code,
        "not json-rpc": raw(bridge.url, agent, [1, 2, 3]).status_code,
        "no session": raw(
            bridge.url, agent, {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
        ).status_code,
        "text/plain": raw(bridge.url, agent, **{"Content-Type": "text/plain"}).status_code,
        "unknown session": raw(bridge.url, agent, **{"Mcp-Session-Id": "0" * 32}).status_code,
        "PUT": raw(bridge.url, agent, method="PUT").status_code,
        "other path": raw(bridge.url.replace("/mcp", "/admin"), agent).status_code,
        "huge header": status_or_reset(bridge.url, agent, **{"X-Padding": "x" * 1024 * 1024}),
    }
    assert answers == {
        "not json": 400, "not json-rpc": 400, "no session": 400, "text/plain": 400,
        "unknown session": 404, "PUT": 405, "other path": 404,
        "huge header": "400 or reset",
    }, answers  # fmt: skip
    assert bridge.proc.poll() is None

    async def body(session: ClientSession) -> types.CallToolResult:
        await session.list_tools()
        return await session.call_tool(
            "echo", {"message": "still here"}, read_timeout_seconds=CALL_TIMEOUT_S
        )

    echo = in_session(bridge.url, agent, body)
    assert echo.structured_content == {"message": "still here"}


def test_log_names_no_token(bridge: BridgeProcess) -> None:
    raw(bridge.url, WRONG_TOKEN)
    assert raw(bridge.url, TOKENS["rival"]).status_code == 200
    log = wait_for_log(bridge, "call echo -> OK")  # the log is the bridge's, with calls in it
    for token in [*TOKENS.values(), WRONG_TOKEN]:
        assert token not in log
        assert sha(token) not in log


# ------------------------------------------------------------ limits and modes


def test_sessions_are_capped_and_expire(served: Served) -> None:
    limited = spawn_bridge(
        served.server.address, "--policy", str(served.policy), "--max-sessions", "2",
        "--session-idle-s", "1", "--allow-origin", "http://localhost:6274",
    )  # fmt: skip
    try:
        first = raw(limited.url, TOKENS["agent"], Origin="http://localhost:6274")
        second = raw(limited.url, TOKENS["viewer"])
        assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
        third = raw(limited.url, TOKENS["rival"])
        assert third.status_code == 503, third.text
        time.sleep(2.5)  # both idle longer than --session-idle-s
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        expired = raw(
            limited.url,
            TOKENS["agent"],
            listing,
            **{"Mcp-Session-Id": first.headers["mcp-session-id"]},
        )
        assert expired.status_code == 404, expired.text
        assert raw(limited.url, TOKENS["rival"]).status_code == 200  # room again
    finally:
        assert limited.stop() == 0


def test_https_with_the_operators_certificate(served: Served, tmp_path: Path) -> None:
    ca = CertificateAuthority("mcp-http-test-ca")
    issued = ca.issue("localhost", server=True)
    cert, key = tmp_path / "bridge.pem", tmp_path / "bridge.key"
    cert.write_bytes(issued.cert_pem)
    key.write_bytes(issued.key_pem)
    secure = spawn_bridge(
        served.server.address, "--policy", str(served.policy),
        "--http-tls-cert", str(cert), "--http-tls-key", str(key),
    )  # fmt: skip
    try:
        assert secure.url.startswith("https://")
        url = f"https://localhost:{secure.port}/mcp"  # the name the certificate carries
        trust = ssl.create_default_context(cadata=ca.pem.decode())

        async def body(session: ClientSession) -> list[str]:
            return [t.name for t in (await session.list_tools()).tools]

        assert "echo" in in_session(url, TOKENS["viewer"], body, verify=trust)
        with pytest.raises(httpx.HTTPError):
            raw(f"http://localhost:{secure.port}/mcp", TOKENS["viewer"])
    finally:
        assert secure.stop() == 0


def test_insecure_dev_mode_needs_no_token_on_loopback(tmp_path: Path) -> None:
    server = spawn_server(tmp_path / "data", "--tools", str(TOOLS), cwd=ROOT)  # no policy
    dev = spawn_bridge(server.address, "--insecure-dev")
    try:

        async def body(session: ClientSession) -> types.CallToolResult:
            return await session.call_tool(
                "echo", {"message": "dev"}, read_timeout_seconds=CALL_TIMEOUT_S
            )

        echo = in_session(dev.url, None, body)
        assert echo.structured_content == {"message": "dev"}
        assert raw(dev.url, None, Host="evil.example").status_code == 421  # still guarded
        assert "INSECURE DEVELOPMENT MODE" in "".join(dev.log)
    finally:
        code = dev.stop()
        server.stop()
    assert code == 0


def test_refuses_to_serve_http_unsafely(served: Served, tmp_path: Path) -> None:
    policy = str(served.policy)
    no_tokens = str(write_policy(tmp_path / "mtls-only.yaml", with_tokens=False))
    cases = {
        "no policy": (["mcp", "--http", "127.0.0.1:0"], "--http needs --policy"),
        "dev beyond loopback": (["mcp", "--http", "0.0.0.0:0", "--insecure-dev"], "loopback only"),
        "no TLS beyond loopback": (
            ["mcp", "--http", "192.0.2.1:8443", "--policy", policy],
            "without TLS",
        ),
        "fixed identity": (
            ["--token", TOKENS["agent"], "mcp", "--http", "127.0.0.1:0", "--policy", policy],
            "--token",
        ),
        "policy without --http": (["mcp", "--policy", policy], "only with --http"),
        "bad endpoint": (["mcp", "--http", "localhost", "--policy", policy], "HOST:PORT"),
        "no token in the policy": (
            ["mcp", "--http", "127.0.0.1:0", "--policy", no_tokens],
            "no client has a token",
        ),
        "bad policy": (
            ["mcp", "--http", "127.0.0.1:0", "--policy", str(tmp_path / "missing.yaml")],
            "cannot read the policy",
        ),
    }
    for label, (args, expected) in cases.items():
        done = run_bridge_cli(*args)
        assert done.returncode == 2, (label, done.returncode, done.stderr)
        assert expected in done.stderr, (label, done.stderr)
        assert "Traceback" not in done.stderr, label
        assert TOKENS["agent"] not in done.stderr, label

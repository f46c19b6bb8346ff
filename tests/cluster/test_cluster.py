"""N registry servers on one PostgreSQL: what one server stores, every server
serves; an approval made anywhere is spent once everywhere; one audit chain;
the database stopped, a server killed, a connection failed over."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.store.postgres import PostgresStore
from registry_server.wire import convert
from tests.cluster.conftest import AUDIENCE, ROOT, Cluster, StartCluster, postgres, wait_for
from tests.factories import tool

ECHO_ARGS = json.dumps({"message": "hi"})
WRITE_ARGS = json.dumps({"path": "cluster.txt", "content": "once"})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def names(cluster: Cluster, index: int) -> set[str]:
    tools = cluster.stub(index, "agent").ListTools(pb.ListToolsRequest()).tools
    return {t.name for t in tools}


def digest_at(cluster: Cluster, index: int, name: str) -> str:
    return str(cluster.stub(index, "agent").GetTool(pb.GetToolRequest(name=name)).digest)


def serves(
    cluster: Cluster, index: int, name: str = "cluster_tool", digest: str = ""
) -> Callable[[], bool]:
    def check() -> bool:
        if digest:
            return digest_at(cluster, index, name) == digest
        return name in names(cluster, index)

    return check


def health_is(cluster: Cluster, index: int, status: int) -> Callable[[], bool]:
    return lambda: cluster.health(index) == status


def request_for_write(cluster: Cluster, index: int, client: str = "agent") -> str:
    result = cluster.stub(index, client).ExecuteTool(
        pb.ExecuteToolRequest(name="write_file", arguments_json=WRITE_ARGS)
    )
    assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, result.error
    return str(result.approval_request.id)


def audit_verify(store_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "audit", "verify",
         "--store-url", store_url],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_a_tool_registered_on_one_server_is_served_by_every_server_within_a_second(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster(3)
    new = tool(name="cluster_tool", description="Registered through server 0.")
    cluster.stub(0, "team").RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(new)))
    for index in (1, 2):
        took = wait_for(f"server {index} serves cluster_tool", serves(cluster, index), 1.0)
        print(f"server {index} served the new tool after {took * 1000:.0f} ms")
        assert took < 1.0
    # A replacement reaches every server too, and their cached listings follow.
    changed = tool(name="cluster_tool", description="Replaced through server 2.")
    stored = cluster.stub(2, "team").RegisterTool(
        pb.RegisterToolRequest(tool=convert.tool_to_pb(changed), replace=True)
    )
    for index in (0, 1):
        wait_for(
            f"server {index} serves the replacement",
            serves(cluster, index, digest=stored.digest),
            1.0,
        )
        schemas = cluster.stub(index, "agent").GetToolSchemas(pb.GetToolSchemasRequest())
        assert "Replaced through server 2." in schemas.schemas_json


def test_ownership_holds_across_servers(start_cluster: StartCluster) -> None:
    cluster = start_cluster(2)
    mine = tool(name="team_tool")
    cluster.stub(0, "team").RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(mine)))
    wait_for("server 1 serves team_tool", lambda: "team_tool" in names(cluster, 1), 1.0)
    theirs = tool(name="team_tool", description="Hijacked through the other server.")
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub(1, "other-team").RegisterTool(
            pb.RegisterToolRequest(tool=convert.tool_to_pb(theirs), replace=True)
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "belongs to 'team'" in str(info.value.details())
    assert cluster.stub(0, "agent").GetTool(pb.GetToolRequest(name="team_tool")).owner == "team"


def test_an_approval_requested_on_a_approved_through_b_runs_through_c_once(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster(3)
    request_id = request_for_write(cluster, 0)
    approved = cluster.approve(1, request_id)
    assert approved.state == "APPROVED"
    # another agent cannot use it on any server
    stolen = cluster.stub(2, "agent2").ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=WRITE_ARGS, approval_request_id=request_id
        )
    )
    assert stolen.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "made by another client" in stolen.error
    ran = cluster.stub(2, "agent").ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=WRITE_ARGS, approval_request_id=request_id
        )
    )
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    again = cluster.stub(0, "agent").ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=WRITE_ARGS, approval_request_id=request_id
        )
    )
    assert again.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert f"approval request {request_id} is consumed" in again.error


def _watch(cluster: Cluster, index: int, client: str) -> tuple[Any, list[pb.ApprovalEvent]]:
    """A watch on server ``index`` read on its own thread into a list."""
    call = cluster.stub(index, client).WatchApprovalRequests(
        pb.WatchApprovalRequestsRequest(), timeout=60
    )
    seen: list[pb.ApprovalEvent] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            seen.extend(call)

    threading.Thread(target=read, daemon=True).start()
    return call, seen


def _synced(events: list[pb.ApprovalEvent]) -> bool:
    """Whether the watch has told every request open when it began (CURRENT), so
    that a request opened from now on comes as OPENED."""
    return any(e.type == pb.APPROVAL_EVENT_TYPE_SYNCED for e in list(events))


def _kinds(events: list[pb.ApprovalEvent], request_id: str) -> list[str]:
    return [
        pb.ApprovalEventType.Name(e.type).removeprefix("APPROVAL_EVENT_TYPE_")
        for e in events
        if e.request.id == request_id
    ]


def test_a_watch_on_one_server_sees_changes_made_on_the_others(start_cluster: StartCluster) -> None:
    cluster = start_cluster(3)
    watch, seen = _watch(cluster, 0, "alice")
    agent_watch, agent_seen = _watch(cluster, 0, "agent2")
    wait_for("both watches synced", lambda: _synced(seen) and _synced(agent_seen))
    request_id = request_for_write(cluster, 1)
    took = wait_for("OPENED on server 0", lambda: _kinds(seen, request_id) == ["OPENED"])
    assert took < 1.0
    cluster.approve(2, request_id)
    done = cluster.stub(1, "agent").ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=WRITE_ARGS, approval_request_id=request_id
        )
    )
    assert done.success, done.error
    expected = ["OPENED", "APPROVAL_ADDED", "APPROVED", "CONSUMED"]
    wait_for("every change on server 0", lambda: _kinds(seen, request_id) == expected)
    ours = [e for e in seen if e.request.id == request_id]
    assert [e.seq for e in ours] == sorted(e.seq for e in ours)  # one order for every server
    assert _kinds(agent_seen, request_id) == []  # agent's request: agent2 never hears of it
    watch.cancel()
    agent_watch.cancel()


def test_an_expiry_is_recorded_once_across_servers(start_cluster: StartCluster) -> None:
    cluster = start_cluster(3)
    text = cluster.policy.read_text().replace(
        f"audience: {AUDIENCE}", f"audience: {AUDIENCE}\napproval_request_ttl_s: 2"
    )
    cluster.policy.write_text(text)
    cluster.stop()
    cluster.servers.clear()
    for index in range(3):
        cluster.start(index)
    watch, seen = _watch(cluster, 2, "alice")
    # Opened after the watch's SYNCED, or the watch would tell it as CURRENT.
    wait_for("the watch synced", lambda: _synced(seen))
    request_id = request_for_write(cluster, 0)
    wait_for("EXPIRED seen", lambda: "EXPIRED" in _kinds(seen, request_id))
    time.sleep(2.5)  # every server has swept at least twice since
    assert _kinds(seen, request_id) == ["OPENED", "EXPIRED"]
    store = PostgresStore(cluster.store_url, must_exist=True)
    try:
        with store.reading() as reads:
            records = [json.loads(e.record) for e in reads.audit_entries()]
            events = reads.events_after(0, 100)
    finally:
        store.close()
    expired = [r for r in records if r.get("event") == "expired"]
    assert expired == [{"event": "expired", "request_id": request_id}]
    assert [e.type for e in events if e.request_id == request_id] == ["OPENED", "EXPIRED"]
    watch.cancel()


def test_a_policy_reload_asked_of_one_server_is_done_by_all(start_cluster: StartCluster) -> None:
    cluster = start_cluster(3)
    before = [
        cluster.stub(i, "agent2").GetServerInfo(pb.GetServerInfoRequest()).policy_digest
        for i in range(3)
    ]
    assert len(set(before)) == 1 and before[0]
    policy = yaml.safe_load(cluster.policy.read_text())
    policy["clients"] = [c for c in policy["clients"] if c["id"] != "agent2"]
    cluster.policy.write_text(yaml.safe_dump(policy, sort_keys=False))
    info = cluster.stub(0, "admin").ReloadPolicy(pb.ReloadPolicyRequest())
    assert info.policy_digest != before[0]

    def revoked_everywhere() -> bool:
        for index in range(3):
            try:
                cluster.stub(index, "agent2").GetServerInfo(pb.GetServerInfoRequest())
                return False
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        return True

    assert wait_for("agent2 revoked on every server", revoked_everywhere) < 1.0
    digests = {
        cluster.stub(i, "agent").GetServerInfo(pb.GetServerInfoRequest()).policy_digest
        for i in range(3)
    }
    assert digests == {info.policy_digest}


def test_one_approved_call_sent_to_three_servers_at_once_runs_exactly_once(
    start_cluster: StartCluster,
) -> None:
    cluster = start_cluster(3)
    token = cluster.inline_token(1, request_for_write(cluster, 0))
    stubs = [cluster.stub(i, "agent") for i in range(3)]
    start = threading.Barrier(3)
    results: list[pb.ToolResult] = []

    def send(index: int) -> None:
        start.wait()
        results.append(
            stubs[index].ExecuteTool(
                pb.ExecuteToolRequest(
                    name="write_file", arguments_json=WRITE_ARGS, approval_tokens=[token]
                ),
                timeout=60,
            )
        )

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    statuses = sorted(convert.status_name(r.status) for r in results)
    assert statuses == ["APPROVAL_DENIED", "APPROVAL_DENIED", "OK"], [r.error for r in results]
    for denied in (r for r in results if r.status == pb.EXECUTION_STATUS_APPROVAL_DENIED):
        assert "already used (replayed jti)" in denied.error


def test_one_audit_chain_across_servers_verifies(start_cluster: StartCluster) -> None:
    cluster = start_cluster(3)
    stubs = [cluster.stub(i, "agent") for i in range(3)]
    errors: list[BaseException] = []

    def hammer(index: int) -> None:
        try:
            for _ in range(15):  # unknown tools: audited, no sandbox
                stubs[index].ExecuteTool(pb.ExecuteToolRequest(name="missing_tool"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    verdict = audit_verify(cluster.store_url)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert "audit chain intact" in verdict.stdout
    records = int(verdict.stdout.split("intact: ")[1].split(" records")[0])
    assert records >= 45  # every server's attempts, in one chain


def test_a_server_killed_loses_nothing_it_acknowledged(start_cluster: StartCluster) -> None:
    cluster = start_cluster(2)
    acked = tool(name="acked_tool")
    cluster.stub(0, "team").RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(acked)))
    request_id = request_for_write(cluster, 0)
    cluster.approve(0, request_id)
    cluster.servers[0].kill()  # SIGKILL: no shutdown, no flush
    assert "acked_tool" in names(cluster, 1)
    seen = cluster.stub(1, "alice").GetApprovalRequest(pb.GetApprovalRequestRequest(id=request_id))
    assert seen.state == "APPROVED" and list(seen.approved_by) == ["alice"]
    ran = cluster.stub(1, "agent").ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=WRITE_ARGS, approval_request_id=request_id
        )
    )
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error


@pytest.mark.serial  # it stops the PostgreSQL every other cluster test uses
def test_the_database_stopped_and_back(start_cluster: StartCluster) -> None:
    cluster = start_cluster(2)
    request_id = request_for_write(cluster, 0)
    token = cluster.inline_token(0, request_id)
    assert cluster.health(0) == SERVING
    postgres("stop")
    try:
        with pytest.raises(grpc.RpcError) as info:
            cluster.stub(0, "team").RegisterTool(
                pb.RegisterToolRequest(tool=convert.tool_to_pb(tool(name="while_down")))
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "store postgresql://toolreg:***@127.0.0.1" in str(info.value.details())
        # a dangerous call cannot spend its token without the database
        with pytest.raises(grpc.RpcError) as info:
            cluster.stub(1, "agent").ExecuteTool(
                pb.ExecuteToolRequest(
                    name="write_file", arguments_json=WRITE_ARGS, approval_tokens=[token]
                )
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for index in (0, 1):
            wait_for(f"server {index} NOT_SERVING", health_is(cluster, index, NOT_SERVING))
    finally:
        postgres("start")
    for index in (0, 1):
        wait_for(f"server {index} SERVING again", health_is(cluster, index, SERVING))
    # Recovered without a restart: writes work, and the token spends once.
    cluster.stub(1, "team").RegisterTool(
        pb.RegisterToolRequest(tool=convert.tool_to_pb(tool(name="after_restart")))
    )
    wait_for("server 0 serves after_restart", lambda: "after_restart" in names(cluster, 0), 5.0)
    results = [
        cluster.stub(i, "agent").ExecuteTool(
            pb.ExecuteToolRequest(
                name="write_file", arguments_json=WRITE_ARGS, approval_tokens=[token]
            )
        )
        for i in (0, 1)
    ]
    assert [convert.status_name(r.status) for r in results] == ["OK", "APPROVAL_DENIED"]
    time.sleep(0.1)
    verdict = audit_verify(cluster.store_url)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr


def test_a_store_url_that_cannot_work_stops_the_server_with_one_line(
    pg_url: str, tmp_path: object
) -> None:
    wrong_password = pg_url.replace(pg_url.split(":")[2].split("@")[0], "not-the-password")
    missing_database = pg_url.rsplit("/", 1)[0] + "/no_such_database"
    for url, cause in (
        (wrong_password, "password authentication failed"),
        (missing_database, 'database "no_such_database" does not exist'),
        ("postgresql://toolreg:pw@127.0.0.1:1/x", "Connection refused"),
        ("mysql://x", "unsupported store URL"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "registry_server.cli", "serve", "--port", "0",
             "--data-dir", str(tmp_path), "--store-url", url],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode != 0
        lines = [line for line in done.stderr.splitlines() if "store" in line]
        assert lines and cause in lines[-1], done.stderr
        assert "Traceback" not in done.stderr
        assert "not-the-password" not in done.stderr and ":pw@" not in done.stderr

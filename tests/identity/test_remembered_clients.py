"""Group-mapped IdP clients outlive a server (docs/how-to/identity.md,
"Remembered clients"): a real OpenID Provider (oidc-provider on loopback over
TLS), real `toolreg serve` processes, a real SQLite file and a real PostgreSQL
database, the real engine for the tool's sandbox.

A builder whose role comes from its IdP groups registers a tool; after a
restart, and on a second server on the same PostgreSQL, others use the tool
without the builder presenting a token again. Roles still come from the
policy in force: unmap the group and the builder is nobody, its tool unserved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.config import DB_FILENAME
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.store.postgres import PostgresStore
from registry_server.store.sqlite import SqliteStore
from registry_server.wire import convert
from tests.cluster.conftest import database, pg_url  # noqa: F401 (fixtures: a private database)
from tests.factories import sha
from tests.identity.idp_world import RESOURCE, IdP

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "remembered-admin-secret"
CALLER_TOKEN = "remembered-caller-secret"  # a static client that only executes
BUILDERS = "toolreg-builders"


def write_policy(path: Path, idp: IdP, *, builders_mapped: bool = True) -> None:
    groups = [{"group": "toolreg-agents", "roles": ["execute"]}]
    if builders_mapped:
        groups.append({"group": BUILDERS, "roles": ["register"]})
    policy = {
        "audience": "toolreg-remembered-test",
        "clients": [
            {"id": "admin", "token_sha256": sha(ADMIN_TOKEN), "roles": ["admin"]},
            {"id": "caller", "token_sha256": sha(CALLER_TOKEN), "roles": ["execute"]},
        ],
        "identity_providers": [{
            "id": "testidp", "issuer": idp.issuer, "audiences": [RESOURCE],
            "algorithms": ["ES256", "RS256"], "ca_file": str(idp.ca_file),
            "min_refresh_interval_s": 1, "groups": groups,
        }],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def toolreg(*args: str, code: int = 0) -> str:
    """The CLI's output (stdout; stderr when it is expected to fail with ``code``)."""
    done = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    return done.stdout if code == 0 else done.stderr


def stub(server: ServerProcess, token: str) -> pb_grpc.ToolRegistryStub:
    return pb_grpc.ToolRegistryStub(open_channel(server.address, token=token))


def echo_tool(name: str) -> pb.Tool:
    return convert.tool_to_pb(parse_definition({
        "name": name, "description": "echoes its input", "parameters": {"type": "object"},
        "safety_level": "safe", "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    }))  # fmt: skip


def run(server: ServerProcess, name: str) -> pb.ToolResult:
    return stub(server, CALLER_TOKEN).ExecuteTool(
        pb.ExecuteToolRequest(name=name, arguments_json='{"hello": "again"}'), timeout=60
    )


def assert_served(server: ServerProcess, name: str, owner: str) -> None:
    """Listed, found and callable by a client that is not its owner."""
    caller = stub(server, CALLER_TOKEN)
    listed = caller.ListTools(pb.ListToolsRequest(), timeout=20)
    assert name in [t.name for t in listed.tools]
    assert caller.GetTool(pb.GetToolRequest(name=name), timeout=20).name == name
    result = run(server, name)
    assert result.status == pb.EXECUTION_STATUS_OK, (owner, result.error)
    assert json.loads(result.content) == {"hello": "again"}


@pytest.fixture
def builder(idp: IdP) -> str:
    """A fresh IdP client in the builders' group (private to the test)."""
    client_id = f"builder-{uuid.uuid4().hex[:10]}"
    idp.add_client(client_id, groups=[BUILDERS])
    return client_id


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


def test_a_restarted_server_serves_the_tool_of_a_builder_it_never_saw(
    idp: IdP, builder: str, tmp_path: Path, servers: list[ServerProcess]
) -> None:
    data, policy = tmp_path / "data", tmp_path / "policy.yaml"
    write_policy(policy, idp)
    first = spawn_server(data, "--policy", str(policy), cwd=ROOT)
    servers.append(first)
    tool = f"kept_{uuid.uuid4().hex[:8]}"
    owner = f"testidp.{builder}"
    stub(first, idp.client_credentials(builder)).RegisterTool(
        pb.RegisterToolRequest(tool=echo_tool(tool)), timeout=30
    )
    assert_served(first, tool, owner)
    first.stop()
    servers.remove(first)

    # What the store keeps: who and which groups, never a role.
    store = SqliteStore(data / DB_FILENAME)
    try:
        with store.reading() as reads:
            kept = reads.identity(owner)
    finally:
        store.close()
    assert kept is not None and (kept.provider, kept.subject) == ("testidp", builder)
    assert kept.groups == (BUILDERS,) and kept.first_seen <= kept.last_seen

    second = spawn_server(data, "--policy", str(policy), cwd=ROOT)
    servers.append(second)
    assert_served(second, tool, owner)  # the builder presented no token to this process

    # Roles are the policy's in force: with the group unmapped, the builder is
    # nobody and its tool stops, still with no token of the builder's.
    write_policy(policy, idp, builders_mapped=False)
    stub(second, ADMIN_TOKEN).ReloadPolicy(pb.ReloadPolicyRequest(), timeout=20)
    refused = run(second, tool)
    assert refused.status != pb.EXECUTION_STATUS_OK
    assert f"client '{owner}' no longer holds a register grant" in refused.error, refused.error
    second.stop()
    servers.remove(second)

    # The operator lists and forgets it (docs/how-to/identity.md): with the
    # group mapped again, a server that starts after knows no such builder.
    listed = toolreg("identities", "list", "--data-dir", str(data))
    assert [json.loads(line)["client"] for line in listed.splitlines()] == [owner]
    assert json.loads(listed)["groups"] == [BUILDERS] and "roles" not in json.loads(listed)
    assert toolreg("identities", "forget", owner, "--data-dir", str(data)) == f"forgot {owner}\n"
    again = toolreg("identities", "forget", owner, "--data-dir", str(data), code=1)
    assert f"no remembered client '{owner}'" in again
    bad = toolreg("identities", "forget", "x'; DROP TABLE tools", "--data-dir", str(data), code=2)
    assert "client_id: not a client id" in bad
    write_policy(policy, idp)
    third = spawn_server(data, "--policy", str(policy), cwd=ROOT)
    servers.append(third)
    assert f"client '{owner}' no longer holds a register grant" in run(third, tool).error


def test_a_second_server_on_the_same_postgresql_knows_the_builder_and_its_tool(
    idp: IdP,
    builder: str,
    tmp_path: Path,
    database: str,  # noqa: F811 (the fixture imported above)
    servers: list[ServerProcess],
) -> None:
    policy = tmp_path / "policy.yaml"
    write_policy(policy, idp)
    one, two = (
        spawn_server(tmp_path / f"server{i}", "--store-url", database, "--policy", str(policy),
                     cwd=ROOT)
        for i in (1, 2)
    )  # fmt: skip
    servers.extend([one, two])
    tool = f"shared_{uuid.uuid4().hex[:8]}"
    owner = f"testidp.{builder}"
    stub(one, idp.client_credentials(builder)).RegisterTool(
        pb.RegisterToolRequest(tool=echo_tool(tool)), timeout=30
    )
    # Server two never saw the builder's token: it reads the builder from the store.
    assert_served(two, tool, owner)
    store = PostgresStore(database, must_exist=True)
    try:
        with store.reading() as reads:
            assert [r.client_id for r in reads.identities("", 10)] == [owner]
    finally:
        store.close()
    # Only who the token is: a caller's token never becomes a remembered client
    # unless the policy maps it to a role (the static caller is not an IdP client).
    with pytest.raises(grpc.RpcError) as denied:
        stub(two, idp.forge(sub="stranger", groups=["unmapped"])).ListTools(
            pb.ListToolsRequest(), timeout=20
        )
    assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    store = PostgresStore(database, must_exist=True)
    try:
        with store.reading() as reads:
            assert reads.identity("testidp.stranger") is None
    finally:
        store.close()

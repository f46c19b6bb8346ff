"""Egress allow-lists and secrets, against real parts: a real server on
loopback, the real egress proxy container, and upstreams of the test's own
(tests/egress_world: HTTPS/HTTP servers and a DNS server in containers on a
network the test creates). The tools are hostile: they try every way out.

Every row runs twice, once per level that may have egress, each with its own
server and world: cautious tools under runc, and dangerous tools (approved by
a token the test signs) under gVisor: runsc-net for a tool with egress, runsc
without any network for one without. Each call's audit record must name that
runtime and, under runsc-net, gVisor's network mode: its own netstack, or
hostinet where this engine's runsc cannot start the netstack (Debian's runsc
on 6.18 here; scripts/ensure_docker.sh registers runsc-net so, and
tests/gvisor_netstack.py says which). Nothing skips: an engine without a
working runsc-net fails the dangerous rows, naming the fix."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import App
from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint, mint_for
from registry_server.store import audit_chain
from registry_server.wire import convert
from sandbox_runner.ownership import LABEL_EXECUTION_ID
from sandbox_runner.profiles import GVISOR, GVISOR_NET, HOSTINET, NETSTACK
from tests.egress_world import UpstreamWorld
from tests.engine_events import recorded
from tests.factories import sha
from tests.gvisor_netstack import runsc_net_mode

CANARY = "canary-7f3a9c-header-secret"  # header-delivered: must never enter a sandbox
FILE_CANARY = "canary-51d0e2-file-secret"  # file-delivered: the tool sees it, output must not
MAX_BYTES = 256 * 1024  # the test policy's per-call byte cap
MAX_CONNECTIONS = 6  # the test policy's per-call connection cap
TOKENS = {"ops": "ops-token", "team": "team-token", "other": "other-token"}
AUDIENCE = "egress-test"
APPROVERS = ("boss", "deputy")  # both in group ops; boss alone approves most dangerous tools
TWO_OF_TWO = "approved_fetch"  # the dangerous tool the policy wants both approvers for
# The runtime a tool of each level gets, with egress and without.
WITH_EGRESS = {"cautious": "runc", "dangerous": GVISOR_NET}
WITHOUT_EGRESS = {"cautious": "runc", "dangerous": GVISOR}
LEVELS = list(WITH_EGRESS)

# The hostile tool: each argument op is one attempt; it reports, never raises.
TOOL = r"""
import json, os, socket, sys, time, urllib.request
args = json.load(sys.stdin)
out = []
for op in args.get("ops", []):
    kind = op["kind"]
    try:
        if kind == "fetch":
            req = urllib.request.Request(op["url"], headers=op.get("headers", {}))
            with urllib.request.urlopen(req, timeout=15) as r:
                body = r.read()
            out.append({"ok": True, "status": r.status, "len": len(body), "body": body[:400].decode(errors="replace")})
        elif kind == "direct":
            socket.create_connection((op["host"], op["port"]), timeout=1).close()
            out.append({"ok": True})
        elif kind == "dns":
            # A raw query to every resolver the sandbox could know of, 1 s each.
            servers = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")]
            qname = b"".join(bytes([len(p)]) + p.encode() for p in op["name"].split(".")) + b"\0"
            packet = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + qname + b"\x00\x01\x00\x01"
            answers = []
            for server in servers + op.get("servers", []):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.settimeout(1)
                try:
                    s.sendto(packet, (server, 53))
                    reply = s.recv(512)
                    if reply[3] & 0x0F == 0 and reply[6:8] != b"\0\0":
                        answers.append(server)
                except OSError:
                    pass
            if answers:
                out.append({"ok": True, "answered_by": answers})
            else:
                raise OSError(f"no answer from {servers + op.get('servers', [])}")
        elif kind == "interfaces":
            out.append({"ok": True, "names": sorted(n for _, n in socket.if_nameindex())})
        elif kind == "snoop":
            seen = {"environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
                    "init_environ": "", "files": {}}
            try:
                seen["init_environ"] = open("/proc/1/environ", "rb").read().decode(errors="replace")
            except OSError as e:
                seen["init_environ"] = str(e)
            for root in ("/etc", "/run", "/tmp", "/opt", "/home", "/root", "/var"):
                for d, _, files in os.walk(root):
                    for f in files:
                        p = os.path.join(d, f)
                        try:
                            with open(p, "rb") as fh:
                                seen["files"][p] = fh.read(1 << 20).decode(errors="replace")
                        except OSError:
                            pass
            out.append({"ok": True, "seen": seen})
        elif kind == "cat":
            out.append({"ok": True, "text": open(op["path"]).read()})
        elif kind == "sleep":
            time.sleep(op["s"])
            out.append({"ok": True})
        elif kind == "many":
            n_ok = 0
            for _ in range(op["n"]):
                try:
                    with urllib.request.urlopen(op["url"], timeout=10) as r:
                        r.read(); n_ok += 1
                except Exception:
                    pass
            out.append({"ok": True, "succeeded": n_ok})
    except Exception as e:
        out.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
print(json.dumps(out))
"""


@dataclass
class Deployment:
    world: UpstreamWorld
    app: App
    port: int
    stub: pb_grpc.ToolRegistryStub
    data: Path
    approver_keys: dict[str, bytes]  # approver id -> private key PEM
    metrics_port: int
    level: str  # what the tools of this deployment are: cautious or dangerous
    engine: docker.DockerClient
    # runsc-net's mode on this engine (tests/gvisor_netstack.py): what the audit
    # record of a dangerous call with egress must say
    gvisor_network: str
    tools: dict[str, pb.Tool] = field(default_factory=dict)  # as last registered

    def md(self, who: str = "ops") -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {TOKENS[who]}")]

    def register(self, who: str = "ops", **manifest: Any) -> pb.Tool:
        tool = parse_definition(
            {
                "description": "egress test tool",
                "parameters": {"type": "object"},
                "safety_level": self.level,
                "sandbox": {"image": "toolreg/python", "command": ["python3", "-c", TOOL],
                            "limits": {"timeout_ms": 30_000}},
                **manifest,
            }
        )  # fmt: skip
        answer: pb.Tool = self.stub.RegisterTool(
            pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=True),
            metadata=self.md(who),
        )
        self.tools[answer.name] = answer
        return answer

    def approve(self, approver: str, request: pb.ApprovalRequest) -> str:
        key = load_private_key(self.approver_keys[approver])
        return mint_for(key, issuer=approver, request=request, ttl_s=300)

    def run(
        self, name: str, *ops: dict[str, Any], tokens: list[str] | None = None
    ) -> pb.ToolResult:
        """One call as ``ops``. A dangerous tool gets boss's token for exactly
        this call unless ``tokens`` are given; a call that reached a sandbox
        must have run under its level's runtime."""
        args = {"ops": list(ops)}
        tool = self.tools[name]
        if tokens is None:
            tokens = [self._token(tool, args)] if self._dangerous(tool) else []
        result: pb.ToolResult = self.stub.ExecuteTool(
            pb.ExecuteToolRequest(
                name=name, arguments_json=json.dumps(args), approval_tokens=tokens
            ),
            metadata=self.md(),
            timeout=120,
        )
        if result.status not in REFUSED_BEFORE_A_SANDBOX:
            runtimes = WITH_EGRESS if tool.network.egress else WITHOUT_EGRESS
            level = "dangerous" if self._dangerous(tool) else "cautious"
            record = self.audit(result.execution_id)
            assert record["runtime"] == runtimes[level], result
            networked = record["runtime"] == GVISOR_NET
            assert record.get("gvisor_network") == (self.gvisor_network if networked else None)
        return result

    @staticmethod
    def _dangerous(tool: pb.Tool) -> bool:
        return tool.safety_level == pb.SAFETY_LEVEL_DANGEROUS

    def _token(self, tool: pb.Tool, args: dict[str, Any]) -> str:
        return mint(
            load_private_key(self.approver_keys["boss"]), issuer="boss", audience=AUDIENCE,
            tool_name=tool.name, tool_digest=tool.digest, args_digest=arguments_digest(args),
            requester="ops", ttl_s=300,
        )  # fmt: skip

    def audit(self, execution_id: str) -> dict[str, Any]:
        """The call's outcome record (an approved call has a STARTING one before it)."""
        for entry in reversed(audit_chain.tail(self.app.store, 50)):
            if entry["record"].get("execution_id") == execution_id:
                return dict(entry["record"])
        raise AssertionError(f"no audit record for {execution_id}")


REFUSED_BEFORE_A_SANDBOX = {
    pb.EXECUTION_STATUS_APPROVAL_REQUIRED,
    pb.EXECUTION_STATUS_APPROVAL_DENIED,
    pb.EXECUTION_STATUS_SANDBOX_ERROR,
}


def results(result: pb.ToolResult) -> list[dict[str, Any]]:
    assert result.status == pb.EXECUTION_STATUS_OK, (result.error, result.stderr)
    out: list[dict[str, Any]] = json.loads(result.content)
    return out


@contextmanager
def serving(config: ServerConfig) -> Iterator[tuple[App, int, pb_grpc.ToolRegistryStub]]:
    """A real server on loopback with ``config``, its port, and a stub to it."""
    server, port, app = create_server(config)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield app, port, pb_grpc.ToolRegistryStub(channel)
    finally:
        channel.close()
        server.stop(grace=None).wait()
        app.close()


@pytest.fixture(scope="module", params=LEVELS, ids=[f"{lvl}-{WITH_EGRESS[lvl]}" for lvl in LEVELS])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    engine = docker.from_env()
    # Fails here, naming the fix, where this engine's runsc-net cannot start.
    mode = runsc_net_mode(engine) if request.param == "dangerous" else ""
    with UpstreamWorld(engine) as world:
        data = tmp_path_factory.mktemp("egress") / "data"
        secrets = data / "secrets"
        secrets.mkdir(parents=True, mode=0o700)
        for name, value in (("CANARY", CANARY), ("FILE_CANARY", FILE_CANARY),
                            ("OTHER_TEAM", "not-for-team")):  # fmt: skip
            (secrets / name).write_text(value + "\n")
            (secrets / name).chmod(0o600)
        keys = {who: generate_keypair() for who in APPROVERS}
        policy = {
            "audience": AUDIENCE,
            "approvers": [{"id": who, "public_key": keys[who][1], "groups": ["ops"]}
                          for who in APPROVERS],
            "approval_rules": [{"match": {"tool": TWO_OF_TWO}, "approvals_required": 2,
                                "groups": ["ops"], "max_token_ttl_s": 600}],
            "egress": {  # levels: the default, cautious and dangerous
                "allow_private": [world.subnet],
                "max_bytes_per_call": MAX_BYTES,
                "max_connections_per_call": MAX_CONNECTIONS,
            },
            "clients": [
                {"id": "ops", "token_sha256": sha(TOKENS["ops"]),
                 "roles": ["admin", "register", "execute"], "max_safety_level": "dangerous"},
                {"id": "team", "token_sha256": sha(TOKENS["team"]),
                 "roles": ["register", "execute"], "max_safety_level": "cautious",
                 "register": {"max_safety_level": "cautious", "images": ["toolreg/python"],
                              "egress": ["api.world.test:443"], "secrets": ["CANARY"]}},
            ],
        }  # fmt: skip
        policy_file = data / "policy.yaml"
        policy_file.write_text(yaml.safe_dump(policy))
        config = ServerConfig(
            port=0, host="127.0.0.1", data_dir=data, policy_file=policy_file, metrics_port=0,
            egress_networks=(world.network_name,), egress_dns=(world.dns_ip,),
            egress_upstream_ca=world.ca_file,
        )  # fmt: skip
        with serving(config) as (app, port, stub):
            yield Deployment(world, app, port, stub, data,
                             {who: pair[0] for who, pair in keys.items()},
                             app.metrics_port or 0, request.param, engine, mode)  # fmt: skip
        left = engine.api.networks(
            filters={"label": f"io.toolreg.instance={app.backend.instance_id}"}  # type: ignore[attr-defined]
        )
        assert left == [], "egress networks left behind"
    engine.close()


@pytest.fixture(scope="module")
def fetcher(deployment: Deployment) -> str:
    deployment.register(
        name="fetcher",
        network={"egress": ["api.world.test:443", "plain.world.test:80", "other.world.test:443",
                            "rebind.world.test:443", "rebind-first-bad.world.test:443",
                            "private.world.test:443", "loopback.world.test:443",
                            "metadata.world.test:443"]},
        secrets=[{"name": "CANARY", "inject": {"host": "api.world.test"}}],
    )  # fmt: skip
    return "fetcher"


def test_an_allowed_host_answers_and_every_connection_is_recorded(
    deployment: Deployment, fetcher: str
) -> None:
    r = deployment.run(
        fetcher,
        {"kind": "fetch", "url": "https://api.world.test/hello"},
        {"kind": "fetch", "url": "http://plain.world.test/plain"},
        {"kind": "fetch", "url": "https://other.world.test/tunnel"},
    )
    got = results(r)
    assert [g["ok"] for g in got] == [True, True, True], got
    assert json.loads(got[0]["body"])["host"] == "api.world.test"
    assert json.loads(got[1]["body"])["host"] == "plain.world.test"
    record = deployment.audit(r.execution_id)
    seen = {(c["host"], c["port"]): c for c in record["egress"]}
    assert set(seen) == {("api.world.test", 443), ("plain.world.test", 80),
                         ("other.world.test", 443)}  # fmt: skip
    assert all(c["allowed"] and c["bytes_down"] > 0 and c["bytes_up"] > 0 for c in seen.values())
    assert seen[("api.world.test", 443)]["address"] == deployment.world.ip("api.world.test")
    assert seen[("api.world.test", 443)]["injected"] is True
    assert seen[("other.world.test", 443)]["injected"] is False


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://forbidden.world.test/", "not in the allow-list"),
        ("https://api.world.test:8443/", "not in the allow-list"),  # listed host, other port
        ("http://api.world.test/", "not in the allow-list"),  # port 80 is not listed
        ("https://private.world.test/", "private"),
        ("https://loopback.world.test/", "loopback"),
        ("https://metadata.world.test/", "metadata"),
        ("https://rebind-first-bad.world.test/", "loopback"),
    ],
)
def test_everything_else_is_refused_and_recorded(
    deployment: Deployment, fetcher: str, url: str, reason: str
) -> None:
    r = deployment.run(fetcher, {"kind": "fetch", "url": url})
    (got,) = results(r)
    assert got["ok"] is False, got
    (conn,) = deployment.audit(r.execution_id)["egress"]
    assert conn["allowed"] is False and reason in conn["reason"], conn
    assert conn["bytes_down"] == 0 and deployment.world.requests("forbidden.world.test") == []


def test_a_raw_ip_is_refused_even_when_it_is_an_allowed_hosts_address(
    deployment: Deployment, fetcher: str
) -> None:
    ip = deployment.world.ip("api.world.test")
    r = deployment.run(fetcher, {"kind": "fetch", "url": f"https://{ip}/"})
    assert results(r)[0]["ok"] is False
    (conn,) = deployment.audit(r.execution_id)["egress"]
    assert conn["allowed"] is False and "raw IP" in conn["reason"]


def test_a_rebinding_name_is_pinned_to_the_address_that_was_checked(
    deployment: Deployment, fetcher: str
) -> None:
    """The DNS server answers the api upstream's address first and 127.0.0.1
    after: the proxy asks once, checks that answer, and connects to it."""
    before = len(deployment.world.requests("api.world.test"))
    r = deployment.run(fetcher, {"kind": "fetch", "url": "https://rebind.world.test/pinned"})
    got = results(r)
    (conn,) = deployment.audit(r.execution_id)["egress"]
    assert conn["address"] == deployment.world.ip("api.world.test")
    asked = [q for q in deployment.world.dns_queries() if q["name"] == "rebind.world.test"
             and q["type"] == "A"]  # fmt: skip
    assert len(asked) == 1, asked  # no second look-up between check and connect
    # The api upstream's certificate does not name rebind.world.test: the tool's
    # TLS check fails, but nothing went anywhere but the checked address.
    assert got[0]["ok"] is False and "CERTIFICATE" in got[0]["error"].upper()
    assert len(deployment.world.requests("api.world.test")) == before


def test_a_tool_that_ignores_the_proxy_reaches_nothing_and_resolves_nothing(
    deployment: Deployment, fetcher: str
) -> None:
    world = deployment.world
    queries_before = len(world.dns_queries())
    direct = results(
        deployment.run(
            fetcher,
            {"kind": "direct", "host": world.ip("api.world.test"), "port": 443},
            {"kind": "direct", "host": world.dns_ip, "port": 53},
            {"kind": "direct", "host": world.gateway, "port": 22},
        )
    )
    assert [g["ok"] for g in direct] == [False] * 3, direct
    resolved = results(
        deployment.run(
            fetcher,
            {"kind": "dns", "name": "api.world.test", "servers": [world.dns_ip]},
            {"kind": "dns", "name": "example.com"},
        )
    )
    assert [g["ok"] for g in resolved] == [False] * 2, resolved
    assert len(world.dns_queries()) == queries_before  # no query reached any DNS server
    assert world.requests("forbidden.world.test") == []


def test_the_header_secret_reaches_its_host_and_nothing_else(
    deployment: Deployment, fetcher: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    world = deployment.world
    r = deployment.run(
        fetcher,
        {"kind": "fetch", "url": "https://api.world.test/with-secret",
         "headers": {"Authorization": "Bearer forged-by-tool"}},
        {"kind": "fetch", "url": "https://api.world.test/echo-header?name=Authorization"},
        {"kind": "fetch", "url": "https://other.world.test/no-secret"},
        {"kind": "fetch", "url": "http://plain.world.test/no-secret"},
        {"kind": "snoop"},
    )  # fmt: skip
    got = results(r)
    sent = [q for q in world.requests("api.world.test") if q["path"] == "/with-secret"]
    assert sent[-1]["headers"]["Authorization"] == f"Bearer {CANARY}"  # replaced the forged one
    for name in ("other.world.test", "plain.world.test"):
        assert CANARY not in json.dumps(world.requests(name))
    # The echo came back masked, and the sandbox holds the value nowhere.
    assert got[1]["ok"] and "*" * len(CANARY) in got[1]["body"]
    seen = json.dumps(got[4]["seen"])
    assert "PRIVATE KEY" not in seen  # no key of the CA (or any other) is in there
    everywhere = [
        r.SerializeToString(),
        deployment.stub.GetTool(
            pb.GetToolRequest(name=fetcher), metadata=deployment.md()
        ).SerializeToString(),
        deployment.stub.ListTools(
            pb.ListToolsRequest(), metadata=deployment.md()
        ).SerializeToString(),
        deployment.stub.GetToolSchemas(
            pb.GetToolSchemasRequest(), metadata=deployment.md()
        ).SerializeToString(),
        json.dumps(audit_chain.tail(deployment.app.store, 200)).encode(),
        urllib.request.urlopen(f"http://127.0.0.1:{deployment.metrics_port}/metrics").read(),
        caplog.text.encode(),
        (deployment.data / "toolreg.db").read_bytes(),
    ]
    for where in everywhere:
        assert CANARY.encode() not in where
    assert CANARY not in seen
    # Nothing of the secret is left on disk once the call is over.
    deployment.app.backend.flush()
    assert list((deployment.data / "egress" / "run").glob("*/*")) == []


def test_a_file_secret_is_there_for_the_call_and_redacted_from_its_output(
    deployment: Deployment,
) -> None:
    deployment.register(name="file_secret", secrets=[{"name": "FILE_CANARY", "deliver": "file"}])
    r = deployment.run("file_secret", {"kind": "cat", "path": "/run/secrets/FILE_CANARY"},
                       {"kind": "interfaces"})  # fmt: skip
    got = results(r)
    assert got[0]["text"].strip() == "[secret FILE_CANARY]"
    assert FILE_CANARY not in r.content and FILE_CANARY not in r.stderr
    assert got[1]["names"] == ["lo"]  # a secret without egress gives no network
    assert FILE_CANARY not in json.dumps(audit_chain.tail(deployment.app.store, 5))
    deployment.app.backend.flush()  # the call's files go with its container
    assert list((deployment.data / "egress" / "run").glob("*/*")) == []


def test_a_tool_without_egress_still_has_only_lo(deployment: Deployment) -> None:
    deployment.register(name="offline")
    got = results(deployment.run("offline", {"kind": "interfaces"},
                                 {"kind": "dns", "name": "api.world.test",
                                  "servers": [deployment.world.dns_ip]}))  # fmt: skip
    assert got[0]["names"] == ["lo"]
    assert got[1]["ok"] is False
    assert (
        "HTTPS_PROXY"
        not in results(deployment.run("offline", {"kind": "snoop"}))[0]["seen"]["environ"]
    )


def test_a_flood_is_cut_at_the_caps_without_slowing_other_calls(
    deployment: Deployment, fetcher: str
) -> None:
    big = {"kind": "fetch", "url": f"https://other.world.test/big?bytes={8 * MAX_BYTES}"}
    many = {"kind": "many", "url": "http://plain.world.test/again", "n": 3 * MAX_CONNECTIONS}
    with ThreadPoolExecutor(2) as pool:
        flood = pool.submit(deployment.run, fetcher, big)
        storm = pool.submit(deployment.run, fetcher, many)
        time.sleep(0.5)
        started = time.monotonic()
        calm = deployment.run(fetcher, {"kind": "fetch", "url": "https://api.world.test/calm"})
        calm_s = time.monotonic() - started
        flood_r, storm_r = flood.result(), storm.result()
    assert results(calm)[0]["ok"], calm.content
    assert calm_s < 25, calm_s  # well inside its own timeout: not starved
    assert results(flood_r)[0]["ok"] is False  # the download was cut
    conns = deployment.audit(flood_r.execution_id)["egress"]
    assert sum(c["bytes_down"] + c["bytes_up"] for c in conns) <= MAX_BYTES
    assert any("byte cap" in c["reason"] for c in conns), conns
    storm_record = deployment.audit(storm_r.execution_id)["egress"]
    assert results(storm_r)[0]["succeeded"] == MAX_CONNECTIONS
    assert len(storm_record) == 3 * MAX_CONNECTIONS
    assert sum(1 for c in storm_record if "connection cap" in c["reason"]) == 2 * MAX_CONNECTIONS


@pytest.mark.parametrize("deployment", ["cautious"], indirect=True)  # team: cautious only
def test_clients_grant_only_the_hosts_and_secrets_the_policy_gives_them(
    deployment: Deployment,
) -> None:
    ok = deployment.register(
        "team",
        name="team_tool",
        network={"egress": ["api.world.test:443"]},
        secrets=[{"name": "CANARY", "inject": {"host": "api.world.test"}}],
    )
    assert ok.owner == "team" and ok.secrets[0].name == "CANARY"
    refused = [
        {"network": {"egress": ["forbidden.world.test:443"]}},
        {"network": {"egress": ["*.world.test:443"]}},  # wider than the grant
        {"network": {"egress": ["api.world.test:443"]},
         "secrets": [{"name": "OTHER_TEAM", "inject": {"host": "api.world.test"}}]},
        {"safety_level": "safe", "network": {"egress": ["api.world.test:443"]}},
    ]  # fmt: skip
    for extra in refused:
        with pytest.raises(grpc.RpcError) as caught:
            deployment.register("team", name="team_bad", **extra)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, extra
    with pytest.raises(grpc.RpcError):
        deployment.stub.GetTool(pb.GetToolRequest(name="team_bad"), metadata=deployment.md())


# ---------------------------------------------------------------- runtimes and approvals


def sandbox_during(deployment: Deployment, name: str) -> tuple[dict[str, Any], pb.ToolResult]:
    """The engine's HostConfig of the call's container, inspected while the tool
    sleeps, and the call's result. The call's container is the one its audit record
    names: every container of this server is inspected while the call runs, and
    none is taken for the call's by what it is not (the proxy, a network's holder,
    a pool's container or an earlier call's would otherwise do)."""
    deployment.app.backend.flush()  # earlier calls' containers are gone
    done: list[pb.ToolResult] = []
    call = threading.Thread(
        target=lambda: done.append(deployment.run(name, {"kind": "sleep", "s": 2}))
    )
    call.start()
    instance = f"io.toolreg.instance={deployment.app.backend.instance_id}"  # type: ignore[attr-defined]
    seen: dict[str, dict[str, Any]] = {}  # container id -> its HostConfig, while it ran
    deadline = time.monotonic() + 30
    while call.is_alive() and time.monotonic() < deadline:
        for c in deployment.engine.api.containers(filters={"label": instance}):
            if c["Id"] not in seen:
                with contextlib.suppress(docker.errors.NotFound):  # removed since the list
                    seen[c["Id"]] = deployment.engine.api.inspect_container(c["Id"])["HostConfig"]
        time.sleep(0.05)
    call.join(60)
    assert done, "the call never answered"
    container = deployment.audit(done[0].execution_id)["container_id"]
    assert container in seen, ("no sandbox seen while the call ran", container, done[0].error)
    return seen[container], done[0]


def test_a_call_without_egress_runs_under_its_levels_runtime_with_no_network(
    deployment: Deployment,
) -> None:
    """Dangerous: runsc (--network=none), never runsc-net, when the tool has no egress."""
    deployment.register(name="offline")
    host_config, result = sandbox_during(deployment, "offline")
    assert result.status == pb.EXECUTION_STATUS_OK, result.error
    runtime = WITHOUT_EGRESS[deployment.level]
    assert (host_config["Runtime"], host_config["NetworkMode"]) == (runtime, "none")
    assert deployment.audit(result.execution_id)["runtime"] == runtime


def test_a_call_with_egress_runs_under_its_levels_runtime_on_its_own_network(
    deployment: Deployment, fetcher: str
) -> None:
    host_config, result = sandbox_during(deployment, fetcher)
    assert result.status == pb.EXECUTION_STATUS_OK, result.error
    assert host_config["Runtime"] == WITH_EGRESS[deployment.level]
    # Its own network, through its holder's namespace (made for it, or taken
    # from those made ahead of calls): the holder goes with the call.
    mode = host_config["NetworkMode"]
    assert mode.startswith("container:"), mode
    deployment.app.backend.flush()
    assert deployment.engine.api.containers(all=True, filters={"id": mode[10:]}) == []
    interfaces = results(deployment.run(fetcher, {"kind": "interfaces"}))[0]["names"]
    assert len(interfaces) == 2 and "lo" in interfaces  # lo and the call's own link


@pytest.mark.parametrize("deployment", ["dangerous"], indirect=True)
def test_a_dangerous_tool_with_a_header_secret_approved_2_of_2_reaches_its_upstream(
    deployment: Deployment,
) -> None:
    world = deployment.world
    deployment.register(
        name=TWO_OF_TWO, network={"egress": ["api.world.test:443"]},
        secrets=[{"name": "CANARY", "inject": {"host": "api.world.test"}}],
    )  # fmt: skip
    ops = ({"kind": "fetch", "url": "https://api.world.test/two-of-two"},)
    asked = deployment.run(TWO_OF_TWO, *ops, tokens=[])
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    request = asked.approval_request
    assert request.approvals_required == 2
    assert list(request.tool.network.egress) == ["api.world.test:443"]
    assert [s.name for s in request.tool.secrets] == ["CANARY"]  # what the approvers sign
    one = deployment.run(TWO_OF_TWO, *ops, tokens=[deployment.approve("boss", request)])
    assert one.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED  # 1 of 2 is not enough
    both = [deployment.approve(who, request) for who in APPROVERS]
    got = results(deployment.run(TWO_OF_TWO, *ops, tokens=both))
    assert got[0]["ok"] and json.loads(got[0]["body"])["host"] == "api.world.test", got
    sent = [r for r in world.requests("api.world.test") if r["path"] == "/two-of-two"]
    assert [r["headers"]["Authorization"] for r in sent] == [f"Bearer {CANARY}"]
    replayed = deployment.run(TWO_OF_TWO, *ops, tokens=both)
    assert replayed.status == pb.EXECUTION_STATUS_APPROVAL_DENIED  # each token works once


@pytest.mark.parametrize("deployment", ["dangerous"], indirect=True)
def test_an_approval_binds_the_egress_list_and_the_secret_names(deployment: Deployment) -> None:
    """Both are in the digest an approval signs: changing either voids it."""
    egress = ["api.world.test:443"]
    secrets = [{"name": "CANARY", "inject": {"host": "api.world.test"}}]
    signed = deployment.register(name=TWO_OF_TWO, network={"egress": egress}, secrets=secrets)
    asked = deployment.run(TWO_OF_TWO, tokens=[])
    assert asked.approval_request.tool_digest == signed.digest
    tokens = [deployment.approve(who, asked.approval_request) for who in APPROVERS]
    changes: tuple[dict[str, Any], ...] = (
        {"network": {"egress": [*egress, "other.world.test:443"]}, "secrets": secrets},
        {"network": {"egress": egress},
         "secrets": [*secrets, {"name": "FILE_CANARY", "deliver": "file"}]},
    )  # fmt: skip
    digests = {signed.digest}
    for change in changes:
        digests.add(deployment.register(name=TWO_OF_TWO, **change).digest)
        refused = deployment.run(TWO_OF_TWO, tokens=tokens)
        assert refused.status == pb.EXECUTION_STATUS_APPROVAL_DENIED, refused
        assert "digest" in refused.error
    assert len(digests) == 3


@pytest.mark.parametrize("deployment", ["dangerous"], indirect=True)
def test_a_server_that_refuses_hostinet_runs_such_calls_only_with_the_netstack(
    deployment: Deployment, tmp_path: Path
) -> None:
    """TOOLREG_GVISOR_HOSTINET=refuse, on a second server with the same policy:
    where runsc-net is hostinet (this engine with Debian's runsc), a dangerous
    call with egress fails before any approval is asked for and before its tool
    starts, naming the setting and the fix; nothing reaches an upstream and no
    token is spent. Where runsc-net has gVisor's netstack, the call runs."""
    refusing = deployment.app.config.model_copy(
        update={"data_dir": tmp_path / "refusing", "secrets_dir": deployment.data / "secrets",
                "metrics_port": None, "gvisor_hostinet": "refuse"}
    )  # fmt: skip
    ops = ({"kind": "fetch", "url": "https://api.world.test/refused-hostinet"},)
    with serving(refusing) as (app, port, stub):
        other = Deployment(deployment.world, app, port, stub, refusing.data_dir,
                           deployment.approver_keys, 0, "dangerous", deployment.engine,
                           deployment.gvisor_network)  # fmt: skip
        other.register(name="picky", network={"egress": ["api.world.test:443"]})
        asked = other.run("picky", *ops, tokens=[])
        if deployment.gvisor_network == NETSTACK:
            assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked
            assert results(other.run("picky", *ops))[0]["ok"]
            return
        assert deployment.gvisor_network == HOSTINET
        assert asked.status == pb.EXECUTION_STATUS_SANDBOX_ERROR, asked
        assert "TOOLREG_GVISOR_HOSTINET=refuse" in asked.error and "20240801" in asked.error
        assert app.approvals.list_requests() == []  # nobody was asked to sign it
        refused = other.run("picky", *ops)  # with boss's token for exactly this call
        assert refused.status == pb.EXECUTION_STATUS_SANDBOX_ERROR and refused.error == asked.error
        records = [e["record"] for e in audit_chain.tail(app.store, 50)
                   if e["record"].get("tool") == "picky" and "execution_id" in e["record"]]  # fmt: skip
        assert [(r["status"], r["jtis"], r["container_id"]) for r in records] == [
            ("SANDBOX_ERROR", [], "")] * 2  # fmt: skip
    path = "/refused-hostinet"
    assert [r for r in deployment.world.requests("api.world.test") if r["path"] == path] == []


# ---------------------------------------------------------------- warm pools and networks

WARM_FETCHER = "warm_fetcher"
WAIT_FOR_POOL_S = 60.0  # seconds a pool may take to fill on this machine (gVisor is slower)
PROXY_LOG_WAIT_S = 30.0  # seconds for a line the proxy wrote to reach the engine's log of it
# The attacker: holds a warm sandbox's token (read from the engine) and asks the
# proxy, from the upstream network, to fetch an allowed host with it.
WITH_STOLEN_TOKEN = r"""
import base64, socket, sys
proxy, token = sys.argv[1], sys.argv[2]
auth = base64.b64encode(f"toolreg:{token}".encode()).decode()
s = socket.create_connection((proxy, 3128), timeout=10)
s.sendall(f"GET http://plain.world.test/stolen HTTP/1.1\r\nHost: plain.world.test\r\n"
          f"Proxy-Authorization: Basic {auth}\r\nConnection: close\r\n\r\n".encode())
print(s.recv(200).split(b"\r\n")[0].decode())
"""


def warm_sandboxes(deployment: Deployment, name: str) -> list[str]:
    pools = deployment.app.pools
    assert pools is not None
    return [w.container_id for w in pools._pools[name].ready] if name in pools._pools else []


def wait_warm(deployment: Deployment, name: str, count: int) -> list[str]:
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while len(ready := warm_sandboxes(deployment, name)) < count:
        assert time.monotonic() < deadline, f"the pool of {name} never reached {count}"
        time.sleep(0.1)
    return ready


def proxy_token(deployment: Deployment, container_id: str) -> tuple[str, str]:
    """(token, proxy address on the sandbox's network) from its environment."""
    env = deployment.engine.api.inspect_container(container_id)["Config"]["Env"]
    url = next(v.partition("=")[2] for v in env if v.startswith("HTTPS_PROXY="))
    credentials, _, where = url.removeprefix("http://").partition("@")
    return credentials.partition(":")[2], where.partition(":")[0]


def proxy_log_with(engine: docker.DockerClient, proxy_id: str, line: str) -> str:
    """The proxy's log as the engine keeps it, once it holds ``line`` (or the
    wait is over): the engine copies what the proxy writes a moment later."""
    deadline = time.monotonic() + PROXY_LOG_WAIT_S
    while True:
        text = str(engine.api.logs(proxy_id).decode(errors="replace"))
        if line in text or time.monotonic() >= deadline:
            return text
        time.sleep(0.1)


def proxy_knows(deployment: Deployment, token: str) -> bool:
    """Whether the proxy has a registration for ``token`` (asking it to close
    one it does not know changes nothing)."""
    from sandbox_runner.egress import control

    path = deployment.data / "egress" / "control" / "control.sock"
    try:
        control.request(path, {"op": "close", "token": token})
    except control.ControlError as exc:
        assert "unknown token" in str(exc), exc
        return False
    return True


def register_warm_fetcher(deployment: Deployment, pool: int) -> None:
    deployment.register(
        name=WARM_FETCHER, warm_pool=pool,
        network={"egress": ["api.world.test:443", "plain.world.test:80"]},
        secrets=[{"name": "CANARY", "inject": {"host": "api.world.test"}}],
    )  # fmt: skip


def test_a_warm_call_reaches_its_upstream_and_its_token_was_refused_before(
    deployment: Deployment,
) -> None:
    """A warm container of a tool with egress holds a proxy token the proxy
    does not know until its call is released: the token, stolen from the
    engine, gets 407 from the upstream network. The call then reaches its
    allowed hosts (the header secret injected), nothing else, and its token
    is closed at the end."""
    world, engine = deployment.world, deployment.engine
    register_warm_fetcher(deployment, 1)
    (container,) = wait_warm(deployment, WARM_FETCHER, 1)
    token, _ = proxy_token(deployment, container)
    assert not proxy_knows(deployment, token)
    proxies = engine.api.containers(
        filters={"label": f"io.toolreg.instance={deployment.app.backend.instance_id}",  # type: ignore[attr-defined]
                 "name": "egress-proxy"})  # fmt: skip
    proxy_ip = proxies[0]["NetworkSettings"]["Networks"][world.network_name]["IPAddress"]
    status = engine.containers.run(
        "toolreg/python", ["python3", "-c", WITH_STOLEN_TOKEN, proxy_ip, token],
        network=world.network_name, remove=True, labels=world.labels, user="65534:65534",
    ).decode().strip()  # fmt: skip
    assert status.startswith("HTTP/1.1 407"), status
    assert [r for r in world.requests("plain.world.test") if r["path"] == "/stolen"] == []
    r = deployment.run(
        WARM_FETCHER,
        {"kind": "fetch", "url": "https://api.world.test/warm-hello"},
        {"kind": "fetch", "url": "https://forbidden.world.test/"},
        {"kind": "fetch", "url": "http://plain.world.test/warm-plain"},
    )
    got = results(r)
    assert [g["ok"] for g in got] == [True, False, True], got
    record = deployment.audit(r.execution_id)
    assert record["warm"] is True and record["container_id"] == container
    seen = {(c["host"], c["port"]): c for c in record["egress"]}
    assert seen[("api.world.test", 443)]["injected"] is True
    assert "not in the allow-list" in seen[("forbidden.world.test", 443)]["reason"]
    sent = [q for q in world.requests("api.world.test") if q["path"] == "/warm-hello"]
    assert [q["headers"]["Authorization"] for q in sent] == [f"Bearer {CANARY}"]
    assert not proxy_knows(deployment, token)  # closed with its call
    # The proxy knew the container by the call it served, not by the container.
    refused = f"refused forbidden.world.test:443 for  ({r.execution_id})"
    proxy_log = proxy_log_with(engine, proxies[0]["Id"], refused)
    assert refused in proxy_log, proxy_log
    register_warm_fetcher(deployment, 0)  # drained: its replacement is never registered


def test_a_live_calls_token_opens_nothing_from_another_network(
    deployment: Deployment, fetcher: str
) -> None:
    """A running call's proxy token, stolen (read from the engine here, as a
    colluding tool could leak it), is refused from any network but its call's
    own: the proxy knows each token by the address it is reached at there. The
    call itself goes on using it."""
    world, engine = deployment.world, deployment.engine
    instance = deployment.app.backend.instance_id  # type: ignore[attr-defined]
    ops = ({"kind": "sleep", "s": 3.5}, {"kind": "fetch", "url": "http://plain.world.test/own"})
    ours = {"label": f"io.toolreg.instance={instance}"}
    earlier = {c["Id"] for c in engine.api.containers(all=True, filters=ours)}
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(deployment.run, fetcher, *ops)
        deadline, sandbox = time.monotonic() + 60, None
        while sandbox is None:  # the call's sandbox: new, with a proxy in its environment
            assert time.monotonic() < deadline and not call.done(), "the call never started"
            for c in engine.api.containers(filters=ours):
                if c["Id"] in earlier:
                    continue  # an earlier call's, perhaps being removed
                if (c.get("Labels") or {}).get(LABEL_EXECUTION_ID, "").startswith("warm-"):
                    # A pool's, made for no call: the last test's pool, set to 0, may
                    # still be finishing (then removing) the container it was making.
                    continue
                with contextlib.suppress(docker.errors.NotFound):
                    env = engine.api.inspect_container(c["Id"])["Config"]["Env"] or []
                    if any(v.startswith("HTTPS_PROXY=") for v in env):
                        sandbox = c["Id"]
            time.sleep(0.1)
        token, own_address = proxy_token(deployment, sandbox)
        proxies = engine.api.containers(
            filters={"label": f"io.toolreg.instance={instance}", "name": "egress-proxy"}
        )
        upstream_address = proxies[0]["NetworkSettings"]["Networks"][world.network_name][
            "IPAddress"
        ]
        assert upstream_address != own_address
        status = engine.containers.run(
            "toolreg/python", ["python3", "-c", WITH_STOLEN_TOKEN, upstream_address, token],
            network=world.network_name, remove=True, labels=world.labels, user="65534:65534",
        ).decode().strip()  # fmt: skip
        result = call.result()
    assert status.startswith("HTTP/1.1 407"), status
    assert [r for r in world.requests("plain.world.test") if r["path"] == "/stolen"] == []
    assert [g["ok"] for g in results(result)] == [True, True], result.content
    record = deployment.audit(result.execution_id)
    assert record["container_id"] == sandbox  # the token was this call's
    assert [(c["host"], c["allowed"]) for c in record["egress"]] == [("plain.world.test", True)]
    elsewhere = f"the token of {result.execution_id} came from another network"
    proxy_log = proxy_log_with(engine, proxies[0]["Id"], elsewhere)
    assert elsewhere in proxy_log, proxy_log


def test_calls_never_share_a_network_and_each_is_removed_after_its_call(
    deployment: Deployment, fetcher: str
) -> None:
    """Warm and cold calls with egress, some at once: every call's container
    was connected to exactly one network, no two calls to the same one,
    nothing but the proxy joined it, and it is gone after the call."""
    engine = deployment.engine
    # from before the warm containers are made (and joined) until every call's clean-up
    with recorded(engine) as recording:
        register_warm_fetcher(deployment, 2)
        wait_warm(deployment, WARM_FETCHER, 2)
        op = {"kind": "fetch", "url": "http://plain.world.test/shared"}
        with ThreadPoolExecutor(3) as pool:
            done = [pool.submit(deployment.run, name, op) for name in [WARM_FETCHER, fetcher] * 3]
            calls = [f.result() for f in done]
        deployment.app.backend.flush()
    register_warm_fetcher(deployment, 0)
    records = [deployment.audit(r.execution_id) for r in calls]
    assert all(results(r)[0]["ok"] for r in calls)
    assert any(rec["warm"] for rec in records) and not all(rec["warm"] for rec in records)
    events = recording.events
    network_of = {  # call container -> its network, as labelled at create
        e["Actor"]["ID"]: e["Actor"]["Attributes"].get("io.toolreg.egress-network")
        for e in events
        if e["Type"] == "container" and e["Action"] == "create"
    }
    names = {e["Actor"]["Attributes"]["name"]: e["Actor"]["ID"] for e in events
             if e["Type"] == "network"}  # fmt: skip
    joined: dict[str, set[str]] = {}  # network name -> containers connected to it
    for e in events:
        if e["Type"] == "network" and e["Action"] == "connect":
            joined.setdefault(e["Actor"]["Attributes"]["name"], set()).add(
                e["Actor"]["Attributes"]["container"]
            )
    destroyed = {e["Actor"]["ID"] for e in events
                 if e["Type"] == "network" and e["Action"] == "destroy"}  # fmt: skip
    proxy = deployment.app.backend._egress.proxy_id  # type: ignore[attr-defined]
    used = [network_of[rec["container_id"]] for rec in records]
    assert all(used) and len(set(used)) == len(calls), used  # no two calls on one network
    for network in used:
        # Only the proxy and the call's holder (whose namespace the call's
        # sandbox joined) were ever on it; it is gone after the call.
        # (a pooled network's holder may have joined before the calls began)
        holders = joined.get(network, set()) - {proxy}
        assert len(holders) <= 1, joined.get(network)
        assert list(network_of.values()).count(network) == 1  # one sandbox ever labelled so
        assert not holders & {rec["container_id"] for rec in records}  # no sandbox directly
        assert names[network] in destroyed

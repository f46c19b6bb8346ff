"""What gVisor costs a call with egress: one HTTP fetch through the egress proxy
from a dangerous tool (runsc-net, approved with a fresh token each call) against
the same tool as a cautious one (runc), and against dangerous and cautious tools
that fetch nothing (runsc, runc: no network of their own), interleaved so noise
hits every row alike.

The upstream is the bench's own: tests/egress_world's HTTP server and DNS server
in containers on a network the bench creates, which the policy's
egress.allow_private names (the proxy refuses private addresses otherwise). The
server runs with a written policy (one agent, one approver), since development
mode allows no private upstream."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import docker
import grpc
import yaml

from bench.common import (
    BENCH_LABEL,
    RPC_TIMEOUT_S,
    Unavailable,
    server,
    summary,
    summary_table,
)
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.wire import convert
from sandbox_runner.docker_backend import runtimes_of
from sandbox_runner.profiles import GVISOR_NET, gvisor_network
from tests.egress_world import UpstreamWorld
from tests.factories import sha

RUNS = 20  # measured calls per row (fewer with --quick)
UPSTREAM = "plain.world.test"  # the world's HTTP upstream
URL = f"http://{UPSTREAM}/bench"
AGENT_TOKEN = "bench-egress-agent"  # the bearer token of the policy's one client
APPROVER = "bench"
TOKEN_TTL_S = 300  # seconds a minted approval token lives
# The tool: fetch the URL it is given through the proxy (urllib reads HTTP_PROXY),
# or fetch nothing; either way one line of JSON.
SCRIPT = r"""
import json, sys, urllib.request
args = json.load(sys.stdin)
if args.get("url"):
    with urllib.request.urlopen(args["url"], timeout=10) as r:
        print(json.dumps({"status": r.status, "bytes": len(r.read())}))
else:
    print(json.dumps({"status": 0}))
"""
# row -> (tool name, level, egress, arguments)
ROWS: dict[str, tuple[str, str, bool, dict[str, str]]] = {
    "dangerous, egress (runsc-net)": ("bench_fetch_dangerous", "dangerous", True, {"url": URL}),
    "cautious, egress (runc)": ("bench_fetch_cautious", "cautious", True, {"url": URL}),
    "dangerous, no egress (runsc)": ("bench_still_dangerous", "dangerous", False, {}),
    "cautious, no egress (runc)": ("bench_still_cautious", "cautious", False, {}),
}


def run(runs: int, run_id: str, engine: docker.DockerClient) -> dict[str, Any]:
    args = runtimes_of(engine.info()).get(GVISOR_NET)
    if args is None:
        raise Unavailable(f"the engine has no {GVISOR_NET} runtime: run scripts/ensure_docker.sh")
    labels = {BENCH_LABEL: run_id}  # the world's containers are this run's, not noise
    with UpstreamWorld(engine, https=(), http=(UPSTREAM,), labels=labels) as world:
        private, public = generate_keypair()
        policy_file = world.ca_file.parent / "bench-policy.yaml"
        policy_file.write_text(yaml.safe_dump(_policy(public, world.subnet)))
        env = {
            "TOOLREG_POLICY_FILE": str(policy_file),
            "TOOLREG_EGRESS_NETWORKS": json.dumps([world.network_name]),
            "TOOLREG_EGRESS_DNS": json.dumps([world.dns_ip]),
        }
        with server(engine, **env) as srv, open_channel(srv.proc.address, token=AGENT_TOKEN) as ch:
            stub = pb_grpc.ToolRegistryStub(ch)
            calls = {row: _caller(stub, private, *spec) for row, spec in ROWS.items()}
            for call in calls.values():
                call()  # one unmeasured call each: images and the proxy warm
            times: dict[str, list[float]] = {row: [] for row in ROWS}
            for i in range(runs):
                order = list(ROWS)[i % len(ROWS) :] + list(ROWS)[: i % len(ROWS)]
                for row in order:
                    times[row].append(calls[row]())
        fetched = len(world.requests(UPSTREAM))
    return {
        "runs": runs,
        "gvisor_network": gvisor_network(args),
        "rows": [{"what": row, **summary(ms)} for row, ms in times.items()],
        "upstream_requests": fetched,
    }


def _policy(public_key: str, subnet: str) -> dict[str, Any]:
    return {
        "audience": "toolreg-bench-egress",
        "approvers": [{"id": APPROVER, "public_key": public_key, "groups": ["bench"]}],
        "approval_rules": [{"match": {"level": "dangerous"}, "approvals_required": 1,
                            "groups": ["bench"], "max_token_ttl_s": 600}],
        "egress": {"allow_private": [subnet]},
        "clients": [{"id": "bench-agent", "token_sha256": sha(AGENT_TOKEN),
                     "roles": ["admin", "register", "execute"],
                     "max_safety_level": "dangerous"}],
    }  # fmt: skip


def _caller(
    stub: pb_grpc.ToolRegistryStub,
    approver_pem: bytes,
    name: str,
    level: str,
    egress: bool,
    arguments: dict[str, str],
) -> Callable[[], float]:
    """Registers the tool; returns one timed call of it (milliseconds), a
    dangerous one with a fresh token minted before the clock starts."""
    definition = parse_definition(
        {
            "name": name,
            "description": "egress cost benchmark",
            "parameters": {"type": "object"},
            "safety_level": level,
            "sandbox": {"image": "toolreg/python", "command": ["python3", "-c", SCRIPT]},
            **({"network": {"egress": [f"{UPSTREAM}:80"]}} if egress else {}),
        }
    )
    stub.RegisterTool(
        pb.RegisterToolRequest(tool=convert.tool_to_pb(definition), replace=True),
        timeout=RPC_TIMEOUT_S,
    )
    arguments_json = json.dumps(arguments)
    key = load_private_key(approver_pem)
    approval = None  # what a dangerous tool's approver signs, once per call
    if level == "dangerous":
        asked = stub.ExecuteTool(
            pb.ExecuteToolRequest(name=name, arguments_json=arguments_json), timeout=RPC_TIMEOUT_S
        )
        if asked.status != pb.EXECUTION_STATUS_APPROVAL_REQUIRED:
            raise Unavailable(f"{name}: expected APPROVAL_REQUIRED, got {asked.error or asked}")
        approval = asked.approval_request

    def call() -> float:
        tokens = []
        if approval is not None:  # minted before the clock starts
            tokens = [mint_for(key, issuer=APPROVER, request=approval, ttl_s=TOKEN_TTL_S)]
        t0 = time.perf_counter()
        try:
            result = stub.ExecuteTool(
                pb.ExecuteToolRequest(
                    name=name, arguments_json=arguments_json, approval_tokens=tokens
                ),
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            raise RuntimeError(f"{name}: {exc}") from exc
        elapsed = (time.perf_counter() - t0) * 1000
        if not result.success or (egress and json.loads(result.content)["status"] != 200):
            raise RuntimeError(f"{name}: {result.error or result.content} (status {result.status})")
        return elapsed

    return call


def report_md(sec: dict[str, Any]) -> list[str]:
    heading = f"What gVisor costs a call with egress ({sec['runs']} interleaved calls each)"
    lines = summary_table(heading, "call", sec["rows"])
    lines += [
        "",
        "Each call is a fresh `toolreg/python` container. A tool with egress fetches one URL"
        " from an HTTP upstream the bench runs, through the egress proxy on the call's own"
        " network; one without fetches nothing and has no network. Each dangerous call carries"
        f" a fresh approval token. runsc-net ran with gVisor's {sec['gvisor_network']};"
        f" {sec['upstream_requests']} requests reached the upstream.",
    ]
    return lines

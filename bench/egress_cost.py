"""What a call with egress costs: one HTTP fetch through the egress proxy
from a dangerous tool (runsc-net, approved with a fresh token each call) against
the same tool as a cautious one (runc), and against dangerous and cautious tools
that fetch nothing (runsc, runc: no network of their own), each cold and from a
warm pool, interleaved so noise hits every row alike. A pause after each call
lets the server's background work (removal, the refill of its warm pools and
of its networks made ahead of calls) end before the next is timed.

``targets`` holds the medians issue 23 compares (egress against no egress,
cold and warm; ``gvisor_`` for the dangerous pair), and ``phases`` where the
time of one cautious call with egress goes inside the runner (the backend
driven in-process, each engine call timed), with a network from the pool and
with the pool empty.

The upstream is the bench's own: tests/egress_world's HTTP server and DNS server
in containers on a network the bench creates, which the policy's
egress.allow_private names (the proxy refuses private addresses otherwise). The
server runs with a written policy (one agent, one approver), since development
mode allows no private upstream."""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
import grpc
import yaml

from bench.common import (
    BENCH_LABEL,
    REMOVAL_S,
    RPC_TIMEOUT_S,
    Server,
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
from sandbox_runner import EgressSpec, SandboxSpec, profile_for
from sandbox_runner.docker_backend import DockerBackend, runtimes_of
from sandbox_runner.egress.gateway import EgressConfig
from sandbox_runner.profiles import GVISOR_NET, gvisor_network
from sandbox_runner.spec import INIT_BINARY
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
WARM_POOL = 2  # warm_pool of the warm rows' tools
PAUSE_S = 0.4  # seconds after each call for the server's background work (untimed)
SETTLE_TIMEOUT_S = 10.0  # seconds a warm pool may take to refill between calls
PHASE_RUNS = 10  # in-process egress calls per phase breakdown
# row -> (tool name, level, egress, arguments, warm_pool)
ROWS: dict[str, tuple[str, str, bool, dict[str, str], int]] = {
    "dangerous, egress (runsc-net)": ("bench_fetch_dangerous", "dangerous", True, {"url": URL}, 0),
    "cautious, egress (runc)": ("bench_fetch_cautious", "cautious", True, {"url": URL}, 0),
    "dangerous, no egress (runsc)": ("bench_still_dangerous", "dangerous", False, {}, 0),
    "cautious, no egress (runc)": ("bench_still_cautious", "cautious", False, {}, 0),
    "dangerous, egress, warm (runsc-net)": (
        "bench_fetch_dangerous_warm", "dangerous", True, {"url": URL}, WARM_POOL),
    "cautious, egress, warm (runc)": (
        "bench_fetch_cautious_warm", "cautious", True, {"url": URL}, WARM_POOL),
    "dangerous, no egress, warm (runsc)": (
        "bench_still_dangerous_warm", "dangerous", False, {}, WARM_POOL),
    "cautious, no egress, warm (runc)": (
        "bench_still_cautious_warm", "cautious", False, {}, WARM_POOL),
}  # fmt: skip
# target key -> row whose p50 it is
TARGETS = {
    "cold_egress_p50_ms": "cautious, egress (runc)",
    "cold_plain_p50_ms": "cautious, no egress (runc)",
    "warm_egress_p50_ms": "cautious, egress, warm (runc)",
    "warm_plain_p50_ms": "cautious, no egress, warm (runc)",
    "gvisor_cold_egress_p50_ms": "dangerous, egress (runsc-net)",
    "gvisor_cold_plain_p50_ms": "dangerous, no egress (runsc)",
    "gvisor_warm_egress_p50_ms": "dangerous, egress, warm (runsc-net)",
    "gvisor_warm_plain_p50_ms": "dangerous, no egress, warm (runsc)",
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
        warm_misses = 0
        with server(engine, **env) as srv, open_channel(srv.proc.address, token=AGENT_TOKEN) as ch:
            stub = pb_grpc.ToolRegistryStub(ch)
            calls = {row: _caller(stub, private, *spec) for row, spec in ROWS.items()}
            for call in calls.values():
                call()  # one unmeasured call each: images and the proxy warm
            expected = srv.steady_count()  # the proxy and the warm containers
            times: dict[str, list[float]] = {row: [] for row in ROWS}
            for i in range(runs):
                order = list(ROWS)[i % len(ROWS) :] + list(ROWS)[: i % len(ROWS)]
                for row in order:
                    times[row].append(calls[row]())
                    warm_misses += _pause(srv, expected)
        fetched = len(world.requests(UPSTREAM))
        phases = _phases(engine, world, policy_file.parent)
    p50 = {row: statistics.median(ms) for row, ms in times.items()}
    return {
        "runs": runs,
        "gvisor_network": gvisor_network(args),
        "rows": [{"what": row, **summary(ms)} for row, ms in times.items()],
        "upstream_requests": fetched,
        "refill_timeouts": warm_misses,
        "targets": {key: round(p50[row], 2) for key, row in TARGETS.items()},
        "phases": phases,
    }


def _pause(srv: Server, expected: int) -> int:
    """Untimed: the used container's removal and the refills end before the
    next call. 1 when the warm pools were not full again in time."""
    time.sleep(REMOVAL_S)
    seen = srv.settle(expected, SETTLE_TIMEOUT_S)
    time.sleep(PAUSE_S)
    return int(seen < expected)


class _Timed:
    """The engine API with each call's duration recorded by name (phases)."""

    def __init__(self, api: Any, log: list[tuple[str, float]]) -> None:
        self._api = api
        self._log = log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        log = self._log

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                if threading.current_thread().name != "egress-networks":
                    log.append((name, (time.perf_counter() - t0) * 1000))

        return timed


@contextmanager
def _timing(backend: DockerBackend) -> Iterator[list[tuple[str, float]]]:
    """Time every engine call and egress step of ``backend`` on the caller's path."""
    log: list[tuple[str, float]] = []
    client = backend._client()
    real_api = client.api
    client.api = _Timed(real_api, log)  # type: ignore[assignment]
    gateway = backend._egress
    assert gateway is not None
    steps: dict[str, Callable[..., Any]] = {
        "open": gateway.open,
        "register": gateway.register,
        "release": gateway.release,
    }

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append((f"egress.{name}", (time.perf_counter() - t0) * 1000))

        return run

    for name, fn in steps.items():
        setattr(gateway, name, timed(name, fn))
    try:
        yield log
    finally:
        client.api = real_api
        for name in steps:
            delattr(gateway, name)


def _phases(engine: docker.DockerClient, world: UpstreamWorld, state: Path) -> dict[str, Any]:
    """Medians (ms) of each step of a cautious call with egress, run by the
    backend in this process: with a network from the pool, and with none."""
    out: dict[str, Any] = {}
    limits = profile_for("cautious")
    egress = EgressSpec(allow=(f"{UPSTREAM}:80",), max_bytes=1 << 20, max_connections=4,
                        allow_private=(world.subnet,))  # fmt: skip
    spec = SandboxSpec(image="toolreg/python", command=("python3", "-c", SCRIPT), env=(),
                       limits=limits, egress=egress)  # fmt: skip
    for label, pool in (("pooled network", 2), ("own network", 0)):
        backend = DockerBackend(
            instance_id=f"bench-phases-{uuid.uuid4().hex[:8]}",
            extra_labels={BENCH_LABEL: "phases"},
            init_path=INIT_BINARY,
            egress=EgressConfig(state_dir=state / f"phases-{pool}",
                                upstream_networks=(world.network_name,), dns=(world.dns_ip,),
                                upstream_ca_file=world.ca_file, network_pool=pool),
        )  # fmt: skip
        try:
            backend.run(spec, execution_id=uuid.uuid4().hex)  # the proxy starts; the pool fills
            samples: dict[str, list[float]] = {}
            for _ in range(PHASE_RUNS):
                time.sleep(1.0)  # the pool refilled, the last call's removal done
                with _timing(backend) as log:
                    t0 = time.perf_counter()
                    prepared = backend.prepare(spec, execution_id=uuid.uuid4().hex)
                    t1 = time.perf_counter()
                    result = prepared.finish(json.dumps({"url": URL}).encode())
                    t2 = time.perf_counter()
                if json.loads(result.stdout)["status"] != 200:
                    raise RuntimeError(f"phases: {result.stdout!r} {result.stderr!r}")
                per: dict[str, float] = {"prepare (all)": (t1 - t0) * 1000,
                                         "finish (all)": (t2 - t1) * 1000}  # fmt: skip
                for name, ms in log:
                    per[name] = per.get(name, 0.0) + ms
                for name, ms in per.items():
                    samples.setdefault(name, []).append(ms)
            out[label] = {name: round(statistics.median(v), 1) for name, v in samples.items()}
        finally:
            backend.close()
    return out


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
    warm_pool: int = 0,
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
            "warm_pool": warm_pool,
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
        f" {sec['upstream_requests']} requests reached the upstream. Warm rows: a pool of"
        f" {WARM_POOL} each, refilled between calls ({sec.get('refill_timeouts', 0)} times"
        " not in time).",
    ]
    for label, phases in (sec.get("phases") or {}).items():
        lines += ["", f"One cautious call with egress, in the runner, {label} (p50 ms):", ""]
        lines += ["| step | ms |", "|---|---:|"]
        lines += [f"| {name} | {ms} |" for name, ms in phases.items()]
    return lines

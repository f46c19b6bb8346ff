"""Where a call's time goes, phase by phase, from the server's own spans.

A server exports every span over OTLP/gRPC to a collector in another process;
the bench times each call at the client and matches it to its trace by the
execution id. Each phase is the median over the calls of one span (the
executor's steps and the backend's tool run), plus two derived phases: what
the RPC span holds outside its steps (the servicer, conversions, checks that
have no span), and what lies outside the RPC span altogether (the client,
its channel, loopback, the server's gRPC core and thread hand-off).

Tracing adds a little to each step (recording spans); the tracing section
measures how much. The removal of the used container runs after the answer
and is reported apart: it is not on the call's path.

Runs alone too: ``python -m bench.phases``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import docker
import grpc

from bench.common import COMMAND, IMAGE, Server, TraceCollector, definition, server, summary
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import build_app
from registry_server.api.auth import Authenticator, AuthInterceptor
from registry_server.api.config import ServerConfig
from registry_server.api.metrics import MetricsInterceptor
from registry_server.api.servicer import ToolRegistryServicer
from registry_server.domain.models import parse_definition
from registry_server.policy.loader import load_policy
from registry_server.store.page_key import page_tokens

WARM_POOL = 4
SETTLE_TIMEOUT_S = 5.0
BURST_PAUSE_S = 2.0

# Span names (registry_server/execution/tracing.py, sandbox_runner/tracing.py).
RPC_PREFIX = "/toolregistry.v1.ToolRegistry/ExecuteTool"
STEPS = (
    "toolreg.validate_arguments",
    "toolreg.approval",
    "toolreg.admission",
    "toolreg.sandbox.start",
    "toolreg.approval.spend",
    "toolreg.tool.run",
    "toolreg.audit.write",
)
REMOVE = "toolreg.sandbox.remove"
OUTSIDE = "outside the RPC span: client, channel, loopback, gRPC core"
REST = "inside the RPC span, between steps: servicer, checks, conversions"
PATH_WARM_RUNC = "warm call, runc (safe tool)"
PATH_WARM_GVISOR = "warm call, gVisor (dangerous tool, approval token)"
PATH_COLD = "cold call, runc (safe tool)"
PATH_BURST = f"burst: {WARM_POOL} warm calls at once from a full pool of {WARM_POOL}"


def run(runs: int, engine: docker.DockerClient) -> dict[str, Any]:
    collector = TraceCollector(dump=True)
    env = {**collector.env, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    client_ms: dict[str, dict[str, float]] = defaultdict(dict)  # path -> execution id -> ms
    try:
        with server(engine, **env) as srv:
            srv.register(definition("phase_warm", warm_pool=WARM_POOL))
            srv.register(definition("phase_cold"))
            srv.register(definition("phase_gvisor", level="dangerous", warm_pool=WARM_POOL))
            token = srv.token_minter("phase_gvisor")
            full = 2 * WARM_POOL
            srv.settle(full, SETTLE_TIMEOUT_S * 3)
            for _ in range(runs):
                _timed(srv, PATH_WARM_RUNC, "phase_warm", (), client_ms)
                srv.settle_after_call(full, SETTLE_TIMEOUT_S)
                _timed(srv, PATH_WARM_GVISOR, "phase_gvisor", (token(),), client_ms)
                srv.settle_after_call(full, SETTLE_TIMEOUT_S)
                _timed(srv, PATH_COLD, "phase_cold", (), client_ms)
                srv.settle_after_call(full, SETTLE_TIMEOUT_S)
            for _ in range(max(5, runs // 3)):
                _burst(srv, "phase_warm", client_ms)
                time.sleep(BURST_PAUSE_S)
                srv.settle(full, SETTLE_TIMEOUT_S)
            time.sleep(1.0)  # the batch processor's last export
    finally:
        lines = collector.finish()
    spans = [json.loads(line) for line in lines[:-1]]
    return {
        "runs": runs,
        "paths": analyse(spans, client_ms),
        "interceptors": interceptor_costs(max(200, runs * 20)),
    }


# -- the gRPC path: what each interceptor costs a call ------------------------------

TOKEN = "phases-bench-token"
POLICY = f"""
audience: toolreg-bench
approvers: []
clients:
  - id: bench
    token_sha256: "{hashlib.sha256(TOKEN.encode()).hexdigest()}"
    roles: [execute, register]
"""


def interceptor_costs(runs: int) -> dict[str, Any]:
    """GetTool round trips on loopback against in-process servers that differ only
    in their interceptors (tracing off), interleaved; medians in microseconds.
    The server's own code under them is the same: one dictionary look-up."""
    work = Path(tempfile.mkdtemp(prefix="toolreg-bench-grpc-"))
    policy_file = work / "policy.yaml"
    policy_file.write_text(POLICY)
    app = build_app(ServerConfig(port=0, host="127.0.0.1", data_dir=work / "data"))
    policy = load_policy(policy_file)
    sets: dict[str, list[grpc.ServerInterceptor]] = {
        "none": [],
        "metrics": [MetricsInterceptor(app.metrics)],
        "auth (policy, bearer token)": [AuthInterceptor(Authenticator(policy))],
        "metrics + auth": [MetricsInterceptor(app.metrics), AuthInterceptor(Authenticator(policy))],
    }
    servers, stubs = [], {}
    try:
        for name, interceptors in sets.items():
            srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
            pb_grpc.add_ToolRegistryServicer_to_server(
                ToolRegistryServicer(
                    app.registry, app.executor, app.approvals, app.watches, app.policy,
                    app.reloads, pages=page_tokens(app.store),
                ),
                srv,
            )  # fmt: skip
            port = srv.add_insecure_port("127.0.0.1:0")
            srv.start()
            servers.append(srv)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(channel).result(timeout=10)
            stubs[name] = pb_grpc.ToolRegistryStub(channel)
        app.registry.register(parse_definition(_tool_json("phase_read")))
        meta = (("authorization", f"Bearer {TOKEN}"),)
        got: dict[str, list[float]] = {name: [] for name in stubs}
        request = pb.GetToolRequest(name="phase_read")
        for i in range(runs + 20):
            for name, stub in stubs.items():
                t0 = time.perf_counter()
                stub.GetTool(request, metadata=meta, timeout=10)
                if i >= 20:  # the first ones warm the channels
                    got[name].append((time.perf_counter() - t0) * 1e6)
    finally:
        for srv in servers:
            srv.stop(grace=None)
        app.close()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(got["none"])
    return {
        "runs": runs,
        "rows": [
            {"interceptors": name, "p50_us": round(statistics.median(v), 1),
             "added_us": round(statistics.median(v) - base, 1)}
            for name, v in got.items()
        ],
    }  # fmt: skip


def _tool_json(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": "read for the gRPC path bench",
        "parameters": {"type": "object"},
        "safety_level": "safe",
        "sandbox": {"image": IMAGE, "command": COMMAND},
    }


def _timed(
    srv: Server, path: str, tool: str, tokens: Sequence[str],
    client_ms: dict[str, dict[str, float]],
) -> None:  # fmt: skip
    t0 = time.perf_counter()
    result = srv.execute(tool, tokens)
    elapsed = (time.perf_counter() - t0) * 1000
    if not result.success:
        raise RuntimeError(f"{tool}: {result.error} (status {result.status})")
    client_ms[path][result.execution_id] = elapsed


def _burst(srv: Server, tool: str, client_ms: dict[str, dict[str, float]]) -> None:
    start = threading.Barrier(WARM_POOL)
    errors: list[BaseException] = []

    def call() -> None:
        start.wait()
        try:
            _timed(srv, PATH_BURST, tool, (), client_ms)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(WARM_POOL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def analyse(
    spans: Sequence[Mapping[str, Any]], client_ms: Mapping[str, Mapping[str, float]]
) -> dict[str, Any]:
    """Per path: the client's total and the median of each phase over its calls."""
    by_trace: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    rpc_of: dict[str, Mapping[str, Any]] = {}
    for s in spans:
        if s["name"].startswith(RPC_PREFIX):
            eid = (s.get("attributes") or {}).get("toolreg.execution_id")
            if eid:
                rpc_of[eid] = s
    out: dict[str, Any] = {}
    for path, calls in client_ms.items():
        phases: dict[str, list[float]] = defaultdict(list)
        totals: list[float] = []
        for eid, total in calls.items():
            rpc = rpc_of.get(eid)
            if rpc is None:
                continue  # its span was not exported: leave the call out of the table
            totals.append(total)
            rpc_ms = _ms(rpc)
            phases[OUTSIDE].append(max(0.0, total - rpc_ms))
            children = [c for c in by_trace[rpc["trace_id"]] if c["parent_id"] == rpc["span_id"]]
            inside = 0.0
            for name in (*STEPS, REMOVE):
                found = [c for c in children if c["name"] == name]
                if not found:
                    continue
                ms = sum(_ms(c) for c in found)
                phases[name].append(ms)
                if name != REMOVE:
                    inside += ms
            phases[REST].append(max(0.0, rpc_ms - inside))
        out[path] = {
            "calls": len(totals),
            "total": summary(totals) if totals else {},
            "phases": {name: round(statistics.median(v), 2) for name, v in phases.items()},
        }
    return out


def _ms(span: Mapping[str, Any]) -> float:
    return (int(span["end_ns"]) - int(span["start_ns"])) / 1e6


def markdown(sec: Mapping[str, Any]) -> list[str]:
    """One table per path: the client's p50, then each phase's median."""
    lines = [
        "## Where a call's time goes (phases, from the server's spans)",
        "",
        f"{sec.get('runs', 0)} calls per path with tracing on (OTLP to a collector in another"
        " process); medians per phase, so they need not add up to the median total."
        " The removal runs after the answer and is not part of the call.",
        "",
    ]
    order = (OUTSIDE, *STEPS, REST, REMOVE)
    for path, data in (sec.get("paths") or {}).items():
        total = (data.get("total") or {}).get("p50_ms")
        lines += [f"**{path}**: {data.get('calls', 0)} calls, client p50 "
                  f"{'-' if total is None else f'{total:.1f}'} ms", "",
                  "| phase | median ms |", "|---|---:|"]  # fmt: skip
        phases = data.get("phases") or {}
        for name in order:
            if name in phases:
                shown = name.removeprefix("toolreg.")
                if name == REMOVE:
                    shown += " (after the answer)"
                lines.append(f"| {shown} | {phases[name]:.2f} |")
        lines.append("")
    grpc_path = sec.get("interceptors") or {}
    if grpc_path.get("rows"):
        lines += [
            "**The gRPC path**: what each interceptor adds to a GetTool round trip on"
            f" loopback (in-process servers, tracing off, {grpc_path['runs']} calls each,"
            " interleaved)",
            "",
            "| interceptors | p50 µs | added µs |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {r['interceptors']} | {r['p50_us']:.0f} | {r['added_us']:+.0f} |"
            for r in grpc_path["rows"]
        ]
        lines.append("")
    return lines


def main() -> None:
    from bench.common import engine_client, require_image

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    engine = engine_client(pool=8)
    require_image(engine)
    res = run(runs, engine)
    print("\n".join(markdown(res)))


if __name__ == "__main__":
    main()

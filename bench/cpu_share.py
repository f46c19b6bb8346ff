"""Large arguments and the server's CPU (issue 37, item 5; docs/explanation/
speed.md, "Large arguments share the CPU"): a quiet client's cheap call,
refused by a deny rule, idle and while six other clients send 1 MiB
arguments to a tool with one cheap guard, and to a tool with the costliest
sixteen guards the caps accept (bench/worst_guards.py; the last refuses, so
nothing runs). Phases alternate idle / one guard / sixteen guards, round
after round, so the machine's noise falls on all three.

The workload is shared with tests/robustness/test_cpu_share.py, which asserts
the targets this section reports: one-guard load / idle <= 10x, sixteen
guards' load / one guard's <= 1.5x, at p50. A real `toolreg serve` process,
bearer credentials from a policy naming every client."""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.common import summary, summary_table
from bench.worst_guards import worst_arguments, worst_tool
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.wire import convert
from tests.factories import sha

HEAVY_CLIENTS = 6
SAMPLE_GAP_S = 0.02  # seconds between two quiet calls
LOAD_SETTLE_S = 0.4  # seconds a load runs before its phase's first sample
ARGUMENTS_BYTES = 1024 * 1024 - 256  # each heavy call's arguments JSON, at most
IDLE_TARGET = 10.0  # quiet call p50 under the one-guard load / idle (the issue)
GUARDS_TARGET = 1.5  # quiet call p50 under the sixteen guards' load / the one guard's
ONE_GUARD_MESSAGE = "the cheap guard refused the call"
IDLE, ONE, SIXTEEN = "idle", "one guard", "sixteen guards"
TOOLS = {ONE: "one_guard", SIXTEEN: "sixteen_guards"}
METRICS_LINE = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")
S = pb.ExecutionStatus


def token(who: str) -> str:
    return f"{who}-cpu-share-secret"


def write_policy(path: Path) -> None:
    """A registrant with the register role only, the heavy clients, the quiet
    one, and a deny rule refusing every call of the tool ``denied``."""
    clients = [
        {"id": "registrant", "token_sha256": sha(token("registrant")), "roles": ["register"]},
        *(
            {"id": who, "token_sha256": sha(token(who)), "roles": ["execute"],
             "max_safety_level": "safe"}
            for who in ["quiet", *(f"heavy{n}" for n in range(HEAVY_CLIENTS))]
        ),
    ]  # fmt: skip
    deny = {"name": "never-this", "match": {"tool": "denied"}, "reason": "not this tool"}
    policy = {"audience": "toolreg-cpu-share", "clients": clients, "deny_rules": [deny]}
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def tools() -> dict[str, ToolDefinition]:
    sandbox = {"image": "toolreg/base", "command": ["cat"]}
    one = parse_definition({
        "name": TOOLS[ONE], "description": "one cheap guard",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        # refuses every non-empty q at no cost (a length check)
        "guard": [{"condition": 'args.q == ""', "message": ONE_GUARD_MESSAGE}],
        "sandbox": sandbox,
    })  # fmt: skip
    denied = parse_definition({
        "name": "denied", "description": "refused by the policy's deny rule",
        "parameters": {"type": "object"}, "sandbox": sandbox,
    })  # fmt: skip
    return {ONE: one, SIXTEEN: worst_tool(TOOLS[SIXTEEN]), "denied": denied}


def refusing_arguments(tool: ToolDefinition) -> str:
    """Arguments on which every guard of the costliest set scans all of its
    text and holds but the last, which then refuses (so nothing ever runs):
    the worst arguments, ended by what the last guard looks for. Both loads
    send these same arguments: they differ by the guards alone."""
    last = tool.guards[-1].condition
    literal = last.split('("', 1)[1].rsplit('")', 1)[0]
    needle = literal if ".contains(" in last else literal[-1]
    text = worst_arguments(ARGUMENTS_BYTES - 64)["q"] + needle
    arguments = json.dumps({"q": text}, ensure_ascii=False)
    assert len(arguments.encode()) <= ARGUMENTS_BYTES
    return arguments


def expected_refusal(tool: ToolDefinition) -> str:
    return tool.guards[-1].message


@dataclass
class Deployment:
    server: ServerProcess
    metrics_port: int
    tools: dict[str, ToolDefinition]
    stubs: dict[str, pb_grpc.ToolRegistryStub] = field(default_factory=dict)
    channels: list[grpc.Channel] = field(default_factory=list)

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        if who not in self.stubs:
            channel = open_channel(self.server.address, token=token(who))
            self.channels.append(channel)
            self.stubs[who] = pb_grpc.ToolRegistryStub(channel)
        return self.stubs[who]

    def quiet_ms(self) -> float:
        started = time.perf_counter()
        result = self.stub("quiet").ExecuteTool(
            pb.ExecuteToolRequest(name="denied", arguments_json="{}"), timeout=30
        )
        elapsed = (time.perf_counter() - started) * 1000
        if result.status != S.EXECUTION_STATUS_POLICY_DENIED:
            raise RuntimeError(f"the quiet call was not refused by the deny rule: {result.error}")
        return elapsed

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return str(urllib.request.urlopen(url, timeout=10).read().decode())

    def close(self) -> int:
        for channel in self.channels:
            channel.close()
        return self.server.stop()


def deploy(base: Path, env: Mapping[str, str] | None = None) -> Deployment:
    """A `toolreg serve` process with the policy and the three tools registered
    by the registrant; its metrics on a port of its own, no warm pool."""
    policy = base / "policy.yaml"
    write_policy(policy)
    settings = {"TOOLREG_METRICS_PORT": "0", "TOOLREG_MAX_WARM": "0", **(env or {})}
    server = spawn_server(base / "data", "--policy", str(policy), env={**os.environ, **settings})
    try:
        port = next(int(m.group(1)) for line in server.log if (m := METRICS_LINE.search(line)))
        deployed = Deployment(server, port, tools())
        for tool in deployed.tools.values():
            deployed.stub("registrant").RegisterTool(
                pb.RegisterToolRequest(tool=convert.tool_to_pb(tool))
            )
    except BaseException:
        server.kill()
        raise
    return deployed


class Load:
    """HEAVY_CLIENTS threads, each a client calling ``tool`` in a loop with
    the same large arguments, one call at a time; ``outcomes`` counts
    "refused" (by the expected guard) and anything else by its text."""

    def __init__(self, deployed: Deployment, tool: ToolDefinition, arguments: str) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self._expected = tool.guards[-1].message
        request = pb.ExecuteToolRequest(name=tool.name, arguments_json=arguments)
        self._threads = [
            threading.Thread(
                target=self._loop, args=(deployed.stub(f"heavy{n}"), request), daemon=True
            )
            for n in range(HEAVY_CLIENTS)
        ]

    def _loop(self, stub: pb_grpc.ToolRegistryStub, request: pb.ExecuteToolRequest) -> None:
        while not self._stop.is_set():
            try:
                result = stub.ExecuteTool(request, timeout=60)
                refused = result.status == S.EXECUTION_STATUS_INVALID_ARGUMENTS
                outcome = "refused" if refused and self._expected in result.error else result.error
            except grpc.RpcError as err:
                outcome = err.code().name
            with self._lock:
                self.outcomes[outcome] += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        time.sleep(LOAD_SETTLE_S)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


@dataclass
class Measured:
    quiet_ms: dict[str, list[float]]  # phase -> the quiet call's samples
    heavy: dict[str, Counter[str]]  # load -> its calls' outcomes

    def p50(self, phase: str) -> float:
        return statistics.median(self.quiet_ms[phase])

    @property
    def one_over_idle(self) -> float:
        return self.p50(ONE) / self.p50(IDLE)

    @property
    def sixteen_over_one(self) -> float:
        return self.p50(SIXTEEN) / self.p50(ONE)


def measure(deployed: Deployment, rounds: int, samples: int) -> Measured:
    """Idle, then each load, ``rounds`` times; ``samples`` quiet calls a phase."""
    arguments = refusing_arguments(deployed.tools[SIXTEEN])
    for load in (ONE, SIXTEEN):  # the worker processes start on the first heavy call
        result = deployed.stub("heavy0").ExecuteTool(
            pb.ExecuteToolRequest(name=TOOLS[load], arguments_json=arguments), timeout=60
        )
        if result.status != S.EXECUTION_STATUS_INVALID_ARGUMENTS:
            raise RuntimeError(f"{load}: the guard did not refuse: {result.error}")
    for _ in range(5):
        deployed.quiet_ms()

    def sample() -> list[float]:
        values = []
        for _ in range(samples):
            values.append(deployed.quiet_ms())
            time.sleep(SAMPLE_GAP_S)
        return values

    got = Measured({IDLE: [], ONE: [], SIXTEEN: []}, {ONE: Counter(), SIXTEEN: Counter()})
    for _ in range(rounds):
        got.quiet_ms[IDLE] += sample()
        for load in (ONE, SIXTEEN):
            with Load(deployed, deployed.tools[load], arguments) as running:
                got.quiet_ms[load] += sample()
            got.heavy[load].update(running.outcomes)
    return got


def run(rounds: int, samples: int = 24) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="toolreg-bench-cpu-"))
    deployed = deploy(base)
    try:
        got = measure(deployed, rounds, samples)
    finally:
        deployed.close()
    return {
        "rounds": rounds,
        "samples": samples,
        "rows": [{"what": phase, **summary(values)} for phase, values in got.quiet_ms.items()],
        "one_over_idle": round(got.one_over_idle, 2),
        "sixteen_over_one": round(got.sixteen_over_one, 2),
        "heavy_calls": {load: dict(c) for load, c in got.heavy.items()},
    }


def report_md(sec: dict[str, Any]) -> list[str]:
    heading = (
        f"Large arguments share the CPU ({sec['rounds']} rounds of {sec['samples']} quiet"
        " calls a phase)"
    )
    lines = summary_table(heading, "quiet call (deny rule), server", sec["rows"])
    lines += [
        "",
        f"Six clients send 1 MiB arguments to a guard-refused tool. One-guard load / idle,"
        f" p50: **{sec['one_over_idle']}x** (target <= {IDLE_TARGET:g}x); sixteen guards'"
        f" load / one guard's: **{sec['sixteen_over_one']}x** (target <= {GUARDS_TARGET:g}x)."
        f" Heavy calls meanwhile: {sec['heavy_calls']}.",
    ]
    return lines

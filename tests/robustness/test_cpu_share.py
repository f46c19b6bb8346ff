"""Large arguments share the server's CPU (issue 37, item 5): six clients
sending 1 MiB arguments to a tool whose guards refuse them do not starve a
seventh client's cheap call, and guards as costly as the caps allow cost
that client little more than one cheap guard does.

A real `toolreg serve` process (its own interpreter: the clients' threads
here never take its lock) with a real policy and bearer credentials: a
registrant holding only the register role, six executing clients and a
quiet one. The quiet client's call is refused by a deny rule (no container),
the heavy clients' calls by a guard (no container either). Phases alternate
in one run, idle / one-guard load / sixteen-guard load, round after round,
so the machine's noise falls on all three; medians of many samples."""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bench.worst_guards import worst_arguments, worst_tool
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.wire import convert
from tests.factories import sha

pytestmark = pytest.mark.load

HEAVY_CLIENTS = 6
ROUNDS = 5  # idle, one-guard and sixteen-guard phases, each once a round
SAMPLES = 24  # quiet calls a phase
SAMPLE_GAP_S = 0.02  # between two quiet calls
LOAD_SETTLE_S = 0.4  # seconds the load runs before a phase's first sample
IDLE_RATIO_MAX = 10.0  # the quiet call under the one-guard load / idle, at p50 (the issue)
GUARDS_RATIO_MAX = 1.5  # the quiet call under sixteen guards' load / one guard's, at p50
ARGUMENTS_BYTES = 1024 * 1024 - 256  # each heavy call's arguments JSON, at most
S = pb.ExecutionStatus
METRICS_LINE = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")
ONE_GUARD_MESSAGE = "the cheap guard refused the call"


def token(who: str) -> str:
    return f"{who}-cpu-share-secret"


def write_policy(path: Path) -> None:
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


def cheap_guard_tool() -> ToolDefinition:
    """One guard, refusing every non-empty q at no cost (a length check)."""
    return parse_definition({
        "name": "one_guard", "description": "one cheap guard",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        "guard": [{"condition": 'args.q == ""', "message": ONE_GUARD_MESSAGE}],
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    })  # fmt: skip


def refusing_text(tool: ToolDefinition) -> str:
    """Arguments on which every guard of the costliest set scans all of its
    text and holds but the last, which then refuses (so nothing ever runs):
    the worst arguments, ended by what the last guard looks for."""
    last = tool.guards[-1].condition
    literal = last.split('("', 1)[1].rsplit('")', 1)[0]
    needle = literal if ".contains(" in last else literal[-1]
    text = worst_arguments(ARGUMENTS_BYTES - 64)["q"] + needle
    arguments = json.dumps({"q": text}, ensure_ascii=False)
    assert len(arguments.encode()) <= ARGUMENTS_BYTES
    return arguments


@dataclass
class Deployment:
    server: ServerProcess
    metrics_port: int
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
        assert result.status == S.EXECUTION_STATUS_POLICY_DENIED, result.error
        return elapsed

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return str(urllib.request.urlopen(url, timeout=10).read().decode())


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    policy = tmp_path / "policy.yaml"
    write_policy(policy)
    # The defaults under test; a port of its own for the metrics, no warm pool.
    env = {"TOOLREG_METRICS_PORT": "0", "TOOLREG_MAX_WARM": "0"}
    server = spawn_server(tmp_path / "data", "--policy", str(policy), env={**os.environ, **env})
    try:
        port = next(int(m.group(1)) for line in server.log if (m := METRICS_LINE.search(line)))
        deployed = Deployment(server, port)
        for tool in (
            cheap_guard_tool(),
            worst_tool("sixteen_guards"),
            parse_definition({
                "name": "denied", "description": "refused by the policy's deny rule",
                "parameters": {"type": "object"},
                "sandbox": {"image": "toolreg/base", "command": ["cat"]},
            }),
        ):  # fmt: skip
            deployed.stub("registrant").RegisterTool(
                pb.RegisterToolRequest(tool=convert.tool_to_pb(tool))
            )
        yield deployed
        for channel in deployed.channels:
            channel.close()
    finally:
        assert server.stop() == 0, "".join(server.log[-20:])


class Load:
    """HEAVY_CLIENTS threads, each a client calling ``tool`` in a loop with
    the same large arguments, one call at a time."""

    def __init__(self, deployed: Deployment, tool: str, arguments: str, message: str) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self._expected = message
        self._threads = [
            threading.Thread(
                target=self._loop, args=(deployed.stub(f"heavy{n}"), tool, arguments), daemon=True
            )
            for n in range(HEAVY_CLIENTS)
        ]

    def _loop(self, stub: pb_grpc.ToolRegistryStub, tool: str, arguments: str) -> None:
        request = pb.ExecuteToolRequest(name=tool, arguments_json=arguments)
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


def sample(deployed: Deployment) -> list[float]:
    values = []
    for _ in range(SAMPLES):
        values.append(deployed.quiet_ms())
        time.sleep(SAMPLE_GAP_S)
    return values


def test_large_arguments_do_not_starve_another_client(deployment: Deployment) -> None:
    sixteen = worst_tool("sixteen_guards")
    assert len(sixteen.guards) == 16
    arguments = refusing_text(sixteen)
    loads = {
        "one guard": ("one_guard", ONE_GUARD_MESSAGE),
        "sixteen guards": ("sixteen_guards", sixteen.guards[-1].message),
    }
    # Warm: the worker processes start on the first heavy call.
    for tool, message in loads.values():
        result = deployment.stub("heavy0").ExecuteTool(
            pb.ExecuteToolRequest(name=tool, arguments_json=arguments), timeout=60
        )
        assert result.status == S.EXECUTION_STATUS_INVALID_ARGUMENTS and message in result.error
    for _ in range(5):
        deployment.quiet_ms()
    quiet: dict[str, list[float]] = {"idle": [], **{name: [] for name in loads}}
    heavy_calls: dict[str, Counter[str]] = {name: Counter() for name in loads}
    for _ in range(ROUNDS):
        quiet["idle"] += sample(deployment)
        for name, (tool, message) in loads.items():
            with Load(deployment, tool, arguments, message) as load:
                quiet[name] += sample(deployment)
            heavy_calls[name].update(load.outcomes)
    p50 = {name: statistics.median(values) for name, values in quiet.items()}
    one, worst = p50["one guard"] / p50["idle"], p50["sixteen guards"] / p50["one guard"]
    print(
        f"\nquiet call p50 (ms): idle {p50['idle']:.2f}, one-guard load {p50['one guard']:.2f}"
        f" ({one:.2f}x idle), sixteen-guard load {p50['sixteen guards']:.2f}"
        f" ({worst:.2f}x the one-guard load); heavy calls {dict(heavy_calls)}"
    )
    # The loads ran, and every heavy call was refused by its guard (nothing else).
    for name, outcomes in heavy_calls.items():
        assert set(outcomes) == {"refused"}, (name, outcomes)
        assert outcomes["refused"] >= ROUNDS * HEAVY_CLIENTS, (name, outcomes)
    assert one <= IDLE_RATIO_MAX, p50
    assert worst <= GUARDS_RATIO_MAX, p50
    metrics = deployment.metrics()
    waited = re.search(r"^toolreg_heavy_wait_seconds_count (\S+)$", metrics, re.M)
    assert waited is not None and float(waited.group(1)) >= sum(
        c["refused"] for c in heavy_calls.values()
    )
    assert "toolreg_heavy_calls_working 0.0" in metrics
    assert "toolreg_heavy_calls_waiting 0.0" in metrics


def test_a_client_past_its_share_of_waiting_is_refused_with_a_time_to_retry(
    deployment: Deployment,
) -> None:
    arguments = refusing_text(worst_tool("sixteen_guards"))
    stub = deployment.stub("heavy0")
    request = pb.ExecuteToolRequest(name="sixteen_guards", arguments_json=arguments)
    stub.ExecuteTool(request, timeout=60)  # the workers are started
    # One call at its turn, two waiting (the default per-client share), the rest refused.
    futures = [stub.ExecuteTool.future(request, timeout=60) for _ in range(8)]
    refused = []
    for future in futures:
        try:
            future.result()
        except grpc.RpcError as err:
            refused.append(err)
    assert refused, "no call of the eight was refused"
    err = refused[0]
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "heavy_queue_per_client" in str(err.details())
    status = rpc_status.from_call(err)
    assert status is not None
    failure, retry = error_details_pb2.QuotaFailure(), error_details_pb2.RetryInfo()
    kinds = [d.Unpack(failure) or d.Unpack(retry) for d in status.details]
    assert all(kinds) and failure.violations[0].subject == "client:heavy0"
    assert retry.retry_delay.seconds == 1
    # Another client is not refused: its own share.
    other = deployment.stub("heavy1").ExecuteTool(request, timeout=60)
    assert other.status == S.EXECUTION_STATUS_INVALID_ARGUMENTS
    metrics = deployment.metrics()
    assert re.search(r'^toolreg_heavy_calls_refused_total\{reason="client_queue"\} [1-9]', metrics,
                     re.M), metrics  # fmt: skip
    assert re.search(
        r'^toolreg_client_refused_calls_total\{client="heavy0",limit="heavy_queue_per_client"\}'
        r" [1-9]", metrics, re.M,
    )  # fmt: skip

"""Large arguments share the server's CPU (issue 37, item 5): six clients
sending 1 MiB arguments to a tool whose guards refuse them do not starve a
seventh client's cheap call, and guards as costly as the caps allow cost
that client little more than one cheap guard does.

A real `toolreg serve` process (its own interpreter: the clients' threads
here never take its lock) with a real policy and bearer credentials: a
registrant holding only the register role, six executing clients and a
quiet one (bench/cpu_share.py, which `make bench` runs too). The quiet
client's call is refused by a deny rule, the heavy clients' calls by a
guard: no container ever starts. Phases alternate in one run, idle /
one-guard load / sixteen-guard load, round after round, so the machine's
noise falls on all three; medians of many samples."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bench.cpu_share import (
    GUARDS_TARGET,
    HEAVY_CLIENTS,
    IDLE,
    IDLE_TARGET,
    ONE,
    SIXTEEN,
    TOOLS,
    Deployment,
    deploy,
    measure,
    refusing_arguments,
)
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

pytestmark = pytest.mark.load

ROUNDS = 5  # idle, one-guard and sixteen-guard phases, each once a round
SAMPLES = 24  # quiet calls a phase


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployed = deploy(tmp_path)  # the server's defaults: the ones under test
    try:
        yield deployed
    finally:
        assert deployed.close() == 0, "".join(deployed.server.log[-20:])


def test_large_arguments_do_not_starve_another_client(deployment: Deployment) -> None:
    assert len(deployment.tools[SIXTEEN].guards) == 16
    got = measure(deployment, ROUNDS, SAMPLES)
    print(
        f"\nquiet call p50 (ms): idle {got.p50(IDLE):.2f}, one-guard load {got.p50(ONE):.2f}"
        f" ({got.one_over_idle:.2f}x idle), sixteen-guard load {got.p50(SIXTEEN):.2f}"
        f" ({got.sixteen_over_one:.2f}x the one-guard load); heavy calls {got.heavy}"
    )
    # The loads ran, and every heavy call was refused by its guard (nothing else).
    for load, outcomes in got.heavy.items():
        assert set(outcomes) == {"refused"}, (load, outcomes)
        assert outcomes["refused"] >= ROUNDS * HEAVY_CLIENTS, (load, outcomes)
    assert got.one_over_idle <= IDLE_TARGET, got.quiet_ms
    assert got.sixteen_over_one <= GUARDS_TARGET, got.quiet_ms
    metrics = deployment.metrics()
    waited = re.search(r"^toolreg_heavy_wait_seconds_count (\S+)$", metrics, re.M)
    heavy_calls = sum(c["refused"] for c in got.heavy.values())
    assert waited is not None and float(waited.group(1)) >= heavy_calls
    assert "toolreg_heavy_calls_working 0.0" in metrics
    assert "toolreg_heavy_calls_waiting 0.0" in metrics


def test_a_client_past_its_share_of_waiting_is_refused_with_a_time_to_retry(
    deployment: Deployment,
) -> None:
    arguments = refusing_arguments(deployment.tools[SIXTEEN])
    request = pb.ExecuteToolRequest(name=TOOLS[SIXTEEN], arguments_json=arguments)
    stub = deployment.stub("heavy0")
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
    # Another client is not refused: its share is its own.
    other = deployment.stub("heavy1").ExecuteTool(request, timeout=60)
    assert other.status == pb.ExecutionStatus.EXECUTION_STATUS_INVALID_ARGUMENTS
    metrics = deployment.metrics()
    assert re.search(
        r'^toolreg_heavy_calls_refused_total\{reason="client_queue"\} [1-9]', metrics, re.M
    ), metrics
    assert re.search(
        r'^toolreg_client_refused_calls_total\{client="heavy0",limit="heavy_queue_per_client"\}'
        r" [1-9]", metrics, re.M,
    )  # fmt: skip

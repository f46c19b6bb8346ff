"""gVisor: the runtimes of dangerous tools, runsc (no network) and runsc-net (for tools
with egress: gVisor's netstack, or hostinet where this runsc's netstack cannot start;
tests/gvisor_netstack.py). `make test` registers both, so nothing here skips: an engine
without them fails, naming the fix."""

from __future__ import annotations

import time
from collections.abc import Callable

import docker
import pytest

from sandbox_runner import CAUTIOUS_LIMITS, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.profiles import GVISOR, GVISOR_NET, gvisor_network
from tests.gvisor_netstack import runsc_net_mode

Eid = Callable[[], str]
SpecFactory = Callable[..., SandboxSpec]


@pytest.fixture
def gvisor(make_spec: SpecFactory) -> SpecFactory:
    return lambda script, **kw: make_spec(script, runtime=GVISOR, limits=CAUTIOUS_LIMITS, **kw)


def test_engine_offers_both_gvisor_runtimes(
    runner: DockerBackend, docker_client: docker.DockerClient
) -> None:
    """With the arguments the server reads: runsc without a network, runsc-net
    with the mode its sandboxes start with here."""
    runtimes = runner.runtimes()
    assert {GVISOR, GVISOR_NET} <= runtimes.keys()
    assert gvisor_network(runtimes[GVISOR]) == "none"
    assert gvisor_network(runtimes[GVISOR_NET]) == runsc_net_mode(docker_client)


def test_runsc_round_trip(runner: DockerBackend, gvisor: SpecFactory, eid: Eid) -> None:
    res = runner.run(gvisor("cat; echo err >&2; exit 4", input=b"via gvisor"), execution_id=eid())
    assert (res.exit_code, res.stdout, res.stderr) == (4, b"via gvisor", b"err\n")


@pytest.mark.parametrize("runtime", [GVISOR, GVISOR_NET])
def test_gvisor_is_really_gvisor_and_locked_down(
    runner: DockerBackend,
    make_spec: SpecFactory,
    eid: Eid,
    runtime: str,
    docker_client: docker.DockerClient,
) -> None:
    """runsc-net too, in either network mode: without a call's egress network
    (network_mode none) it has nothing but lo; the pids limit it would refuse is
    left out."""
    if runtime == GVISOR_NET:
        runsc_net_mode(docker_client)  # it starts here at all, or the test fails saying why
    script = "dmesg | head -1; id -u; grep CapEff /proc/self/status; cat /proc/net/dev"
    res = runner.run(make_spec(script, runtime=runtime, limits=CAUTIOUS_LIMITS), execution_id=eid())
    out = res.stdout.decode()
    assert res.exit_code == 0, res.stderr
    assert "gVisor" in out.splitlines()[0]
    assert "\n65534\n" in out
    assert "CapEff:\t0000000000000000" in out
    devs = [ln.split(":")[0].strip() for ln in out.split("face |", 1)[1].splitlines()[1:]]
    assert devs == ["lo"]


def test_runsc_timeout(runner: DockerBackend, gvisor: SpecFactory, eid: Eid) -> None:
    start = time.monotonic()
    res = runner.run(gvisor("trap '' TERM; sleep 60", timeout_ms=1500), execution_id=eid())
    assert res.timed_out
    assert time.monotonic() - start < 1.5 + 3.0


def test_runsc_memory_bomb(runner: DockerBackend, gvisor: SpecFactory, eid: Eid) -> None:
    res = runner.run(
        gvisor("dd if=/dev/zero of=/dev/null bs=256M count=1", memory_mb=64), execution_id=eid()
    )
    assert res.oom_killed and res.exit_code == 137


def test_runsc_output_flood(runner: DockerBackend, gvisor: SpecFactory, eid: Eid) -> None:
    res = runner.run(gvisor("yes", output_bytes=32 * 1024), execution_id=eid())
    assert res.output_truncated and len(res.stdout) == 32 * 1024


def test_runsc_tmpfs_cap_and_read_only_root(
    runner: DockerBackend, gvisor: SpecFactory, eid: Eid
) -> None:
    res = runner.run(
        gvisor(
            "cat /proc/mounts >&2; dd if=/dev/zero of=/tmp/f bs=1M count=32 2>/dev/null;"
            " wc -c < /tmp/f",
            tmpfs_mb=4,
        ),
        execution_id=eid(),
    )
    # As uid 65534 gVisor answers EACCES before EROFS, so check the mount itself.
    root = [ln.split() for ln in res.stderr.decode().splitlines() if ln.split()[1:2] == ["/"]]
    assert "ro" in root[-1][3].split(",")
    assert int(res.stdout) <= 4 * 1024 * 1024

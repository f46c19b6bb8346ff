"""Which network this engine's runsc-net gives a sandbox, for the real-engine tests
of dangerous tools with egress: gVisor's netstack (--network=sandbox) or hostinet
(--network=host), read from the runtimeArgs `docker info` reports, as the server
reads them (sandbox_runner.profiles.gvisor_network).

`make test` sets the engine up first (scripts/ensure_docker.sh): it registers
runsc-net, with hostinet where this runsc's netstack cannot start (Debian's runsc
before gVisor's release-20240801 on a kernel such as 6.18, see
sandbox_runner/docker_backend.py: NETSTACK_UNSUPPORTED). So an engine without a
runsc-net that starts fails these tests, naming the fix, instead of skipping them.
The answer is checked once per session by starting one container as a call's."""

from __future__ import annotations

import uuid

import docker
import docker.errors
import pytest

from sandbox_runner.docker_backend import runtimes_of
from sandbox_runner.profiles import GVISOR_NET, HOSTINET, NETSTACK, gvisor_network

FIX = (
    "run scripts/ensure_docker.sh as root (make test does), docs/how-to/deploying.md 1. The engine"
)
_modes: dict[str, str] = {}  # engine base URL -> runsc-net's mode, once it started


def runsc_net_mode(engine: docker.DockerClient) -> str:
    """NETSTACK or HOSTINET: the mode this engine's runsc-net runs a call's
    sandbox with, once one container started under it on an internal network
    of its own, as a call's. Fails the calling test, naming the fix, when the
    engine has no runsc-net or its sandbox cannot start."""
    key = engine.api.base_url
    if key not in _modes:
        _modes[key] = _probe(engine)
    return _modes[key]


def _probe(engine: docker.DockerClient) -> str:
    args = runtimes_of(engine.info()).get(GVISOR_NET)
    if args is None:
        pytest.fail(f"this engine has no {GVISOR_NET} runtime: {FIX}")
    mode = gvisor_network(args)
    if mode not in (NETSTACK, HOSTINET):
        pytest.fail(f"this engine's {GVISOR_NET} runs with {args}, no network: {FIX}")
    name = f"toolreg-runsc-net-probe-{uuid.uuid4().hex[:12]}"
    engine.api.create_network(name, driver="bridge", internal=True)
    try:
        created = engine.api.create_container(
            "toolreg/base", ["sh", "-c", "true"], name=name,
            host_config=engine.api.create_host_config(runtime=GVISOR_NET, network_mode=name),
        )  # fmt: skip
        try:
            engine.api.start(created["Id"])
        except docker.errors.APIError as exc:
            pytest.fail(f"this engine's {GVISOR_NET} ({mode}) cannot start a sandbox: {exc}; {FIX}")
        finally:
            engine.api.remove_container(created["Id"], force=True)
    finally:
        engine.api.remove_network(name)
    return mode

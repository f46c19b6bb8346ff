"""Whether this engine's runsc-net can give a sandbox gVisor's own network stack.

Some runsc builds (Debian's 20221219 and 20240729) refuse to start any networked
sandbox on kernels where every network namespace has net.core.rmem_default (6.18 here):
they take the container's namespace for the host's (sandbox_runner/docker_backend.py:
NETSTACK_UNSUPPORTED). The tests of runsc-net with a network skip there, naming that
reason; any other failure of the probe fails them."""

from __future__ import annotations

import uuid

import docker
import docker.errors

from sandbox_runner.docker_backend import NETSTACK_UNSUPPORTED
from sandbox_runner.profiles import GVISOR_NET

_problems: dict[str, str | None] = {}  # engine base URL -> what the probe found


def netstack_problem(engine: docker.DockerClient) -> str | None:
    """Why runsc-net cannot network here (None: it can). One container of the
    busybox image started on an internal network of its own, as a call's; the
    answer is kept for the session."""
    key = engine.api.base_url
    if key not in _problems:
        _problems[key] = _probe(engine)
    return _problems[key]


def _probe(engine: docker.DockerClient) -> str | None:
    name = f"toolreg-netstack-probe-{uuid.uuid4().hex[:12]}"
    engine.api.create_network(name, driver="bridge", internal=True)
    try:
        created = engine.api.create_container(
            "toolreg/base", ["sh", "-c", "true"], name=name,
            host_config=engine.api.create_host_config(runtime=GVISOR_NET, network_mode=name),
        )  # fmt: skip
        try:
            engine.api.start(created["Id"])
        except docker.errors.APIError as exc:
            if NETSTACK_UNSUPPORTED not in str(exc):
                raise
            return str(exc.explanation)
        finally:
            engine.api.remove_container(created["Id"], force=True)
    finally:
        engine.api.remove_network(name)
    return None

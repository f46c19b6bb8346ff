"""runsc-net's network mode as the server sees it: the setting that refuses
hostinet (TOOLREG_GVISOR_HOSTINET), what the start-up log says about the
engine's runsc-net, and the size of the egress network pool. The calls
themselves: tests/unit/test_executor.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pydantic
import pytest

from registry_server.api.app import _start_sandboxes, open_backend
from registry_server.api.config import ServerConfig
from tests.unit.fakes import FakeBackend

GVISOR_ALL = frozenset({"runc", "runsc", "runsc-net"})


def test_the_setting_allows_hostinet_by_default_and_takes_refuse_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ServerConfig().gvisor_hostinet == "allow"
    monkeypatch.setenv("TOOLREG_GVISOR_HOSTINET", "refuse")
    assert ServerConfig().gvisor_hostinet == "refuse"
    monkeypatch.setenv("TOOLREG_GVISOR_HOSTINET", "maybe")
    with pytest.raises(pydantic.ValidationError, match="gvisor_hostinet"):
        ServerConfig()


@pytest.mark.parametrize(
    ("runtimes", "args", "setting", "level", "says"),
    [
        (GVISOR_ALL, ("--network=sandbox",), "allow", logging.INFO,
         "dangerous tools with egress run under gVisor (runsc-net) with its own network"
         " stack (netstack)"),
        (GVISOR_ALL, ("--network=sandbox",), "refuse", logging.INFO, "(netstack)"),
        (GVISOR_ALL, ("--network=host",), "allow", logging.WARNING,
         "dangerous tools with egress run under gVisor (runsc-net) with hostinet, not gVisor's"
         " netstack: their socket calls reach the host kernel's network stack"),
        (GVISOR_ALL, ("--network=host",), "refuse", logging.WARNING,
         "dangerous tools with egress will be refused: runsc-net, which this engine runs with"
         " hostinet"),
        (frozenset({"runc", "runsc"}), (), "allow", logging.WARNING,
         "dangerous tools with egress will be refused: runsc-net, which this engine lacks"),
    ],
    ids=["netstack", "netstack-refuse", "hostinet", "hostinet-refused", "no-runsc-net"],
)  # fmt: skip
def test_the_start_up_log_says_which_network_runsc_net_gives(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    runtimes: frozenset[str],
    args: tuple[str, ...],
    setting: str,
    level: int,
    says: str,
) -> None:
    backend = FakeBackend(runtimes=runtimes)
    backend.runtime_args["runsc-net"] = args
    config = ServerConfig(data_dir=tmp_path, gvisor_hostinet=setting, reap_on_start=False)
    with caplog.at_level(logging.INFO, logger="registry_server.api.app"):
        _start_sandboxes(config, backend, require_gvisor=True)
    [line] = [r for r in caplog.records if "dangerous tools with egress" in r.getMessage()]
    assert says in line.getMessage() and line.levelno == level


def test_the_egress_network_pool_size_comes_from_the_environment_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TOOLREG_EGRESS_NETWORK_POOL reaches the backend's pool (no engine is asked:
    the pool starts on the first egress call); out of 0..32 it is refused by name."""
    assert ServerConfig().egress_network_pool == 3
    monkeypatch.setenv("TOOLREG_EGRESS_NETWORK_POOL", "5")
    config = ServerConfig(data_dir=tmp_path, docker_url=f"unix://{tmp_path}/no-engine.sock")
    backend = open_backend(config)
    assert backend._egress is not None and backend._egress.networks.size == 5  # type: ignore[attr-defined]
    for bad in ("-1", "33"):
        monkeypatch.setenv("TOOLREG_EGRESS_NETWORK_POOL", bad)
        with pytest.raises(pydantic.ValidationError, match="egress_network_pool"):
            ServerConfig()

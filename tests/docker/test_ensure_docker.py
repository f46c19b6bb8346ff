"""scripts/ensure_docker.sh: the engine set-up that `make run` and `make test`
run first. merge_daemon_json registers both gVisor runtimes (runsc without a
network, runsc-net with gVisor's netstack, or hostinet where a probe finds
that this runsc's netstack cannot start) and keeps everything else in
daemon.json; an engine already running that this script set up gains
runsc-net, or has its mode switched when the probe now picks the other one,
with a reload (SIGHUP); any other engine is left alone.

The engine here is a fake: a `docker` command on PATH that reports the
runtimes a fake `dockerd` process loaded, which reloads daemon.json on SIGHUP
as dockerd does, and a fake `runsc` that says the version a test gives it.
Nothing touches this machine's real engine or its files: every path the
script writes or signals through is the test's own (checked by
``untouched_host``).

In the docker tier, not the unit tier: each test runs the script with fake
docker, dockerd and runsc programs, dozens of processes, seconds each.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox_runner.profiles import GVISOR, GVISOR_NET

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ensure_docker.sh"
RUNSC = "/usr/bin/runsc"
OURS = {
    GVISOR: {"path": RUNSC, "runtimeArgs": ["--network=none"]},
    GVISOR_NET: {"path": RUNSC, "runtimeArgs": ["--network=sandbox"]},
}
DEBIAN_RUNSC = "0.0~20221219.0"  # Debian 12's runsc: its netstack check predates the fix
FIXED_RUNSC = "release-20240807.0"  # a gVisor release after release-20240801
REAL_DAEMON_JSON = Path("/etc/docker/daemon.json")
REAL_DOCKER_PIDFILE = Path("/var/run/docker.pid")

FAKE_START_S = 30  # seconds for the fake dockerd (a bash script) to start, on a busy machine


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.fixture(autouse=True)
def untouched_host() -> Iterator[None]:
    """This machine's daemon.json and dockerd are the same after every test."""
    before = (_digest(REAL_DAEMON_JSON), _digest(REAL_DOCKER_PIDFILE))
    yield
    assert (_digest(REAL_DAEMON_JSON), _digest(REAL_DOCKER_PIDFILE)) == before


def sourced(
    call: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``call`` (a shell snippet, arguments as $2...) run with the script's
    functions defined. Sourced, the script only defines them: $0 is not the
    script's path, so its main never runs against this machine's engine."""
    return subprocess.run(
        ["bash", "-c", f'source "$1" && {call}', "bash", str(SCRIPT), *args],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip


def merge(path: Path, runsc: str = RUNSC, *network: str) -> subprocess.CompletedProcess[str]:
    return sourced('merge_daemon_json "${@:2}"', str(path), runsc, *network)


def test_a_new_file_gets_both_gvisor_runtimes(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "docker" / "daemon.json"
    first = merge(path)
    assert (first.returncode, first.stdout) == (0, "changed\n"), first.stderr
    assert json.loads(path.read_text()) == {"runtimes": OURS}
    again = merge(path)
    assert (again.returncode, again.stdout) == (0, "unchanged\n")


def test_merging_keeps_every_other_key_and_runtime(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    theirs = {
        "log-level": "warn",
        "default-address-pools": [{"base": "10.99.0.0/16", "size": 24}],
        "runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}},
    }
    path.write_text(json.dumps(theirs))
    assert merge(path).stdout == "changed\n"
    merged = json.loads(path.read_text())
    assert merged == {**theirs, "runtimes": {**theirs["runtimes"], **OURS}}


def test_an_engine_set_up_before_runsc_net_gains_it_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps({"debug": True, "runtimes": {GVISOR: OURS[GVISOR]}}))
    assert merge(path).stdout == "changed\n"
    assert json.loads(path.read_text()) == {"debug": True, "runtimes": OURS}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"runtimes": []}'])
def test_a_file_it_cannot_read_as_an_object_is_left_as_it_is(tmp_path: Path, text: str) -> None:
    path = tmp_path / "daemon.json"
    path.write_text(text)
    refused = merge(path)
    assert refused.returncode != 0 and "fix it by hand" in refused.stdout + refused.stderr
    assert path.read_text() == text


def test_hostinet_is_written_only_when_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    assert merge(path, RUNSC, "host").stdout == "changed\n"
    host = {GVISOR: OURS[GVISOR], GVISOR_NET: {"path": RUNSC, "runtimeArgs": ["--network=host"]}}
    assert json.loads(path.read_text()) == {"runtimes": host}
    assert merge(path, RUNSC, "host").stdout == "unchanged\n"
    assert merge(path).stdout == "changed\n"  # the default: the netstack again
    assert json.loads(path.read_text()) == {"runtimes": OURS}
    refused = merge(path, RUNSC, "none")
    assert refused.returncode != 0 and json.loads(path.read_text()) == {"runtimes": OURS}


@pytest.mark.parametrize(
    ("version", "rmem", "network"),
    [
        (DEBIAN_RUNSC, "yes", "host"),  # this machine: Debian's runsc on 6.18
        ("0.0~20240729.0", "yes", "host"),  # Debian 13's: the same check
        (DEBIAN_RUNSC, "no", "sandbox"),  # an older kernel: its netstack starts
        (FIXED_RUNSC, "yes", "sandbox"),  # fixed: the netstack wherever
        ("release-20240801.0", "yes", "sandbox"),
        ("VERSION_MISSING", "yes", "sandbox"),  # a build that names no release: the netstack
    ],
)
def test_runsc_net_gets_hostinet_only_where_the_netstack_cannot_start(
    tmp_path: Path, version: str, rmem: str, network: str
) -> None:
    runsc = fake_runsc(tmp_path)
    env = {**os.environ, "FAKE_RUNSC_VERSION": version, "TOOLREG_NETNS_RMEM": rmem}
    picked = sourced(
        'pick_runsc_net_network "$2"; echo "$RUNSC_NET_NETWORK"; echo "$RUNSC_NET_WHY"',
        str(runsc), env=env,
    )  # fmt: skip
    assert picked.returncode == 0, picked.stderr
    chosen, why = picked.stdout.splitlines()
    assert chosen == network
    if network == "host":  # one warning line: the reason and the fix
        assert why.startswith(f"WARNING: {GVISOR_NET} uses hostinet (--network=host)")
        assert "rmem_default" in why and "release-20240801 or later" in why
    else:
        assert why.startswith(f"{GVISOR_NET}: gVisor's netstack (--network=sandbox)")


def test_the_netns_probe_answers_yes_or_no_as_root() -> None:
    """Without the override, a fresh network namespace is made and looked into."""
    if os.geteuid() != 0:
        pytest.skip("unshare -n needs root")
    env = {k: v for k, v in os.environ.items() if k != "TOOLREG_NETNS_RMEM"}
    probed = sourced("fresh_netns_has_rmem_default", env=env)
    assert probed.stdout in ("yes\n", "no\n"), probed.stderr


def test_the_script_and_the_server_name_the_same_runtimes() -> None:
    text = SCRIPT.read_text()
    assert f"GVISOR_RUNTIME={GVISOR}\n" in text
    assert f"GVISOR_NET_RUNTIME={GVISOR_NET}\n" in text


# ---------------------------------------------------------------- a running engine

FAKE_RUNSC = """#!/bin/sh
# Says the version the test gives it; nothing else is ever asked of it here.
[ "$1" = --version ] && echo "runsc version $FAKE_RUNSC_VERSION" && echo "spec: 1.0.2-dev"
"""


def fake_runsc(where: Path) -> Path:
    runsc = where / "runsc"  # owned_entries wants an executable
    runsc.write_text(FAKE_RUNSC)
    runsc.chmod(0o755)
    return runsc


FAKE_DOCKER = """#!/bin/bash
# `docker info` / `docker version` of a fake engine: the runtimes its dockerd loaded.
case "$1" in
    info) [[ "$*" == *Runtimes* ]] && cat "$FAKE_STATE/loaded.json"; exit 0 ;;
    version) echo 20.10.0-fake ;;
esac
"""
# Named dockerd, so /proc/PID/comm says so; loads daemon.json's runtimes at start
# and again on SIGHUP, as dockerd does.
FAKE_DOCKERD = """#!/bin/bash
load() {
    python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1])).get("runtimes", {}),
                open(sys.argv[2], "w"))' "$FAKE_JSON" "$FAKE_STATE/loaded.json"
}
trap 'load; echo reload >> "$FAKE_STATE/hups"' HUP
load
echo started > "$FAKE_STATE/started"
while :; do sleep 0.05; done
"""


@dataclass
class Engine:
    json_path: Path
    state: Path
    env: dict[str, str]

    def run(
        self, runsc_version: str = FIXED_RUNSC, rmem: str = "yes"
    ) -> subprocess.CompletedProcess[str]:
        """The script as `make test` runs it, its runsc saying ``runsc_version``
        and a fresh network namespace having rmem_default (``rmem``) or not."""
        env = {**self.env, "FAKE_RUNSC_VERSION": runsc_version, "TOOLREG_NETNS_RMEM": rmem}
        return subprocess.run(
            ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
        )

    def config(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.json_path.read_text())
        return data

    def loaded(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state / "loaded.json").read_text())
        return data

    def reloads(self) -> int:
        hups = self.state / "hups"
        return len(hups.read_text().splitlines()) if hups.exists() else 0


@pytest.fixture
def engine_with(tmp_path: Path) -> Iterator[Any]:
    """Starts a fake engine whose daemon.json holds the given mapping."""
    if os.geteuid() != 0:
        pytest.skip("the script changes a running engine only as root")
    started: list[subprocess.Popen[bytes]] = []
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    runsc = fake_runsc(tmp_path)
    for path, text in ((bin_dir / "docker", FAKE_DOCKER), (bin_dir / "dockerd", FAKE_DOCKERD)):
        path.write_text(text)
        path.chmod(0o755)

    def start(config: dict[str, Any]) -> Engine:
        json_path, pidfile = tmp_path / "daemon.json", tmp_path / "docker.pid"
        json_path.write_text(json.dumps(config).replace("RUNSC", str(runsc)))
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_STATE": str(state),
            "FAKE_JSON": str(json_path),
            # Every file the script reads, writes or signals through is the test's.
            "TOOLREG_DOCKER_JSON": str(json_path),
            "TOOLREG_DOCKER_PIDFILE": str(pidfile),
            "TOOLREG_DOCKERD_LOG": str(tmp_path / "dockerd.log"),
            "TOOLREG_CONTAINERD_PIDFILE": str(tmp_path / "containerd.pid"),
            "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock",  # were a real docker called
        }
        # SIGHUP at its default first: dockerd (Go) hears it however it was started, but
        # bash cannot trap a signal ignored on entry, as under `nohup make test`. Reset
        # by env(1), never by a preexec_fn: this process runs gRPC's threads (other test
        # files' servers under xdist), and Python run between fork and exec can deadlock
        # on a lock one of them held (seen: the fake engine never started).
        dockerd = subprocess.Popen(
            ["/usr/bin/env", "--default-signal=HUP", str(bin_dir / "dockerd")], env=env
        )
        started.append(dockerd)
        deadline = time.monotonic() + FAKE_START_S
        while not (state / "started").exists():
            assert time.monotonic() < deadline, "the fake dockerd did not start"
            time.sleep(0.05)
        pidfile.write_text(f"{dockerd.pid}\n")
        return Engine(json_path, state, env)

    yield start
    for process in started:
        process.kill()
        process.wait()


PLAIN = {"path": "RUNSC", "runtimeArgs": ["--network=none"]}  # our runsc entry (RUNSC: the fake's)


def ours(runsc: str, network: str) -> dict[str, Any]:
    return {
        GVISOR: {"path": runsc, "runtimeArgs": ["--network=none"]},
        GVISOR_NET: {"path": runsc, "runtimeArgs": [f"--network={network}"]},
    }


@pytest.mark.parametrize(
    ("version", "network", "mode"),
    [(FIXED_RUNSC, "sandbox", "netstack"), (DEBIAN_RUNSC, "host", "hostinet")],
)
def test_a_running_engine_we_set_up_gains_runsc_net_by_a_reload(
    engine_with: Any, version: str, network: str, mode: str
) -> None:
    engine = engine_with({"debug": True, "runtimes": {GVISOR: PLAIN}})
    done = engine.run(version)
    assert done.returncode == 0, done.stderr
    runsc = engine.config()["runtimes"][GVISOR]["path"]
    assert engine.config() == {"debug": True, "runtimes": ours(runsc, network)}
    assert engine.reloads() == 1 and engine.loaded() == ours(runsc, network)
    assert f"{GVISOR_NET} runtime registered: {mode}" in done.stdout
    assert (f"WARNING: {GVISOR_NET} uses hostinet" in done.stdout) == (mode == "hostinet")
    # Once there, a second run changes nothing and reloads nothing, and says which.
    again = engine.run(version)
    assert again.returncode == 0 and engine.reloads() == 1
    assert f"{GVISOR_NET} yes: {mode} (--network={network})" in again.stdout


@pytest.mark.parametrize(
    ("before", "version", "after"),
    [("sandbox", DEBIAN_RUNSC, "host"), ("host", FIXED_RUNSC, "sandbox")],
    ids=["netstack-to-hostinet", "hostinet-to-netstack"],
)
def test_our_runsc_net_switches_mode_when_the_probe_does(
    engine_with: Any, before: str, version: str, after: str
) -> None:
    """An upgraded runsc gets the netstack back; a netstack that cannot start here
    (the entry an older version of this script wrote) becomes hostinet."""
    engine = engine_with({"log-level": "warn", "runtimes": ours("RUNSC", before)})
    runsc = engine.config()["runtimes"][GVISOR]["path"]
    done = engine.run(version)
    assert done.returncode == 0, done.stderr
    assert engine.config() == {"log-level": "warn", "runtimes": ours(runsc, after)}
    assert engine.reloads() == 1 and engine.loaded() == ours(runsc, after)
    assert engine.run(version).returncode == 0 and engine.reloads() == 1


def test_a_runsc_net_entry_someone_else_wrote_keeps_its_mode(engine_with: Any) -> None:
    theirs = {"path": "RUNSC", "runtimeArgs": ["--network=sandbox", "--debug"]}
    engine = engine_with({"runtimes": {GVISOR: PLAIN, GVISOR_NET: theirs}})
    before = engine.json_path.read_text()
    done = engine.run(DEBIAN_RUNSC)  # the probe would pick hostinet
    assert done.returncode == 0, done.stderr
    assert engine.json_path.read_text() == before and engine.reloads() == 0
    assert f"{GVISOR_NET} yes: netstack (--network=sandbox)" in done.stdout


@pytest.mark.parametrize(
    "runsc_entry",
    [
        {"path": "RUNSC", "runtimeArgs": ["--network=host"]},  # the operator's choice
        {"path": "RUNSC", "runtimeArgs": ["--network=none", "--debug"]},
        {"path": "/nowhere/runsc", "runtimeArgs": ["--network=none"]},
    ],
)
def test_an_engine_someone_else_set_up_is_left_alone(
    engine_with: Any, runsc_entry: dict[str, Any]
) -> None:
    engine = engine_with({"runtimes": {GVISOR: runsc_entry}})
    before = engine.json_path.read_text()
    done = engine.run()
    assert done.returncode == 0, done.stderr
    assert engine.json_path.read_text() == before and engine.reloads() == 0
    assert f"WARNING: runtime {GVISOR_NET} is not registered" in done.stdout


def test_an_engine_without_gvisor_is_only_reported(engine_with: Any) -> None:
    engine = engine_with({"log-level": "info"})
    done = engine.run()
    assert done.returncode == 0, done.stderr
    assert f"{GVISOR} no, {GVISOR_NET} no" in done.stdout
    assert engine.config() == {"log-level": "info"} and engine.reloads() == 0

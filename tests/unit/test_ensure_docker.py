"""scripts/ensure_docker.sh: the engine set-up that `make run` and `make test`
run first. merge_daemon_json registers both gVisor runtimes (runsc without a
network, runsc-net with gVisor's netstack) and keeps everything else in
daemon.json; an engine already running that this script set up before
runsc-net existed gains it with a reload (SIGHUP), and any other engine is
left alone.

The engine here is a fake: a `docker` command on PATH that reports the
runtimes a fake `dockerd` process loaded, which reloads daemon.json on SIGHUP
as dockerd does. Nothing touches this machine's real engine or its files."""

from __future__ import annotations

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


def merge(path: Path, runsc: str = RUNSC) -> subprocess.CompletedProcess[str]:
    # Sourced, the script only defines its functions ($0 must not be the script's
    # path, or it would run main against this machine's engine).
    return subprocess.run(
        ["bash", "-c", 'source "$1" && merge_daemon_json "$2" "$3"', "bash", str(SCRIPT),
         str(path), runsc],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


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


def test_the_script_and_the_server_name_the_same_runtimes() -> None:
    text = SCRIPT.read_text()
    assert f"GVISOR_RUNTIME={GVISOR}\n" in text
    assert f"GVISOR_NET_RUNTIME={GVISOR_NET}\n" in text


# ---------------------------------------------------------------- a running engine

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

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT)], env=self.env, capture_output=True, text=True, timeout=60
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
    runsc = tmp_path / "runsc"  # owned_runsc_path wants an executable
    for path, text in ((bin_dir / "docker", FAKE_DOCKER), (bin_dir / "dockerd", FAKE_DOCKERD),
                       (runsc, "#!/bin/sh\n")):  # fmt: skip
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
            "TOOLREG_DOCKER_JSON": str(json_path),
            "TOOLREG_DOCKER_PIDFILE": str(pidfile),
        }
        dockerd = subprocess.Popen([str(bin_dir / "dockerd")], env=env)
        started.append(dockerd)
        deadline = time.monotonic() + 10
        while not (state / "started").exists():
            assert time.monotonic() < deadline, "the fake dockerd did not start"
            time.sleep(0.05)
        pidfile.write_text(f"{dockerd.pid}\n")
        return Engine(json_path, state, env)

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_running_engine_we_set_up_gains_runsc_net_by_a_reload(engine_with: Any) -> None:
    engine = engine_with({"debug": True, "runtimes": {GVISOR: {
        "path": "RUNSC", "runtimeArgs": ["--network=none"]}}})  # fmt: skip
    done = engine.run()
    assert done.returncode == 0, done.stderr
    runsc = engine.config()["runtimes"][GVISOR]["path"]
    assert engine.config() == {"debug": True, "runtimes": {
        GVISOR: {"path": runsc, "runtimeArgs": ["--network=none"]},
        GVISOR_NET: {"path": runsc, "runtimeArgs": ["--network=sandbox"]},
    }}  # fmt: skip
    assert engine.reloads() == 1 and set(engine.loaded()) == {GVISOR, GVISOR_NET}
    assert f"{GVISOR_NET} runtime registered" in done.stdout
    # Once there, a second run changes nothing and reloads nothing.
    assert engine.run().returncode == 0 and engine.reloads() == 1


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

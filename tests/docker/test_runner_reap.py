"""The reaper against real containers whose owner labels say dead or alive."""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator

import docker
import pytest

from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.ownership import (
    LABEL_DEADLINE,
    LABEL_INSTANCE,
    LABEL_MANAGED,
    STALE_AFTER_MS,
    OwnerIdentity,
    process_start_ticks,
)

RUN_LABEL = "io.toolreg.test-run"

# Serial: the orphans these tests make (managed, their owner provably gone, or past their
# deadline) are every reaper's to remove, and each toolreg server starting on this engine
# reaps at start (reap_on_start), whatever its test: one started by another test file
# between a create and this runner's reap() takes some of them, and then the count of
# what this reaper removed is short (the 'removed' and '== 1' checks).
pytestmark = pytest.mark.serial


@pytest.fixture
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def dead_pid() -> tuple[int, int]:
    proc = subprocess.Popen(["sleep", "30"])
    ticks = process_start_ticks(proc.pid)
    assert ticks is not None
    proc.kill()
    proc.wait()
    return proc.pid, ticks


def test_reap_removes_dead_owners_and_keeps_live_ones(
    runner: DockerBackend,
    docker_client: docker.DockerClient,
    image: str,
    run_id: str,
    live_process: subprocess.Popen[bytes],
) -> None:
    me = OwnerIdentity.current()
    live_ticks = process_start_ticks(live_process.pid)
    assert live_ticks is not None
    pid, ticks = dead_pid()

    def owner(**changes: object) -> dict[str, str]:
        fields = {
            "pid": me.pid,
            "start_ticks": me.start_ticks,
            "boot_id": me.boot_id,
            "host_id": me.host_id,
            "pid_ns": me.pid_ns,
        }
        fields.update(changes)
        return OwnerIdentity(**fields).labels()  # type: ignore[arg-type]

    future = str(int(time.time() * 1000) + 60_000)
    cases = {
        "dead-pid": (owner(pid=pid, start_ticks=ticks), True),
        "pid-reused": (owner(pid=live_process.pid, start_ticks=live_ticks + 1), True),
        "rebooted": (owner(boot_id=str(uuid.uuid4())), True),
        "stale": (
            {**owner(pid=live_process.pid, start_ticks=live_ticks),
             LABEL_DEADLINE: str(int(time.time() * 1000) - STALE_AFTER_MS - 1000)},
            True,
        ),
        "live-other-server": (owner(pid=live_process.pid, start_ticks=live_ticks), False),
        "live-same-process": (owner(), False),
        "other-host": (owner(pid=pid, start_ticks=ticks, host_id="elsewhere"), False),
        "other-pidns": (owner(pid=pid, start_ticks=ticks, pid_ns="pid:[1]"), False),
        "no-owner-labels": ({}, False),
        "this-instance": (owner(pid=pid, start_ticks=ticks), False),
    }  # fmt: skip
    ids: dict[str, str] = {}
    try:
        for name, (labels, _) in cases.items():
            instance = runner.instance_id if name == "this-instance" else f"other-{name}"
            created = docker_client.api.create_container(
                image,
                ["sh", "-c", "sleep 300"],
                labels={
                    LABEL_MANAGED: "true",
                    LABEL_INSTANCE: instance,
                    LABEL_DEADLINE: future,
                    RUN_LABEL: run_id,
                    **labels,
                },
                host_config=docker_client.api.create_host_config(network_mode="none"),
            )
            ids[name] = created["Id"]
        docker_client.api.start(ids["live-other-server"])  # a running one must survive too

        removed = runner.reap()

        left = {
            c["Id"]
            for c in docker_client.api.containers(
                all=True, filters={"label": f"{RUN_LABEL}={run_id}"}
            )
        }
        expected_gone = {n for n, (_, gone) in cases.items() if gone}
        assert {n for n, cid in ids.items() if cid not in left} == expected_gone
        assert removed == len(expected_gone)
    finally:
        for cid in ids.values():
            with contextlib.suppress(docker.errors.NotFound):
                docker_client.api.remove_container(cid, force=True)


def test_reap_is_scoped_by_the_runner_labels(
    runner: DockerBackend, docker_client: docker.DockerClient, image: str, run_id: str
) -> None:
    pid, ticks = dead_pid()
    me = OwnerIdentity.current()
    orphan_labels = {
        **OwnerIdentity(pid, ticks, me.boot_id, me.host_id, me.pid_ns).labels(),
        LABEL_MANAGED: "true",
        LABEL_INSTANCE: "some-dead-server",
        RUN_LABEL: run_id,
    }
    cid = docker_client.api.create_container(image, ["true"], labels=orphan_labels)["Id"]
    other_scope = DockerBackend(instance_id="scoped", extra_labels={RUN_LABEL: f"not-{run_id}"})
    try:
        assert other_scope.reap() == 0  # not in its scope, even though the owner is dead
    finally:
        other_scope.close()
    assert runner.reap() == 1
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(cid)

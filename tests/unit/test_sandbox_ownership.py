"""The reaper's ownership decision: remove only what is provably abandoned."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from sandbox_runner.ownership import (
    LABEL_DEADLINE,
    LABEL_INSTANCE,
    LABEL_MANAGED,
    STALE_AFTER_MS,
    OwnerIdentity,
    orphan_reason,
    process_alive,
    process_start_ticks,
)

ME = OwnerIdentity(pid=100, start_ticks=5000, boot_id="boot-a", host_id="host-a", pid_ns="ns-a")
NOW_MS = 1_700_000_000_000
ALIVE = {(200, 7000)}  # (pid, start ticks) of the one other live server


def alive(pid: int, ticks: int) -> bool:
    return (pid, ticks) in ALIVE


def labels(owner: OwnerIdentity, instance: str = "other", **extra: str) -> dict[str, str]:
    return {LABEL_MANAGED: "true", LABEL_INSTANCE: instance, **owner.labels(), **extra}


def reason(lbls: dict[str, str]) -> str | None:
    return orphan_reason(lbls, me=ME, my_instance="mine", now_ms=NOW_MS, owner_alive=alive)


def other(**changes: object) -> OwnerIdentity:
    return dataclasses.replace(ME, **changes)  # type: ignore[arg-type]


def test_dead_owner_is_reaped() -> None:
    assert reason(labels(other(pid=300, start_ticks=1))) == "its owner (pid 300) is gone"


def test_reused_pid_counts_as_dead() -> None:
    assert reason(labels(other(pid=200, start_ticks=6999))) is not None


def test_live_owner_is_kept() -> None:
    assert reason(labels(other(pid=200, start_ticks=7000))) is None


def test_same_process_other_instance_is_kept() -> None:
    assert reason(labels(ME, instance="another-runner-here")) is None


def test_this_instance_is_never_reaped() -> None:
    assert reason(labels(other(pid=300), instance="mine")) is None
    stale = str(NOW_MS - STALE_AFTER_MS - 1)
    assert reason(labels(other(pid=300), instance="mine", **{LABEL_DEADLINE: stale})) is None


def test_reboot_means_dead() -> None:
    assert reason(labels(other(boot_id="boot-b", pid=200, start_ticks=7000))) is not None


def test_other_host_or_pid_namespace_cannot_be_judged() -> None:
    assert reason(labels(other(host_id="host-b", pid=300))) is None
    assert reason(labels(other(host_id="host-b", boot_id="boot-b"))) is None
    assert reason(labels(other(pid_ns="ns-b", pid=300))) is None


def test_long_past_deadline_is_reaped_whoever_owns_it() -> None:
    live = other(pid=200, start_ticks=7000)
    stale = str(NOW_MS - STALE_AFTER_MS - 1)
    fresh = str(NOW_MS - STALE_AFTER_MS + 1000)
    assert reason(labels(live, **{LABEL_DEADLINE: stale})) is not None
    assert reason(labels(live, **{LABEL_DEADLINE: fresh})) is None
    assert reason(labels(other(host_id="host-b"), **{LABEL_DEADLINE: stale})) is not None


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d.pop("io.toolreg.owner-pid"),
        lambda d: d.update({"io.toolreg.owner-pid": "abc"}),
        lambda d: d.update({"io.toolreg.owner-boot": ""}),
        lambda d: d.update({LABEL_MANAGED: "false"}),
    ],
)
def test_unreadable_labels_are_kept(mangle: object) -> None:
    lbls = labels(other(pid=300))
    mangle(lbls)  # type: ignore[operator]
    assert reason(lbls) is None


def test_garbled_deadline_is_ignored() -> None:
    assert reason(labels(other(pid=300), **{LABEL_DEADLINE: "soon"})) is not None
    assert reason(labels(other(pid=200, start_ticks=7000), **{LABEL_DEADLINE: "0x1"})) is None


def test_identity_round_trips_through_labels() -> None:
    me = OwnerIdentity.current()
    assert me.pid == os.getpid()
    assert me.start_ticks > 0 and me.boot_id and me.host_id and me.pid_ns.startswith("pid:[")
    assert OwnerIdentity.from_labels(me.labels()) == me


def test_process_liveness_from_proc() -> None:
    me = OwnerIdentity.current()
    assert process_alive(me.pid, me.start_ticks)
    assert not process_alive(me.pid, me.start_ticks + 1)
    proc = subprocess.Popen(["sleep", "30"])
    ticks = process_start_ticks(proc.pid)
    assert ticks is not None and process_alive(proc.pid, ticks)
    proc.kill()
    proc.wait()
    assert not process_alive(proc.pid, ticks)
    assert process_start_ticks(0) is None

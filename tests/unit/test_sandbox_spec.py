"""Limits merging, spec validation and profiles."""

from __future__ import annotations

import dataclasses

import pytest

from sandbox_runner import (
    CAUTIOUS_LIMITS,
    DANGEROUS_LIMITS,
    SAFE_LIMITS,
    Limits,
    Mount,
    SandboxSpec,
    profile_for,
    runtime_for,
)
from sandbox_runner.profiles import gvisor_network

UNSET = Limits(0, 0, 0, 0, 0, 0, 0, 0)


def test_tightest_takes_the_field_wise_minimum() -> None:
    request = SAFE_LIMITS.replace(memory_mb=64, timeout_ms=60_000, output_bytes=10)
    merged = SAFE_LIMITS.tightest(request)
    assert merged.memory_mb == 64  # lower: taken
    assert merged.timeout_ms == SAFE_LIMITS.timeout_ms  # higher: never loosens
    assert merged.output_bytes == 10
    assert merged.pids == SAFE_LIMITS.pids


def test_tightest_zero_means_use_the_profile() -> None:
    assert SAFE_LIMITS.tightest(UNSET) == SAFE_LIMITS
    assert SAFE_LIMITS.tightest(UNSET.replace(pids=5)) == SAFE_LIMITS.replace(pids=5)


def test_tightest_fills_fields_the_base_leaves_unset() -> None:
    assert UNSET.tightest(CAUTIOUS_LIMITS) == CAUTIOUS_LIMITS


def test_tightest_never_loosens_any_field() -> None:
    huge = Limits(*([10**9] * 8))
    for f in dataclasses.fields(Limits):
        assert getattr(CAUTIOUS_LIMITS.tightest(huge), f.name) == getattr(CAUTIOUS_LIMITS, f.name)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_limits_reject_negative_and_non_int(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        SAFE_LIMITS.replace(memory_mb=bad)  # type: ignore[arg-type]


def test_limits_complete() -> None:
    assert SAFE_LIMITS.complete
    assert not SAFE_LIMITS.replace(nofile=0).complete


def test_profiles() -> None:
    assert profile_for("safe") is SAFE_LIMITS
    assert profile_for("cautious") is CAUTIOUS_LIMITS
    assert profile_for("dangerous") is DANGEROUS_LIMITS
    assert SAFE_LIMITS.memory_mb == 256 and SAFE_LIMITS.cpu_millis == 1000
    assert SAFE_LIMITS.pids == 64 and SAFE_LIMITS.timeout_ms == 10_000
    assert SAFE_LIMITS.output_bytes == 1024 * 1024
    assert CAUTIOUS_LIMITS.memory_mb == 128 and CAUTIOUS_LIMITS.cpu_millis == 500
    assert CAUTIOUS_LIMITS.pids == 32 and CAUTIOUS_LIMITS.timeout_ms == 5_000
    assert CAUTIOUS_LIMITS.output_bytes == 256 * 1024
    # cautious and dangerous are never looser than safe
    assert SAFE_LIMITS.tightest(CAUTIOUS_LIMITS) == CAUTIOUS_LIMITS
    with pytest.raises(ValueError, match="unknown safety level"):
        profile_for("SAFE")


def test_runtime_for() -> None:
    assert runtime_for("dangerous", {"runc", "runsc"}) == "runsc"
    assert runtime_for("dangerous", {"runc"}) is None
    assert runtime_for("safe", {"runc", "runsc"}) == "runc"
    # With egress: only a dangerous tool changes runtime, to gVisor with networking.
    gvisor = {"runc", "runsc", "runsc-net"}
    assert runtime_for("dangerous", gvisor, egress=True) == "runsc-net"
    assert runtime_for("dangerous", {"runc", "runsc"}, egress=True) is None
    assert runtime_for("dangerous", gvisor) == "runsc"
    assert runtime_for("cautious", gvisor, egress=True) == "runc"


@pytest.mark.parametrize(
    ("args", "mode"),
    [
        ((), "netstack"),  # runsc's default
        (("--network=sandbox",), "netstack"),
        (("--network=host",), "hostinet"),
        (("-network=host",), "hostinet"),  # Go's flags: one dash or two
        (("--network", "host"), "hostinet"),
        (("--debug", "--network=sandbox", "--network=host"), "hostinet"),  # the last wins
        (("--network=host", "--network=sandbox"), "netstack"),
        (("--network=none",), "none"),
        (("--networkx=host",), "netstack"),  # another flag
    ],
)
def test_gvisor_network_reads_runsc_arguments_as_runsc_does(
    args: tuple[str, ...], mode: str
) -> None:
    assert gvisor_network(args) == mode


def spec(**changes: object) -> SandboxSpec:
    base: dict[str, object] = {
        "image": "toolreg/base",
        "command": ("cat",),
        "env": (("A", "1"),),
        "limits": SAFE_LIMITS,
    }
    base.update(changes)
    return SandboxSpec(**base)  # type: ignore[arg-type]


def test_spec_defaults() -> None:
    s = spec()
    assert (s.runtime, s.input, s.mounts, s.workdir) == ("runc", b"", (), None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.image = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [
        {"image": ""},
        {"command": ["cat"]},
        {"command": ("a\0b",)},
        {"env": (("A=B", "1"),)},
        {"env": (("A", "x\0"),)},
        {"env": (("A",),)},
        {"limits": SAFE_LIMITS.replace(timeout_ms=0)},
        {"runtime": ""},
        {"input": "text"},
        {"workdir": "relative"},
        {"mounts": ("/a:/b",)},
    ],
)
def test_spec_rejects_bad_fields(changes: dict[str, object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        spec(**changes)


def test_mount_validation() -> None:
    assert Mount("/srv/ws", "/workspace").read_only is True
    for source, target in [("rel", "/x"), ("/x", "rel"), ("/x", "/"), ("/x", "/a/..")]:
        with pytest.raises(ValueError):
            Mount(source, target)

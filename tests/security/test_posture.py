"""What a tool sees from inside its sandbox, read through the real server."""

from __future__ import annotations

import pytest

from tests.integration.conftest import Running
from tests.security.conftest import Register, execute

POSTURE = (
    "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
    "echo uid=$(id -u) gid=$(id -g); "
    'awk \'$2 == "/" {print "root=" $4}\' /proc/mounts | cut -d, -f1; '
    'awk \'$2 == "/tmp" {print "tmp=" $4}\' /proc/mounts; '
    "echo ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ,); "
    "ls /dev | tr '\\n' ' '"
)


@pytest.mark.parametrize("level", ["safe", "cautious"])
def test_posture_inside_the_sandbox(
    sandbox_server: Running, register: Register, level: str
) -> None:
    register("posture", POSTURE, level)
    result = execute(sandbox_server, "posture")
    assert result.success, result.error
    facts = dict(
        line.replace(":\t", "=").split("=", 1)
        for line in result.content.splitlines()
        if "=" in line or ":\t" in line
    )
    assert facts["CapEff"] == "0000000000000000"
    assert facts["CapPrm"] == "0000000000000000"
    assert facts["CapBnd"] == "0000000000000000"
    assert facts["NoNewPrivs"] == "1"
    assert facts["Seccomp"] == "2"  # the engine's default seccomp filter is on
    assert result.content.count("uid=65534 gid=65534") == 1
    assert facts["root"] == "ro"
    tmp_opts = set(facts["tmp"].split(","))
    assert {"rw", "nosuid", "nodev", "noexec"} <= tmp_opts
    assert facts["ifaces"] == "lo,"
    devices = set(result.content.splitlines()[-1].split())
    assert devices <= {
        "null",
        "zero",
        "full",
        "random",
        "urandom",
        "tty",
        "fd",
        "stdin",
        "stdout",
        "stderr",
        "pts",
        "ptmx",
        "shm",
        "mqueue",
        "console",
        "core",
    }


def test_limits_applied_are_the_tightest(sandbox_server: Running, register: Register) -> None:
    """A tool may ask for less than its profile, never more."""
    script = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
    register("greedy", script, "cautious", limits={"memory_mb": 60_000})
    register("modest", script, "safe", limits={"memory_mb": 32})
    greedy = execute(sandbox_server, "greedy")
    modest = execute(sandbox_server, "modest")
    assert int(greedy.content) == 128 * 1024 * 1024  # the cautious ceiling, not 60 GB
    assert int(modest.content) == 32 * 1024 * 1024


def test_dangerous_tools_run_under_gvisor_locked_down(
    sandbox_server: Running, register: Register
) -> None:
    register("posture_gvisor", POSTURE + "; dmesg 2>/dev/null | head -1", "dangerous")
    result = execute(sandbox_server, "posture_gvisor")
    assert result.success, result.error
    assert "gVisor" in result.content  # the guest kernel is gVisor's, not the host's
    facts = dict(
        line.replace(":\t", "=").split("=", 1)
        for line in result.content.splitlines()
        if "=" in line or ":\t" in line
    )
    assert facts["CapEff"] == "0000000000000000" and facts["CapBnd"] == "0000000000000000"
    assert "uid=65534 gid=65534" in result.content
    assert facts["root"] == "ro"
    assert facts["ifaces"] == "lo,"

"""Hostile tools against the real engine, through the real server.

Each attack must end with its expected status, leave nothing behind, and
never stop the server from answering: an `echo` call made while the attack
runs must still succeed quickly.
"""

from __future__ import annotations

import threading
import time

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from tests.integration.conftest import Running
from tests.security.conftest import Register, execute

LEVELS = ["safe", "cautious", "dangerous"]  # dangerous: approved, under gVisor
ATTACK_TIMEOUT_MS = 3_000  # milliseconds each attack tool may run
ECHO_WHILE_ATTACKED_S = 5.0  # seconds an echo call may take while an attack runs
MB = 1024 * 1024

S = pb.ExecutionStatus


def attacked(running: Running, register: Register, name: str) -> tuple[pb.ToolResult, float]:
    """Run tool `name`; meanwhile call echo. Returns the attack's result and
    how long the concurrent echo took."""
    register("echo_probe", "cat")
    outcome: dict[str, pb.ToolResult] = {}
    attack = threading.Thread(target=lambda: outcome.setdefault("r", execute(running, name)))
    attack.start()
    time.sleep(0.5)
    started = time.monotonic()
    probe = execute(running, "echo_probe", '{"ping": 1}')
    probe_s = time.monotonic() - started
    attack.join(timeout=60)
    assert not attack.is_alive(), "the attack call never returned"
    assert probe.success and probe.data_json == '{"ping":1}', probe.error
    return outcome["r"], probe_s


def limits(**extra: int) -> dict[str, int]:
    return {"timeout_ms": ATTACK_TIMEOUT_MS, **extra}


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb(sandbox_server: Running, register: Register, level: str) -> None:
    register("fork_bomb", "b(){ b | b & }; b; sleep 30", level, limits=limits())
    result, probe_s = attacked(sandbox_server, register, "fork_bomb")
    assert result.status == S.Value("EXECUTION_STATUS_RESOURCE_EXHAUSTED"), result
    # gVisor has no pids limit (it rejects the flag); there the memory limit stops the bomb.
    assert "process limit" in result.error or (level == "dangerous" and "memory" in result.error)
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_memory_bomb(sandbox_server: Running, register: Register, level: str) -> None:
    register(
        "mem_bomb",
        "x=aaaaaaaaaaaaaaaa; while :; do x=$x$x; done",
        level,
        limits=limits(memory_mb=64),
    )
    result, probe_s = attacked(sandbox_server, register, "mem_bomb")
    assert result.status == S.Value("EXECUTION_STATUS_RESOURCE_EXHAUSTED"), result
    assert "memory" in result.error
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_filling_tmp_stops_at_its_cap(
    sandbox_server: Running, register: Register, level: str
) -> None:
    # fsize (16 MiB per file) and the tmpfs size both cap it; many files hit the tmpfs cap.
    register(
        "fill_tmp",
        "i=0; while [ $i -lt 200 ]; do dd if=/dev/zero of=/tmp/f$i bs=1M count=8 2>/dev/null"
        " || { echo full at $i >&2; df -m /tmp >&2; exit 3; }; i=$((i+1)); done; echo never",
        level,
        limits=limits(),
    )
    result, probe_s = attacked(sandbox_server, register, "fill_tmp")
    assert result.status == S.Value("EXECUTION_STATUS_TOOL_ERROR"), result
    assert "full at" in result.error and result.exit_code == 3
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_root_filesystem_is_read_only(
    sandbox_server: Running, register: Register, level: str
) -> None:
    register(
        "write_root",
        "echo x > /etc/evil || echo x > /bin/evil || echo x > /evil; "
        "awk '$2 == \"/\" {print $4}' /proc/mounts >&2; exit 1",
        level,
        limits=limits(),
    )
    result = execute(sandbox_server, "write_root")
    assert result.status == S.Value("EXECUTION_STATUS_TOOL_ERROR")
    # runc says EROFS; gVisor checks permissions first (EACCES). Either way the
    # mount itself must be read-only.
    assert "Read-only file system" in result.error or "Permission denied" in result.error
    assert result.stderr.splitlines()[-1].split(",")[0] == "ro"


@pytest.mark.parametrize("level", LEVELS)
def test_output_flood_is_cut_at_the_cap(
    sandbox_server: Running, register: Register, level: str
) -> None:
    register(
        "flood",
        "head -c 104857600 /dev/zero | tr '\\0' x",
        level,
        limits=limits(output_bytes=256 * 1024),
    )
    started = time.monotonic()
    result, probe_s = attacked(sandbox_server, register, "flood")
    assert result.status == S.Value("EXECUTION_STATUS_RESOURCE_EXHAUSTED"), result.error
    assert result.output_truncated
    assert len(result.content) == 256 * 1024
    assert time.monotonic() - started < ATTACK_TIMEOUT_MS / 1000 + 5
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_tool_that_never_exits(sandbox_server: Running, register: Register, level: str) -> None:
    register("forever", "sleep 1000", level, limits=limits())
    started = time.monotonic()
    result, probe_s = attacked(sandbox_server, register, "forever")
    elapsed = time.monotonic() - started
    assert result.status == S.Value("EXECUTION_STATUS_TIMEOUT")
    assert ATTACK_TIMEOUT_MS / 1000 <= elapsed < ATTACK_TIMEOUT_MS / 1000 + 5
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_tool_that_ignores_sigterm(sandbox_server: Running, register: Register, level: str) -> None:
    register("stubborn", "trap '' TERM INT HUP; while :; do :; done", level, limits=limits())
    result, probe_s = attacked(sandbox_server, register, "stubborn")
    assert result.status == S.Value("EXECUTION_STATUS_TIMEOUT")
    assert probe_s < ECHO_WHILE_ATTACKED_S


@pytest.mark.parametrize("level", LEVELS)
def test_no_network_and_no_dns(sandbox_server: Running, register: Register, level: str) -> None:
    register(
        "net",
        "wget -q -T 2 -O- http://1.1.1.1/ && echo CONNECTED; "
        "wget -q -T 2 -O- http://127.0.0.1:1/ 2>/dev/null && echo LOCAL; "
        "nslookup example.com >/dev/null 2>&1 && echo RESOLVED; "
        "ping -c1 -W1 8.8.8.8 >/dev/null 2>&1 && echo PINGED; "
        "cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' '",
        level,
        limits=limits(),
    )
    result = execute(sandbox_server, "net")
    assert result.status == S.Value("EXECUTION_STATUS_OK"), result.error
    assert result.content.split() == ["lo"]  # only loopback, and nothing connected


@pytest.mark.parametrize("level", LEVELS)
def test_cannot_see_host_or_other_sandboxes(
    sandbox_server: Running, register: Register, level: str
) -> None:
    register(
        "keeper",
        "echo secret-$$ > /tmp/secret-file; sleep 2; cat /tmp/secret-file",
        limits=limits(),
    )
    register(
        "snoop",
        "sleep 0.5; find / -xdev -name 'secret-file' 2>/dev/null; "
        "ls /proc | grep -c '^[0-9]'; cat /etc/shadow 2>&1; ls /var/lib/docker 2>&1; "
        "grep -c ' / ' /proc/self/mountinfo",
        level,
        limits=limits(),
    )
    keeper: dict[str, pb.ToolResult] = {}
    t = threading.Thread(target=lambda: keeper.setdefault("r", execute(sandbox_server, "keeper")))
    t.start()
    snoop = execute(sandbox_server, "snoop")
    t.join()
    assert keeper["r"].success and keeper["r"].content.startswith("secret-")
    out = snoop.content.splitlines()
    assert "secret-file" not in snoop.content
    assert int(out[0]) <= 5  # only its own few processes are visible
    assert "No such file" in out[1] and "No such file" in out[2]


@pytest.mark.parametrize("level", LEVELS)
def test_setuid_and_privilege_escalation_fail(
    sandbox_server: Running, register: Register, level: str
) -> None:
    code = (
        "import os, sys\n"
        "try:\n    os.setuid(0)\n    print('BECAME ROOT')\nexcept PermissionError as e:\n    print('denied', e.errno)\n"
        "try:\n    os.chown('/tmp', 0, 0)\n    print('CHOWNED')\nexcept PermissionError:\n    print('chown denied')\n"
        "open('/tmp/x', 'w').write('x'); os.chmod('/tmp/x', 0o4755)\n"
        "print('suid bit', bool(os.stat('/tmp/x').st_mode & 0o4000), 'uid', os.getuid())\n"
    )
    register(
        "escalate",
        "",
        level,
        image="toolreg/python",
        command=["python3", "-c", code],
        limits=limits(),
    )
    result = execute(sandbox_server, "escalate")
    assert result.success, result.error
    assert "BECAME ROOT" not in result.content and "CHOWNED" not in result.content
    assert "denied 1" in result.content and "chown denied" in result.content
    assert "uid 65534" in result.content  # a setuid bit on a noexec tmpfs buys nothing

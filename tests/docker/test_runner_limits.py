"""Adversarial tools against the limits: each ends with the expected flags, promptly,
and leaves no container behind (checked by the autouse fixture after every test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from sandbox_runner import CAUTIOUS_LIMITS, SandboxResult, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend

Eid = Callable[[], str]
SpecFactory = Callable[..., SandboxSpec]

# Seconds a killed run may take beyond its timeout (kill, drain, inspect, remove).
KILL_SLACK_S = 2.0


def timed(fn: Callable[[], SandboxResult]) -> tuple[SandboxResult, float]:
    start = time.monotonic()
    res = fn()
    return res, time.monotonic() - start


def test_tool_that_never_exits_is_killed_at_the_deadline(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    spec = make_spec("sleep 60", timeout_ms=1500)
    res, elapsed = timed(lambda: runner.run(spec, execution_id=eid()))
    assert res.timed_out
    assert res.exit_code == 137  # SIGKILL
    assert 1.5 <= elapsed < 1.5 + KILL_SLACK_S
    assert 1500 <= res.duration_ms < 1500 + KILL_SLACK_S * 1000


def test_tool_ignoring_sigterm_still_dies(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    spec = make_spec("trap '' TERM INT HUP; echo trapped; while :; do :; done", timeout_ms=1500)
    res, elapsed = timed(lambda: runner.run(spec, execution_id=eid()))
    assert res.timed_out
    assert res.stdout == b"trapped\n"
    assert elapsed < 1.5 + KILL_SLACK_S


@pytest.mark.parametrize(
    ("script", "stream"),
    [
        ("cat /dev/zero", "stdout"),
        ("yes", "stdout"),  # 100 MB and more of lines
        ("cat /dev/zero >&2", "stderr"),
    ],
)
def test_output_flood_is_cut_at_the_cap(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, script: str, stream: str
) -> None:
    cap = 64 * 1024
    spec = make_spec(script, output_bytes=cap, timeout_ms=20_000)
    res, elapsed = timed(lambda: runner.run(spec, execution_id=eid()))
    assert res.output_truncated
    assert not res.timed_out
    assert len(getattr(res, stream)) == cap
    assert elapsed < 3.0, "a flood must be stopped by the cap, not by the timeout"


def test_output_exactly_at_the_cap_is_not_truncated(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    spec = make_spec("head -c 5000 /dev/zero", output_bytes=5000)
    res = runner.run(spec, execution_id=eid())
    assert (res.exit_code, len(res.stdout), res.output_truncated) == (0, 5000, False)


def test_streamed_chunks_respect_the_cap(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    got: list[bytes] = []
    spec = make_spec("yes", output_bytes=10_000)
    res = runner.run(spec, execution_id=eid(), on_output=lambda s, c: got.append(c))
    assert sum(map(len, got)) == 10_000
    assert b"".join(got) == res.stdout


@pytest.mark.parametrize(
    "script",
    [
        "dd if=/dev/zero of=/dev/null bs=256M count=1",  # one huge buffer
        'a=xxxxxxxxxxxxxxxx; while :; do a="$a$a"; done',  # a shell string doubling
    ],
    ids=["dd-buffer", "string-doubling"],
)
def test_memory_bomb_is_oom_killed(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, script: str
) -> None:
    spec = make_spec(script, memory_mb=64, timeout_ms=20_000)
    res = runner.run(spec, execution_id=eid())
    assert res.oom_killed
    assert not res.timed_out
    assert res.exit_code == 137


def test_fork_bomb_is_contained_and_the_engine_stays_responsive(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    bomb = make_spec("f(){ f|f& }; f; sleep 30", limits=CAUTIOUS_LIMITS, timeout_ms=4000)
    results: list[SandboxResult] = []
    started = time.monotonic()
    t = threading.Thread(target=lambda: results.append(runner.run(bomb, execution_id=eid())))
    t.start()
    time.sleep(1.0)  # let it saturate its pids limit
    echo, echo_s = timed(lambda: runner.run(make_spec("cat", input=b"ok"), execution_id=eid()))
    t.join(4 + KILL_SLACK_S + 5)
    assert not t.is_alive(), "the run of a fork bomb must return"
    assert echo.stdout == b"ok" and echo_s < 2.0
    (res,) = results
    assert res.timed_out or res.exit_code is not None
    assert time.monotonic() - started < 4 + KILL_SLACK_S + 1
    # The engine is local here, so the pids cgroup is readable at kill time.
    assert res.pids_exhausted


def test_filling_tmp_stops_at_the_tmpfs_cap(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    spec = make_spec(
        "dd if=/dev/zero of=/tmp/fill bs=1M count=64; wc -c < /tmp/fill",
        tmpfs_mb=8,
        fsize_mb=64,
    )
    res = runner.run(spec, execution_id=eid())
    assert b"No space left on device" in res.stderr
    assert int(res.stdout) <= 8 * 1024 * 1024


def test_file_size_ulimit(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    spec = make_spec(
        "dd if=/dev/zero of=/tmp/big bs=1M count=4; echo rc=$?; wc -c < /tmp/big",
        tmpfs_mb=64,
        fsize_mb=1,
    )
    res = runner.run(spec, execution_id=eid())
    lines = res.stdout.split()
    assert lines[0] != b"rc=0"
    assert int(lines[-1]) <= 1024 * 1024


def test_root_filesystem_is_read_only(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("echo x > /x || echo x > /bin/x"), execution_id=eid())
    assert res.exit_code != 0
    assert b"Read-only file system" in res.stderr


def test_tmp_is_noexec(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    res = runner.run(
        make_spec("cat /bin/busybox > /tmp/bb && chmod +x /tmp/bb && /tmp/bb echo ran"),
        execution_id=eid(),
    )
    assert res.exit_code != 0
    assert b"ran" not in res.stdout


def test_cancel_event_kills_promptly(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    res, elapsed = timed(
        lambda: runner.run(make_spec("sleep 60", timeout_ms=30_000), execution_id=eid(),
                           cancel=cancel)
    )  # fmt: skip
    assert res.cancelled
    assert not res.timed_out
    assert elapsed < 0.5 + KILL_SLACK_S


def test_cancel_before_start_creates_nothing(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    cancel = threading.Event()
    cancel.set()
    res = runner.run(make_spec("echo never"), execution_id=eid(), cancel=cancel)
    assert res.cancelled and res.container_id == "" and res.exit_code is None

"""Start `toolreg serve` as a child process and learn its address: for tests,
benchmarks and scripts that need a real server process (port 0 = any)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

SERVING_LINE = re.compile(r"serving on (\S+:\d+)")
START_TIMEOUT_S = 30.0  # seconds for the server to say where it listens


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[str], address: str, log: list[str]) -> None:
        self.proc = proc
        self.address = address
        self.log = log  # every line the server wrote to stderr, as it arrives

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def spawn_server(
    data_dir: Path,
    *extra_args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """``env``: the server's whole environment (default: this process's)."""
    argv = [sys.executable, "-m", "registry_server.cli", "serve", "--port", "0",
            "--data-dir", str(data_dir), *extra_args]  # fmt: skip
    proc, address, log = spawn_until(argv, SERVING_LINE, what="toolreg serve", cwd=cwd, env=env)
    return ServerProcess(proc, address, log)


def spawn_until(
    argv: list[str],
    ready: re.Pattern[str],
    *,
    what: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """Start ``argv`` and read its stderr until a line matches ``ready``: the
    process, the match's first group, and every line it writes to stderr (kept
    up to date as they arrive). RuntimeError with its last lines if it never does."""
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    assert proc.stderr is not None
    log: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            # End of its output: it exited, or is about to (waiting for it here
            # keeps the empty reads out of the log, which hid its last words).
            if proc.poll() is not None or _exited(proc, deadline):
                break
            continue
        log.append(line)
        if match := ready.search(line):
            # Keep reading the log so a full pipe never stalls the process.
            threading.Thread(target=_drain, args=(proc, log), daemon=True).start()
            return proc, match.group(1), log
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{what} did not start:\n" + "".join(log[-20:]))


def _exited(proc: subprocess.Popen[str], deadline: float) -> bool:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _drain(proc: subprocess.Popen[str], log: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        log.append(line)

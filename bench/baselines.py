"""What users would pick instead of toolreg, each set up to run the same
command on the same local image with (as far as it allows) the same isolation.

Each factory returns a Method, or raises Unavailable with the exact reason a
library cannot run here; the report prints that reason instead of a number.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import docker

from bench.common import (
    BENCH_LABEL,
    COMMAND,
    DOCKER_RUN_FLAGS,
    HARDENING,
    IMAGE,
    PAYLOAD,
    Unavailable,
)

POOL_READY_TIMEOUT_S = 60.0  # seconds for llm-sandbox's pool to pre-warm
# The payload as an argument: llm-sandbox runs commands with `docker exec` and
# gives them no stdin, so `cat` reads the JSON from a pipe inside the container.
EXEC_COMMAND = "sh -c " + shlex.quote('printf %s "$0" | ' + " ".join(COMMAND)) + " "
EXEC_COMMAND += shlex.quote(PAYLOAD.decode())


@dataclass
class Method:
    name: str
    group: str  # "baseline" or "toolreg": colours and ratios in the report
    call: Callable[[], bytes]
    note: str = ""
    before: Callable[[], None] | None = None  # untimed, before each call
    after: Callable[[], None] | None = None  # untimed, after each call
    close: Callable[[], None] = field(default=lambda: None)


def docker_run(run_id: str) -> Method:
    def call() -> bytes:
        out = subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "-i",
                "--label",
                f"{BENCH_LABEL}={run_id}",
                *DOCKER_RUN_FLAGS,
                IMAGE,
                *COMMAND,
            ],
            input=PAYLOAD,
            capture_output=True,
            check=True,
        )
        return out.stdout

    return Method("docker run --rm", "baseline", call, "CLI, same isolation flags")


def sdk_cycle(
    client: docker.DockerClient, extra: dict[str, Any], run_id: str
) -> Callable[[], bytes]:
    """The minimal docker-py sequence that gives a fresh container its stdin
    and reads its stdout: create, attach, start, write, read, wait, remove."""
    labels = {BENCH_LABEL: run_id}

    def run() -> bytes:
        container = client.containers.create(
            IMAGE, COMMAND, stdin_open=True, labels=labels, **HARDENING, **extra
        )
        try:
            sock = container.attach_socket(params={"stdin": 1, "stdout": 1, "stream": 1})
            raw = getattr(sock, "_sock", sock)  # the plain socket under the SDK's SocketIO
            assert isinstance(raw, socket.socket)
            container.start()
            raw.sendall(PAYLOAD)
            raw.shutdown(socket.SHUT_WR)
            chunks = []
            while data := raw.recv(65536):
                chunks.append(data)
            raw.close()
            container.wait()
            return b"".join(chunks)[8:]  # one multiplexed frame: 8-byte header
        finally:
            container.remove(force=True)

    return run


# --------------------------------------------------------------------- epicbox

EPICBOX_PROFILE = "bench_cat"
# epicbox limits: cputime in seconds (an RLIMIT_CPU ulimit), realtime in
# seconds (its own poll loop), memory in MiB, processes (pids limit).
EPICBOX_LIMITS = {"cputime": 10, "realtime": 10, "memory": 256, "processes": 64}


def epicbox_run() -> Method:
    try:
        import epicbox
        import epicbox.utils
    except ImportError as exc:
        raise Unavailable(f"epicbox not installed ({exc}): pip install -e '.[bench]'") from None
    note = "user 65534, read-only root, network disabled; no cap-drop/no-new-privileges option"
    if not _retry_accepts("method_whitelist"):
        # epicbox 1.1.0 (its last release, 2019) builds urllib3's Retry with
        # method_whitelist, which urllib3 2 removed: every run() raises
        # TypeError. The shim maps it to the new name and changes nothing else
        # (the retrying adapter is mounted on http:// only, which the unix
        # socket transport never uses).
        epicbox.utils.Retry = _CompatRetry
        note += "; shim: urllib3 2 Retry(method_whitelist=) -> allowed_methods"
    epicbox.configure(
        profiles=[
            epicbox.Profile(
                EPICBOX_PROFILE,
                IMAGE,
                user="65534:65534",
                read_only=True,
                network_disabled=True,
            )
        ]
    )

    def call() -> bytes:
        # epicbox runs ["/bin/sh", "-c", command]; it never pulls (create
        # fails with ImageNotFound when the image is missing).
        result = epicbox.run(
            EPICBOX_PROFILE, " ".join(COMMAND), stdin=PAYLOAD, limits=dict(EPICBOX_LIMITS)
        )
        if result["exit_code"] != 0:
            raise RuntimeError(f"epicbox: {result}")
        return bytes(result["stdout"])

    return Method("epicbox run", "baseline", call, note)


def _retry_accepts(name: str) -> bool:
    from urllib3.util.retry import Retry

    try:
        Retry(**{name: False})  # type: ignore[arg-type]  # probing a keyword by name
    except TypeError:
        return False
    return True


def _compat_retry_class() -> type:
    from urllib3.util.retry import Retry

    class CompatRetry(Retry):
        def __init__(self, *args: Any, method_whitelist: Any = None, **kwargs: Any) -> None:
            if method_whitelist is not None:
                kwargs.setdefault("allowed_methods", method_whitelist)
            super().__init__(*args, **kwargs)

    return CompatRetry


_CompatRetry = _compat_retry_class()


# ----------------------------------------------------------------- llm-sandbox


def _llm_runtime_configs(run_id: str) -> dict[str, Any]:
    return {
        **HARDENING,
        "labels": {BENCH_LABEL: run_id},
        # llm-sandbox keeps a container alive (tty, the image's CMD) and stops
        # it on close with `docker stop`: a shell as PID 1 ignores SIGTERM, so
        # every close would wait the full 10 s grace. An init process and a
        # plain sleep make the stop prompt, as a user would configure it.
        "init": True,
        "command": ["sleep", "3600"],
    }


def llm_sandbox_session(client: docker.DockerClient, run_id: str) -> Method:
    try:
        from llm_sandbox.docker import SandboxDockerSession
    except ImportError as exc:
        raise Unavailable(f"llm-sandbox not installed ({exc}): pip install -e '.[bench]'") from None

    def call() -> bytes:
        with SandboxDockerSession(
            client=client,  # refuses pulls: the image is found locally first
            image=IMAGE,
            lang="python",  # only picks a handler; no Python runs with this setup skipped
            skip_environment_setup=True,
            runtime_configs=_llm_runtime_configs(run_id),
            workdir="/tmp",
        ) as session:
            out = session.execute_command(EXEC_COMMAND)
        if out.exit_code:
            raise RuntimeError(f"llm-sandbox: exit {out.exit_code}: {out.stderr}")
        return str(out.stdout).encode()

    return Method(
        "llm-sandbox session per call",
        "baseline",
        call,
        "create+start, docker exec, stop+remove; same isolation flags + init",
    )


def llm_sandbox_pooled(
    client: docker.DockerClient, run_id: str, *, size: int, single_use: bool
) -> Method:
    try:
        from llm_sandbox.pool import PoolConfig, PooledSandboxSession, create_pool_manager
    except ImportError as exc:
        raise Unavailable(f"this llm-sandbox has no pooled mode ({exc})") from None
    config = PoolConfig(
        max_pool_size=size,
        min_pool_size=size,
        # None (the default) reuses a container for any number of calls.
        max_container_uses=1 if single_use else None,
    )
    pool = create_pool_manager(
        client=client,
        config=config,
        lang="python",
        image=IMAGE,
        runtime_configs=_llm_runtime_configs(run_id),
        skip_environment_setup=True,
    )
    deadline = time.monotonic() + POOL_READY_TIMEOUT_S
    while pool.get_stats()["state_counts"]["idle"] < size:
        if time.monotonic() > deadline:
            pool.close()
            raise Unavailable(f"llm-sandbox pool did not pre-warm {size} containers in time")
        time.sleep(0.05)

    def call() -> bytes:
        with PooledSandboxSession(pool_manager=pool, workdir="/tmp") as session:
            out = session.execute_command(EXEC_COMMAND)
        if out.exit_code:
            raise RuntimeError(f"llm-sandbox pooled: exit {out.exit_code}: {out.stderr}")
        return str(out.stdout).encode()

    def close() -> None:
        with contextlib.suppress(Exception):
            pool.close()

    if single_use:
        name = f"llm-sandbox pooled ({size}), single-use"
        note = "max_container_uses=1: release destroys and re-creates inline"
    else:
        name = f"llm-sandbox pooled ({size})"
        note = "default: containers REUSED across calls (docker exec)"
    return Method(name, "baseline", call, note, close=close)

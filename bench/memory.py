"""Memory: the server's RSS (VmRSS of its process) empty, with 1,000 tools,
and with a pool of 8 warm containers on top; and what one idle warm
container costs the host (its cgroup v1 memory, and `docker stats`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import docker

from bench.common import (
    BENCH_LABEL,
    COMMAND,
    HARDENING,
    IMAGE,
    TOOLREG_EXTRAS,
    Server,
    definition,
)

WARM_POOL = 8  # warm containers the server holds for the RSS figure
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
KIB = 1024  # bytes


def container_memory(client: docker.DockerClient, container_id: str) -> dict[str, Any]:
    """Bytes charged to the container's memory cgroup, read two ways."""
    out: dict[str, Any] = {"container": container_id[:12]}
    cg = _cgroup_dir(container_id)
    if cg is not None:
        stat = dict(
            (k, int(v))
            for k, v in (line.split() for line in (cg / "memory.stat").read_text().splitlines())
        )
        usage = int((cg / "memory.usage_in_bytes").read_text())
        out["cgroup_usage_kib"] = usage // KIB
        out["cgroup_rss_kib"] = stat.get("total_rss", stat.get("rss", 0)) // KIB
        out["cgroup_cache_kib"] = stat.get("total_cache", stat.get("cache", 0)) // KIB
        out["cgroup_dir"] = str(cg)
    else:
        out["cgroup"] = "no cgroup v1 memory directory found for the container"
    stats = client.api.stats(container_id, stream=False, one_shot=True)
    mem = stats.get("memory_stats") or {}
    usage = int(mem.get("usage", 0))
    inactive = int((mem.get("stats") or {}).get("total_inactive_file", 0))
    out["docker_stats_kib"] = (usage - inactive) // KIB  # what `docker stats` shows on v1
    # Outside the cgroup: the engine's per-container shim (and, under runsc,
    # gVisor's sandbox and gofer), found by the id on their command line.
    procs = _host_processes(container_id)
    out["host_processes"] = sorted(name for name, _ in procs)
    out["host_processes_rss_kib"] = sum(kib for _, kib in procs)
    return out


def _host_processes(container_id: str) -> list[tuple[str, int]]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if container_id.encode() not in cmdline:
                continue
            rss = 0
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
            found.append((Path(cmdline.split(b"\0")[0].decode(errors="replace")).name, rss))
        except OSError:
            continue
    return found


def _cgroup_dir(container_id: str) -> Path | None:
    for candidate in (
        CGROUP_V1_MEMORY / "docker" / container_id,
        CGROUP_V1_MEMORY / "system.slice" / f"docker-{container_id}.scope",
    ):
        if (candidate / "memory.usage_in_bytes").exists():
            return candidate
    return None


def stand_in(client: docker.DockerClient, run_id: str) -> dict[str, Any]:
    """A container made as a warm one is (toolreg's config, started, `cat`
    blocked on its open stdin), straight through the SDK: the floor any
    pool implementation pays per idle container."""
    container = client.containers.create(
        IMAGE,
        COMMAND,
        stdin_open=True,
        labels={BENCH_LABEL: run_id},
        **HARDENING,
        **TOOLREG_EXTRAS,
    )
    sock = None
    try:
        sock = container.attach_socket(params={"stdin": 1, "stdout": 1, "stream": 1})
        container.start()
        time.sleep(0.5)  # let the process settle into its read()
        assert container.id is not None
        return container_memory(client, container.id)
    finally:
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.close()
        container.remove(force=True)


def run(
    srv: Server, rss_empty_kib: int, run_id: str, engine: docker.DockerClient
) -> dict[str, Any]:
    out: dict[str, Any] = {"rss_empty_kib": rss_empty_kib, "rss_tools_kib": srv.rss_kib()}
    before = srv.steady_count(timeout_s=5)
    srv.register(definition("bench_echo_pool", warm_pool=WARM_POOL))
    held = srv.steady_count(timeout_s=60, quiet_s=2.0)
    out["warm_pool_registered"] = WARM_POOL
    out["warm_containers_running"] = held - before
    out["rss_tools_pool_kib"] = srv.rss_kib()
    idle = srv.containers()
    if idle:
        out["warm_container"] = container_memory(engine, idle[0]["Id"])
        out["warm_containers_measured"] = [
            container_memory(engine, c["Id"]) for c in idle[: min(len(idle), WARM_POOL)]
        ]
    else:
        out["warm_container"] = None
        out["warm_container_missing"] = (
            f"registered warm_pool={WARM_POOL} but the server runs no container while idle"
            " (no warm pool in this build): only the stand-in below is measured"
        )
    out["stand_in_container"] = stand_in(engine, run_id)
    return out

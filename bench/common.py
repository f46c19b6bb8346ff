"""What every benchmark section shares: the workload, the isolation flags the
baselines get, statistics, and a toolreg server process to measure against."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.wire import convert
from sandbox_runner.ownership import LABEL_OWNER_PID

IMAGE = "toolreg/base"
COMMAND = ["cat"]
PAYLOAD = b'{"message":"hello"}'
RESULTS = Path(__file__).resolve().parent / "results"
BENCH_LABEL = "io.toolreg.bench"  # on every container the harness itself creates
APPROVER = "bench"  # development-mode approver that signs the runsc calls
TOKEN_TTL_S = 300  # seconds an approval token minted here lives
SERVER_MAX_SANDBOXES = 16  # TOOLREG_MAX_SANDBOXES of every server the bench starts
SERVER_MAX_QUEUED = 64  # TOOLREG_MAX_QUEUED: concurrency 16 must never be refused
RPC_TIMEOUT_S = 60.0  # seconds any one RPC of the bench may take
REMOVAL_S = 0.3  # seconds a used container may take to be removed (untimed waits)

# The same isolation every toolreg sandbox gets (safe profile), so the
# baselines pay for the same work.
HARDENING: dict[str, Any] = {
    "network_mode": "none",
    "read_only": True,
    "user": "65534:65534",
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges"],
    "mem_limit": "256m",
    "memswap_limit": "256m",
    "nano_cpus": 1_000_000_000,
    "pids_limit": 64,
    "tmpfs": {"/tmp": "rw,noexec,nosuid,nodev,size=64m"},
}
# What toolreg adds on top (sandbox_runner.docker_backend): no network
# sandbox at all (NetworkDisabled, which spares the engine ~90 ms of network
# namespace set-up even under --network none), no log copy on disk, no IPC
# sharing, fd and file-size ulimits.
TOOLREG_EXTRAS: dict[str, Any] = {
    "network_disabled": True,
    "log_config": docker.types.LogConfig(type="none"),
    "ipc_mode": "none",
    "ulimits": [
        docker.types.Ulimit(name="nofile", soft=256, hard=256),
        docker.types.Ulimit(name="fsize", soft=16 * 1024 * 1024, hard=16 * 1024 * 1024),
    ],
}
DOCKER_RUN_FLAGS = [
    "--network", "none",
    "--read-only",
    "--user", "65534:65534",
    "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges",
    "--memory", "256m",
    "--memory-swap", "256m",
    "--cpus", "1",
    "--pids-limit", "64",
    "--tmpfs", "/tmp:rw,noexec,nosuid,nodev,size=64m",
]  # fmt: skip


# This process and the servers it started: containers they own are this run's.
OUR_PIDS: set[int] = {os.getpid()}
# The source each started server ran (the tree can change during a run).
SERVER_SOURCES: list[str] = []


class Unavailable(Exception):
    """A method cannot be measured here; the message says exactly why."""


# ------------------------------------------------------------------ statistics


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50/p95/min/max of milliseconds, rounded for the tables."""
    return {
        "p50_ms": round(statistics.median(values), 2),
        "p95_ms": round(pct(values, 0.95), 2),
        "min_ms": round(min(values), 2),
        "max_ms": round(max(values), 2),
    }


def summary_table(heading: str, first: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A report section: ``heading``, then a table of ``summary`` rows, each
    named by its "what" under the column ``first``."""
    lines = [
        "",
        f"## {heading}",
        "",
        f"| {first} | p50 ms | p95 ms | min ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['min_ms']:.1f}"
            f" | {r['max_ms']:.1f} |"
        )
    return lines


def timed_ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


# --------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        kib = int(f.readline().split()[1])
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "memory_gib": round(kib / 1024 / 1024, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    try:
        client = docker.from_env()
        try:
            ver = client.version()
            dinfo = client.info()
        finally:
            client.close()
        info["engine"] = str(ver.get("Version", "?"))
        info["engine_api"] = str(ver.get("ApiVersion", "?"))
        info["runtimes"] = sorted(dinfo.get("Runtimes") or {})
        info["cgroup"] = f"v{dinfo.get('CgroupVersion', '?')} ({dinfo.get('CgroupDriver', '?')})"
    except docker.errors.DockerException as exc:
        info["engine"] = f"unreachable ({exc})"
    return info


def source_version() -> str:
    """The commit the measured server runs from, and whether its code differs."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "status",
                "--porcelain",
                "--",
                "registry_server",
                "sandbox_runner",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" + uncommitted changes in registry_server/sandbox_runner" if dirty else "")


def package_versions(names: Sequence[str]) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def engine_client(pool: int = 8) -> docker.DockerClient:
    """An SDK client that can never pull: every bench client refuses to, so a
    library that would fall back to a pull fails loudly instead."""
    client = docker.from_env(max_pool_size=pool)

    def refuse_pull(*args: object, **kwargs: object) -> None:
        raise Unavailable(f"refused to pull {args or kwargs}: no registry is reachable here")

    client.images.pull = refuse_pull  # type: ignore[method-assign,assignment]
    client.api.pull = refuse_pull  # type: ignore[method-assign]
    return client


def require_image(client: docker.DockerClient, image: str = IMAGE) -> None:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise SystemExit(
            f"image {image} missing: run `make images` (nothing is ever pulled)"
        ) from None


def remove_leftovers(client: docker.DockerClient, run_id: str) -> int:
    """Containers the harness itself created in this run and that survived."""
    gone = 0
    for c in client.containers.list(all=True, filters={"label": f"{BENCH_LABEL}={run_id}"}):
        with contextlib.suppress(docker.errors.APIError):
            c.remove(force=True)
            gone += 1
    return gone


class Interference:
    """Samples, every few seconds, the containers on the engine that are not
    this run's (another user's tests, say): the machine is shared, and a
    number measured next to someone else's containers should say so."""

    def __init__(self, run_id: str, every_s: float = 5.0) -> None:
        self.run_id, self.every_s = run_id, every_s
        self.samples: list[tuple[float, str, int]] = []  # (seconds in, section, count)
        self.section = "start"
        self._stop = threading.Event()
        self._client = docker.from_env()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()

    def foreign(self) -> int:
        count = 0
        for c in self._client.api.containers(filters={"status": "running"}):
            labels = c.get("Labels") or {}
            names = c.get("Names") or []
            owner = labels.get(LABEL_OWNER_PID, "")
            ours = (
                labels.get(BENCH_LABEL) == self.run_id
                or (owner.isdigit() and int(owner) in OUR_PIDS)
                or any(n.lstrip("/").startswith("epicbox-") for n in names)
            )
            count += not ours
        return count

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.samples.append(
                    (round(time.monotonic() - self._started, 1), self.section, self.foreign())
                )
            self._stop.wait(self.every_s)

    def summary(self) -> dict[str, Any]:
        per: dict[str, dict[str, int]] = {}
        for _, section, count in self.samples:
            s = per.setdefault(section, {"samples": 0, "with_foreign": 0, "max_foreign": 0})
            s["samples"] += 1
            s["with_foreign"] += count > 0
            s["max_foreign"] = max(s["max_foreign"], count)
        return {
            "every_s": self.every_s,
            "per_section": per,
            "load_avg_end": os.getloadavg(),
        }


# ---------------------------------------------------------------- toolreg server


def definition(
    name: str,
    *,
    level: str = "safe",
    warm_pool: int = 0,
    description: str = "echo for benchmarks: returns its arguments",
    parameters: Mapping[str, Any] | None = None,
    categories: Sequence[str] = (),
) -> pb.Tool:
    tool = parse_definition(
        {
            "name": name,
            "description": description,
            "parameters": dict(parameters or {"type": "object"}),
            "safety_level": level,
            "categories": list(categories),
            "warm_pool": warm_pool,
            "sandbox": {"image": IMAGE, "command": COMMAND},
        }
    )
    return convert.tool_to_pb(tool)


@dataclass
class Server:
    """A `toolreg serve` child process in development mode with one trusted
    approver, and a channel to it."""

    proc: ServerProcess
    data_dir: Path
    channel: grpc.Channel
    stub: pb_grpc.ToolRegistryStub
    approver_pem: bytes
    engine: docker.DockerClient
    digests: dict[str, str] = field(default_factory=dict)
    leftovers: int = 0  # containers still there after the server stopped

    @property
    def pid(self) -> int:
        return self.proc.pid

    def register(self, tool: pb.Tool) -> pb.Tool:
        registered: pb.Tool = self.stub.RegisterTool(
            pb.RegisterToolRequest(tool=tool, replace=True), timeout=RPC_TIMEOUT_S
        )
        self.digests[registered.name] = registered.digest
        return registered

    def execute(self, name: str, tokens: Sequence[str] = ()) -> pb.ToolResult:
        result: pb.ToolResult = self.stub.ExecuteTool(
            pb.ExecuteToolRequest(
                name=name, arguments_json=PAYLOAD.decode(), approval_tokens=list(tokens)
            ),
            timeout=RPC_TIMEOUT_S,
        )
        return result

    def run(self, name: str, tokens: Sequence[str] = ()) -> bytes:
        """One timed call: its output, or RuntimeError when it did not succeed."""
        result = self.execute(name, tokens)
        if not result.success:
            raise RuntimeError(f"{name}: {result.error} (status {result.status})")
        return result.content.encode()

    def token_minter(self, name: str) -> Callable[[], str]:
        """Mints one fresh approval token per call for ``name`` with PAYLOAD as
        arguments; the digests and audience come from the server's own
        APPROVAL_REQUIRED answer, as an approver's client would get them."""
        probe = self.execute(name)
        if probe.status != pb.EXECUTION_STATUS_APPROVAL_REQUIRED:
            raise Unavailable(f"{name}: expected APPROVAL_REQUIRED, got {probe.error or probe}")
        req = probe.approval_request
        key = load_private_key(self.approver_pem)

        def token() -> str:
            return mint_for(key, issuer=APPROVER, request=req, ttl_s=TOKEN_TTL_S)

        return token

    def containers(self, status: str | None = "running") -> list[Any]:
        filters: dict[str, Any] = {"label": f"{LABEL_OWNER_PID}={self.pid}"}
        if status:
            filters["status"] = status
        # The low-level list: the high-level one inspects each container and fails on one
        # removed meanwhile (calls end and are removed in the background all the time).
        return list(self.engine.api.containers(all=status is None, filters=filters))

    def settle(self, expected: int, timeout_s: float = 5.0) -> int:
        """Wait until the server has ``expected`` containers running (its warm
        pools refilled), so its background work does not land in the next
        measurement. Returns the count seen last."""
        deadline = time.monotonic() + timeout_s
        count = len(self.containers())
        while count < expected and time.monotonic() < deadline:
            time.sleep(0.02)
            count = len(self.containers())
        return count

    def settle_after_call(self, expected: int, timeout_s: float = 5.0) -> int:
        """``settle`` after a call: a used container counts as running until it is
        removed, so settling at once can race the pool's refill and time the next
        "warm" call cold (the traces of slow warm samples showed exactly that)."""
        time.sleep(REMOVAL_S)
        return self.settle(expected, timeout_s)

    def steady_count(self, timeout_s: float = 15.0, quiet_s: float = 1.0) -> int:
        """Running containers once the number stops changing (pools filled)."""
        deadline = time.monotonic() + timeout_s
        last, since = len(self.containers()), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = len(self.containers())
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.channel.close()
        try:
            self.proc.stop()
        except Exception:
            self.proc.kill()
        # A server removes its containers (warm ones too) on SIGTERM; count
        # and clear whatever it left, since the next section must start clean.
        for c in self.containers(status=None):
            self.leftovers += 1
            with contextlib.suppress(docker.errors.APIError):
                self.engine.api.remove_container(c["Id"], force=True)
        shutil.rmtree(self.data_dir, ignore_errors=True)


@contextlib.contextmanager
def server(engine: docker.DockerClient, **env: str) -> Iterator[Server]:
    """A development-mode server with the bench's approver installed; extra
    ``TOOLREG_*`` settings come in as ``env`` (the CLI reads them)."""
    data_dir = Path(tempfile.mkdtemp(prefix="toolreg-bench-"))
    private, public = generate_keypair()
    (data_dir / "approvers").mkdir()
    (data_dir / "approvers" / f"{APPROVER}.pub").write_text(public)
    settings = {
        "TOOLREG_MAX_SANDBOXES": str(SERVER_MAX_SANDBOXES),
        "TOOLREG_MAX_QUEUED": str(SERVER_MAX_QUEUED),
        **env,
    }
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        SERVER_SOURCES.append(source_version())
        proc = spawn_server(data_dir)
        OUR_PIDS.add(proc.pid)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    channel = grpc.insecure_channel(
        proc.address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    )
    running = Server(proc, data_dir, channel, pb_grpc.ToolRegistryStub(channel), private, engine)
    try:
        yield running
    finally:
        running.stop()


class TraceCollector:
    """The tests' OTLP collector (tests/otlp_receiver.py) in a process of its
    own: decoding spans in this one would take the interpreter from the calls
    being timed. ``env`` sends a server's spans there; ``finish()`` stops it and
    returns its output lines (with ``dump``, a JSON line per span, then the count)."""

    def __init__(self, *, dump: bool = False) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.otlp_receiver", *(["--dump"] if dump else [])],
            cwd=RESULTS.parents[1], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        self.env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self._proc.stdout.readline().strip(),
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }

    def finish(self) -> list[str]:
        out, _ = self._proc.communicate(timeout=60)
        return out.splitlines()


def standalone(
    prog: str,
    description: str | None,
    run: Callable[[int], dict[str, Any]],
    report_md: Callable[[dict[str, Any]], list[str]],
    *,
    runs: int,
    runs_help: str,
    argv: Sequence[str] | None = None,
) -> None:
    """``python -m bench.<section>``: one section alone, ``--runs`` and ``--json``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--runs", type=int, default=runs, help=runs_help)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args.runs)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(report_md(result)))

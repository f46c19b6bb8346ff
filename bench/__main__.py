"""Cold-path latency: toolreg's ExecuteTool against the baselines it must not
fall far behind, measured interleaved in one run on the same image, command,
input and isolation flags, so machine noise hits every method alike.

Writes bench/results/cold-<timestamp>.{md,json} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import docker
import grpc

from registry_server import convert
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.launcher import spawn_server
from registry_server.models import parse_definition
from sandbox_runner import SAFE_LIMITS, SandboxSpec
from sandbox_runner.docker_backend import DockerRunner

IMAGE = "toolreg/base"
COMMAND = ["cat"]
PAYLOAD = b'{"message":"hello"}'
RESULTS = Path(__file__).resolve().parent / "results"
# The same isolation every toolreg sandbox gets (safe profile), so the
# baselines pay for the same work.
HARDENING = {
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
TOOLREG_EXTRAS = {
    "network_disabled": True,
    "log_config": docker.types.LogConfig(type="none"),
    "ipc_mode": "none",
    "ulimits": [
        docker.types.Ulimit(name="nofile", soft=256, hard=256),
        docker.types.Ulimit(name="fsize", soft=16 * 1024 * 1024, hard=16 * 1024 * 1024),
    ],
}
DOCKER_RUN_FLAGS = [
    "--network",
    "none",
    "--read-only",
    "--user",
    "65534:65534",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--memory",
    "256m",
    "--memory-swap",
    "256m",
    "--cpus",
    "1",
    "--pids-limit",
    "64",
    "--tmpfs",
    "/tmp:rw,noexec,nosuid,nodev,size=64m",
]


def docker_run() -> bytes:
    out = subprocess.run(
        ["docker", "run", "--rm", "-i", *DOCKER_RUN_FLAGS, IMAGE, *COMMAND],
        input=PAYLOAD,
        capture_output=True,
        check=True,
    )
    return out.stdout


def sdk_cycle(client: docker.DockerClient, extra: dict[str, object]) -> Callable[[], bytes]:
    """The minimal docker-py sequence that gives a fresh container its stdin
    and reads its stdout: create, attach, start, write, read, wait, remove."""

    def run() -> bytes:
        container = client.containers.create(
            IMAGE,
            COMMAND,
            stdin_open=True,
            **HARDENING,
            **extra,  # type: ignore[arg-type]
        )
        try:
            sock = container.attach_socket(params={"stdin": 1, "stdout": 1, "stream": 1})
            raw: socket.socket = sock._sock
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


def runner_call(runner: DockerRunner) -> Callable[[], bytes]:
    spec = SandboxSpec(
        image=IMAGE, command=tuple(COMMAND), env=(), limits=SAFE_LIMITS, input=PAYLOAD
    )

    def run() -> bytes:
        return runner.run(spec, execution_id=uuid.uuid4().hex).stdout

    return run


def toolreg_call(stub: pb_grpc.ToolRegistryStub) -> Callable[[], bytes]:
    def run() -> bytes:
        result = stub.ExecuteTool(
            pb.ExecuteToolRequest(name="bench_echo", arguments_json=PAYLOAD.decode())
        )
        if not result.success:
            raise RuntimeError(result.error)
        return result.content.encode()

    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=40, help="measured calls per method")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured calls per method first")
    args = parser.parse_args()

    client = docker.from_env(max_pool_size=4)
    runner = DockerRunner(instance_id=f"bench-{uuid.uuid4().hex[:8]}")
    server = spawn_server(Path(tempfile.mkdtemp(prefix="toolreg-bench-")))
    address = server.address
    try:
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.ToolRegistryStub(channel)
        tool = parse_definition(
            {
                "name": "bench_echo",
                "description": "echo for benchmarks",
                "parameters": {"type": "object"},
                "sandbox": {"image": IMAGE, "command": COMMAND},
            }
        )
        stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=True))
        methods: dict[str, Callable[[], bytes]] = {
            "docker run --rm": docker_run,
            "docker SDK cycle": sdk_cycle(client, {}),
            "docker SDK cycle, toolreg's container config": sdk_cycle(client, TOOLREG_EXTRAS),
            "sandbox_runner.run in-process (no gRPC)": runner_call(runner),
            "toolreg ExecuteTool (cold)": toolreg_call(stub),
        }
        for name, fn in methods.items():
            for _ in range(args.warmup):
                out = fn()
            assert out.strip() == PAYLOAD, f"{name} returned {out!r}"
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.runs):  # interleaved: noise hits every method alike
            for name, fn in methods.items():
                started = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - started) * 1000)
        channel.close()
    finally:
        server.stop()
        client.close()
        runner.close()

    base = statistics.median(samples["docker SDK cycle"])
    server_overhead = statistics.median(samples["toolreg ExecuteTool (cold)"]) / statistics.median(
        samples["sandbox_runner.run in-process (no gRPC)"]
    )
    rows = []
    for name, values in samples.items():
        p50 = statistics.median(values)
        rows.append(
            {
                "method": name,
                "runs": len(values),
                "p50_ms": round(p50, 1),
                "p95_ms": round(pct(values, 0.95), 1),
                "p50_vs_sdk": round(p50 / base, 3),
            }
        )
    when = datetime.now(UTC)
    machine = f"{os.cpu_count()} cores, {_mem_gib()} GiB, {platform.system()} {platform.release()}"
    engine = client_version()
    lines = [
        f"Cold path, {when:%Y-%m-%d %H:%M} UTC, {machine}, Docker {engine}; "
        f"image {IMAGE}, command {' '.join(COMMAND)}, {args.runs} interleaved runs each",
        "",
        "| method | runs | p50 ms | p95 ms | p50 / SDK cycle |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {r['method']} | {r['runs']} | {r['p50_ms']} | {r['p95_ms']}"
            f" | {r['p50_vs_sdk']:.2f}x |"
            for r in rows
        ),
    ]
    lines += [
        "",
        f"What the gRPC server adds: ExecuteTool p50 / runner.run p50 = {server_overhead:.2f}x.",
        "The SDK cycles are docker-py's create, attach, start, wait, remove, same isolation;",
        "toolreg's config adds NetworkDisabled (no network sandbox: most of the gap), log driver",
        "none, ipc none and ulimits. docker run cannot set NetworkDisabled.",
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"cold-{when:%Y%m%dT%H%M%S}"
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps(
            {
                "when": when.isoformat(),
                "machine": machine,
                "engine": engine,
                "rows": rows,
                "server_overhead": round(server_overhead, 3),
                "samples_ms": samples,
            },
            indent=2,
        )
    )
    print(f"\nwritten: {stem}.md, {stem}.json")


def _mem_gib() -> int:
    with open("/proc/meminfo") as f:
        kib = int(f.readline().split()[1])
    return round(kib / 1024 / 1024)


def client_version() -> str:
    try:
        return str(docker.from_env().version().get("Version", "?"))
    except docker.errors.DockerException:
        return "?"


if __name__ == "__main__":
    main()

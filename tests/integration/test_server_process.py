"""The `toolreg` command as users run it: a real server process and the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from registry_server.cli.launcher import ServerProcess, spawn_server

ROOT = Path(__file__).resolve().parents[2]
TOOLREG = [sys.executable, "-m", "registry_server.cli"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerProcess]:
    server = spawn_server(tmp_path / "data", "--tools", str(ROOT / "examples" / "tools"), cwd=ROOT)
    yield server
    server.kill()


def cli(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TOOLREG_ADDRESS=address)
    return subprocess.run(
        [*TOOLREG, *args], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
    )


def test_cli_tour(served: ServerProcess, tmp_path: Path) -> None:
    listed = cli("tools", "list", address=served.address)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^echo\s+safe", listed.stdout, re.M)
    safe = cli("tools", "list", "--max-level", "safe", "--category", "text", address=served.address)
    assert safe.stdout.split()[0] == "word_count" and "run_python" not in safe.stdout
    schemas = cli("tools", "schemas", "--format", "mcp", address=served.address)
    assert '"inputSchema"' in schemas.stdout
    belt = cli("tools", "schemas", "--format", "text", address=served.address)
    assert "- write_file [dangerous]" in belt.stdout
    got = cli("tools", "get", "echo", address=served.address)
    assert '"digest"' in got.stdout

    manifest = tmp_path / "greet.yaml"
    manifest.write_text(
        "name: greet\ndescription: Says hello.\nparameters: {type: object}\n"
        "sandbox: {image: toolreg/base, command: [echo, hello]}\n"
    )
    reg = cli("tools", "register", str(manifest), address=served.address)
    assert reg.returncode == 0 and reg.stdout.startswith("registered greet")
    manifest.write_text(manifest.read_text().replace("Says hello.", "Greets."))
    dup = cli("tools", "register", str(manifest), address=served.address)
    assert dup.returncode == 1 and "ALREADY_EXISTS" in dup.stderr and "Traceback" not in dup.stderr
    assert (
        cli("tools", "register", str(manifest), "--replace", address=served.address).returncode == 0
    )


def test_cli_errors_are_one_clear_line(served: ServerProcess, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: Bad\ndescription: x\nparameters: {type: object}\nsandbox: {image: i, command: [c]}\n"
        "extra: 1\n"
    )
    out = cli("tools", "register", str(bad), address=served.address)
    assert out.returncode == 2
    assert str(bad) in out.stderr and "extra: unknown key" in out.stderr and "name:" in out.stderr
    missing = cli("tools", "get", "nope", address=served.address)
    assert (
        missing.returncode == 1
        and missing.stderr.strip() == "toolreg: NOT_FOUND: Tool 'nope' not found"
    )
    level = cli("tools", "list", "--max-level", "scary", address=served.address)
    assert level.returncode == 2 and "--max-level" in level.stderr
    down = cli("tools", "list", address="127.0.0.1:1")
    assert down.returncode == 1 and "cannot reach the toolreg server" in down.stderr
    assert all("Traceback" not in r.stderr for r in (out, missing, level, down))


def test_health_and_reflection(served: ServerProcess) -> None:
    with grpc.insecure_channel(served.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "toolregistry.v1.ToolRegistry"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (resp,) = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in resp.list_services_response.service}
        assert "toolregistry.v1.ToolRegistry" in names
        (resp,) = list(
            refl.ServerReflectionInfo(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol="toolregistry.v1.ToolRegistry"
                        )
                    ]
                ),
                timeout=10,
            )
        )
        assert resp.file_descriptor_response.file_descriptor_proto


def test_sigterm_stops_gracefully(served: ServerProcess) -> None:
    assert served.stop() == 0
    deadline = time.monotonic() + 5
    while not any("toolreg stopped" in line for line in served.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("toolreg stopped" in line for line in served.log)


def test_buf_curl_lists_tools_through_reflection(served: ServerProcess) -> None:
    """A client that has only the server's reflection (no .proto, no Python)."""
    buf = Path(sys.executable).parent / "buf"
    out = subprocess.run(
        [str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
         "--data", '{"max_safety_level": "SAFETY_LEVEL_SAFE"}',
         f"http://{served.address}/toolregistry.v1.ToolRegistry/ListTools"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    names = [t["name"] for t in json.loads(out.stdout)["tools"]]
    assert names == ["echo", "word_count"]

"""Faults: the server killed with SIGKILL during writes (store, audit chain and
used nonces intact after restart), and a full disk for the data directory."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server
from registry_server.cli.launcher import spawn_server
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests.integration.conftest import StartServer, start_server  # noqa: F401
from tests.security.conftest import engine, sign_request  # noqa: F401

pytestmark = pytest.mark.fault

APPROVER = "crasher"
WRITERS = 4  # client threads registering and executing at once
KILL_AFTER_S = 4.0  # seconds of writes before SIGKILL
FIRST_WRITES_S = 60.0  # seconds the writers may take to get one write of each kind through
TMPFS_SIZE = "2m"  # the "disk" for the full-disk test


def _tool(name: str, level: str = "safe") -> pb.Tool:
    return convert.tool_to_pb(
        parse_definition(
            {
                "name": name,
                "description": f"crash test {name}",
                "parameters": {"type": "object"},
                "safety_level": level,
                "sandbox": {"image": "toolreg/base", "command": ["cat"]},
            }
        )
    )


def _writer(
    stub: pb_grpc.ToolRegistryStub,
    key: bytes,
    index: int,
    stop: threading.Event,
    registered: list[str],
    used: list[tuple[str, str]],
) -> None:
    """Register tools and run the dangerous echo until told to stop or the
    server goes away; record every write the server acknowledged."""
    i = 0
    while not stop.is_set() and i < 500:  # bounded
        i += 1
        try:
            name = f"crash_{index}_{i}"
            stub.RegisterTool(pb.RegisterToolRequest(tool=_tool(name)), timeout=10)
            registered.append(name)
            args = json.dumps({"writer": index, "call": i})
            first = stub.ExecuteTool(
                pb.ExecuteToolRequest(name="echo", arguments_json=args), timeout=30
            )
            assert first.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, first.error
            token = sign_request(key, APPROVER, first.approval_request)
            result = stub.ExecuteTool(
                pb.ExecuteToolRequest(name="echo", arguments_json=args, approval_tokens=[token]),
                timeout=30,
            )
            if result.success:
                used.append((args, token))
        except grpc.RpcError:
            return  # the server was killed


def test_sigkill_during_writes_keeps_store_audit_and_nonces(
    engine: docker.DockerClient,  # noqa: F811
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    private, public = generate_keypair()
    (data / "approvers").mkdir(parents=True)
    (data / "approvers" / f"{APPROVER}.pub").write_text(public)

    proc = spawn_server(data)
    registered: list[str] = []
    used: list[tuple[str, str]] = []
    try:
        channel = grpc.insecure_channel(proc.address)
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = pb_grpc.ToolRegistryStub(channel)
        stub.RegisterTool(pb.RegisterToolRequest(tool=_tool("echo", "dangerous")), timeout=10)
        stop = threading.Event()
        threads = [
            threading.Thread(target=_writer, args=(stub, private, n, stop, registered, used))
            for n in range(WRITERS)
        ]
        for t in threads:
            t.start()
        time.sleep(KILL_AFTER_S)
        # The writers' first approved call (two RPCs and a sandbox under gVisor)
        # can take longer than that on a busy machine: kill once there is one of
        # each to check afterwards, while they go on writing.
        deadline = time.monotonic() + FIRST_WRITES_S
        while not (registered and used) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()  # SIGKILL, mid-write
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        channel.close()
    finally:
        proc.kill()
    assert registered, "no registration was acknowledged before the kill"
    assert used, "no approved call completed before the kill"
    print(
        f"acknowledged before SIGKILL: {len(registered)} registrations, {len(used)} approved calls"
    )

    # (a) the audit chain is intact
    verify = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "audit", "verify", "--data-dir", str(data)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # (b) every acknowledged registration survived; (c) every used token stays used
    server, port, app = create_server(
        ServerConfig(host="127.0.0.1", port=0, data_dir=data, max_warm=0)
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = pb_grpc.ToolRegistryStub(channel)
        names = {t.name for t in stub.ListTools(pb.ListToolsRequest(), timeout=10).tools}
        missing = set(registered) - names
        assert not missing, f"acknowledged registrations lost: {sorted(missing)}"
        for args, token in used:
            again = stub.ExecuteTool(
                pb.ExecuteToolRequest(name="echo", arguments_json=args, approval_tokens=[token]),
                timeout=30,
            )
            assert again.status == pb.EXECUTION_STATUS_APPROVAL_DENIED, (again.status, again.error)
            assert "replay" in again.error.lower(), again.error
    finally:
        channel.close()
        server.stop(grace=None).wait()
        app.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the full-disk test: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write until the filesystem is full, down to the last 512 bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 512):
            for _ in range(10_000):  # bounded: far more than the tmpfs holds
                try:
                    os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
            else:
                pytest.fail("the tmpfs never filled up")
    finally:
        os.close(fd)


def test_full_disk_is_reported_and_recovers(
    start_server: StartServer,  # noqa: F811
    engine: docker.DockerClient,  # noqa: F811
    small_disk: Path,
) -> None:
    running = start_server(data_dir=small_disk / "data", max_warm=0)
    try:
        running.stub.RegisterTool(pb.RegisterToolRequest(tool=_tool("before_full")), timeout=10)
        filler = small_disk / "filler"
        _fill(filler)

        with pytest.raises(grpc.RpcError) as caught:
            for i in range(50):  # a few writes may still fit in pages SQLite already holds
                running.stub.RegisterTool(
                    pb.RegisterToolRequest(
                        tool=convert.tool_to_pb(
                            parse_definition(
                                {
                                    "name": f"when_full_{i}",
                                    "description": "x" * 4000,
                                    "parameters": {"type": "object"},
                                    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
                                }
                            )
                        )
                    ),
                    timeout=10,
                )
        err = caught.value
        print(f"full disk refused registration after {i} successful writes")
        assert isinstance(err, grpc.Call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        message = (err.details() or "").lower()
        assert "store" in message and ("full" in message or "disk" in message), message
        assert str(small_disk / "data").lower() in message, "the error must name the file"

        # Reads still work, and the refused registration left nothing behind.
        acknowledged = {"before_full"} | {f"when_full_{n}" for n in range(i)}
        names = {t.name for t in running.stub.ListTools(pb.ListToolsRequest(), timeout=10).tools}
        assert names == acknowledged
        assert running.stub.GetTool(pb.GetToolRequest(name="before_full"), timeout=10).name

        # Space back: writes work again, in memory and on disk.
        filler.unlink()
        running.stub.RegisterTool(pb.RegisterToolRequest(tool=_tool("after_full")), timeout=10)
        running.stop()
        running = start_server(data_dir=small_disk / "data", max_warm=0)
        names = {t.name for t in running.stub.ListTools(pb.ListToolsRequest(), timeout=10).tools}
        assert names == acknowledged | {"after_full"}
    finally:
        running.stop()  # close the store before the tmpfs is unmounted

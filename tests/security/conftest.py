"""A real server on loopback with the real Docker engine behind it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.wire import convert
from tests.integration.conftest import Running, StartServer, start_server  # noqa: F401

INSTANCE_LABEL = "io.toolreg.instance"


@pytest.fixture(scope="session")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    try:
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(f"the docker tests need a running engine (make test starts one): {exc}")
    for image in ("toolreg/base", "toolreg/python"):
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            pytest.fail(f"image {image} missing: run `make images`")
    yield client
    client.close()


def labelled(engine: docker.DockerClient, label: str) -> list[str]:
    """Ids of the containers with ``label``. (The low-level list: the high-level
    one inspects each container and fails on one removed meanwhile.)"""
    return [c["Id"] for c in engine.api.containers(all=True, filters={"label": label})]


def containers_of(engine: docker.DockerClient, running: Running) -> list[str]:
    return labelled(engine, f"{INSTANCE_LABEL}={running.app.backend.instance_id}")


def wait_until_gone(
    engine: docker.DockerClient, running: Running, timeout_s: float = 15
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    left = containers_of(engine, running)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = containers_of(engine, running)
    return left


APPROVER = "tester"
_approver_keys: dict[int, bytes] = {}  # server port -> the test approver's private key


@pytest.fixture
def sandbox_server(
    start_server: StartServer,  # noqa: F811
    engine: docker.DockerClient,
    tmp_path: Path,
) -> Iterator[Running]:
    """A development-mode server that trusts one test approver, so dangerous
    tools can run here too (``execute`` signs for them)."""
    private, public = generate_keypair()
    data = tmp_path / "sandbox-data"
    (data / "approvers").mkdir(parents=True)
    (data / "approvers" / f"{APPROVER}.pub").write_text(public)
    running = start_server(data_dir=data)
    _approver_keys[running.port] = private
    yield running
    assert wait_until_gone(engine, running) == [], "containers left behind"


Register = Callable[..., str]


@pytest.fixture
def register(sandbox_server: Running) -> Register:
    """Register a shell tool on toolreg/base (or any image) and return its name."""

    def add(
        name: str,
        script: str,
        level: str = "safe",
        image: str = "toolreg/base",
        command: list[str] | None = None,
        limits: dict[str, int] | None = None,
    ) -> str:
        tool = parse_definition(
            {
                "name": name,
                "description": f"test tool {name}",
                "parameters": {"type": "object"},
                "safety_level": level,
                "sandbox": {
                    "image": image,
                    "command": command or ["sh", "-c", script],
                    "limits": limits or {},
                },
            }
        )
        sandbox_server.stub.RegisterTool(
            pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=True)
        )
        return name

    return add


def sign_request(
    private_key_pem: bytes, issuer: str, req: pb.ApprovalRequest, ttl_s: int = 300
) -> str:
    """An approval token from `issuer` for exactly what `req` asks to run."""
    return mint_for(load_private_key(private_key_pem), issuer=issuer, request=req, ttl_s=ttl_s)


def execute(running: Running, name: str, args: str = "{}", timeout: float = 60) -> pb.ToolResult:
    """Run a tool; a dangerous one is approved by the test approver first."""
    result: pb.ToolResult = running.stub.ExecuteTool(
        pb.ExecuteToolRequest(name=name, arguments_json=args), timeout=timeout
    )
    key = _approver_keys.get(running.port)
    if result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED and key is not None:
        token = sign_request(key, APPROVER, result.approval_request)
        result = running.stub.ExecuteTool(
            pb.ExecuteToolRequest(name=name, arguments_json=args, approval_tokens=[token]),
            timeout=timeout,
        )
    return result


def approvers_of(public_keys: dict[str, str]) -> list[dict[str, Any]]:
    """The policy entries of the test approvers: alice and bob in security, carol in ops."""
    groups = {"alice": "security", "bob": "security", "carol": "ops"}
    return [{"id": a, "public_key": public_keys[a], "groups": [g]} for a, g in groups.items()]


def list_over_mtls(port: int, ca_pem: bytes, cert: Any) -> grpc.StatusCode | None:
    """The status of one ListTools as the holder of ``cert`` (tests.certs.Issued)."""
    from registry_server.client.registry_client import open_channel

    channel = open_channel(
        f"localhost:{port}", tls_ca=ca_pem, tls_cert=cert.cert_pem, tls_key=cert.key_pem
    )
    try:
        pb_grpc.ToolRegistryStub(channel).ListTools(pb.ListToolsRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return rpc_code(exc)
    finally:
        channel.close()


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call) else None


__all__ = [
    "Path",
    "Register",
    "containers_of",
    "execute",
    "labelled",
    "rpc_code",
    "wait_until_gone",
]

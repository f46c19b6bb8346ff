"""A real server on loopback with the real Docker engine behind it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from registry_server import convert
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.models import parse_definition
from tests.integration.conftest import Running, StartServer, start_server  # noqa: F401

pytestmark = pytest.mark.docker
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


def containers_of(engine: docker.DockerClient, running: Running) -> list[Any]:
    label = f"{INSTANCE_LABEL}={running.app.runner.instance_id}"
    return list(engine.containers.list(all=True, filters={"label": label}))


def wait_until_gone(
    engine: docker.DockerClient, running: Running, timeout_s: float = 15
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    left = containers_of(engine, running)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = containers_of(engine, running)
    return left


@pytest.fixture
def sandbox_server(start_server: StartServer, engine: docker.DockerClient) -> Iterator[Running]:  # noqa: F811
    running = start_server()
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


def execute(running: Running, name: str, args: str = "{}", timeout: float = 60) -> pb.ToolResult:
    result: pb.ToolResult = running.stub.ExecuteTool(
        pb.ExecuteToolRequest(name=name, arguments_json=args), timeout=timeout
    )
    return result


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call) else None


__all__ = ["Path", "Register", "containers_of", "execute", "rpc_code", "wait_until_gone"]

"""A real gRPC server, in-process on a free loopback port, with a real SQLite file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import App
from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server


@dataclass
class Running:
    server: grpc.Server
    port: int
    app: App
    channel: grpc.Channel
    stub: pb_grpc.ToolRegistryStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    stopped: bool = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.channel.close()
        self.server.stop(grace=None).wait()
        self.app.close()


StartServer = Callable[..., Running]


def start_running(data_dir: Path, **settings: Any) -> Running:
    """A server in this process on a free loopback port, started; stop() it."""
    settings.setdefault("host", "127.0.0.1")
    config = ServerConfig(port=0, data_dir=data_dir, **settings)
    server, port, app = create_server(config)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    if "tls_cert" not in settings:  # a TLS server never answers a plaintext channel
        grpc.channel_ready_future(channel).result(timeout=10)
    return Running(server, port, app, channel, pb_grpc.ToolRegistryStub(channel))


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    running: list[Running] = []

    def start(data_dir: Path | None = None, **settings: Any) -> Running:
        r = start_running(data_dir or tmp_path / "data", **settings)
        running.append(r)
        return r

    yield start
    for r in running:
        r.stop()


@pytest.fixture
def server(start_server: StartServer) -> Running:
    return start_server()

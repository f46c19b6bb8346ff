"""Builds and runs the gRPC server. ``create_server`` is separate from
``serve`` so tests start a real server in-process on port 0."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.config import ServerConfig
from registry_server.execution import Executor
from registry_server.manifests import load_manifests
from registry_server.registry import RegisterOutcome, Registry
from registry_server.servicer import ToolRegistryServicer
from registry_server.store import Store

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ToolRegistry"].full_name


@dataclass
class App:
    """Everything one server owns, so it can be closed in one call."""

    config: ServerConfig
    store: Store
    registry: Registry
    executor: Executor
    health: health.HealthServicer
    closers: list[object] = field(default_factory=list)

    def close(self) -> None:
        self.health.enter_graceful_shutdown()
        self.store.close()


def build_app(config: ServerConfig) -> App:
    store = Store(config.data_dir)
    registry = Registry(store)
    if config.tools_dir is not None:
        for tool in load_manifests(config.tools_dir):
            outcome = registry.register(tool, replace=True)
            if outcome is not RegisterOutcome.UNCHANGED:
                log.info("tool %s %s from %s", tool.name, outcome.value, config.tools_dir)
    executor = Executor(registry)
    return App(config, store, registry, executor, health.HealthServicer())


def create_server(config: ServerConfig, app: App | None = None) -> tuple[grpc.Server, int, App]:
    """A started-ready (not yet started) server bound to config.host:config.port.
    Returns the server, the bound port (useful with port 0) and its App."""
    app = app or build_app(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_threads, thread_name_prefix="grpc"),
        options=[("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_ToolRegistryServicer_to_server(
        ToolRegistryServicer(app.registry, app.executor), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    app.health.set("", health_pb2.HealthCheckResponse.SERVING)
    app.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(config.address)
    if port == 0:
        app.close()
        raise OSError(f"cannot listen on {config.address}")
    return server, port, app


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then finish in-flight calls and stop."""
    server, port, app = create_server(config)
    server.start()
    log.info(
        "toolreg serving on %s:%d (data %s, %d tools)",
        config.host,
        port,
        config.data_dir,
        len(app.registry.names()),
    )
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping.wait()
    app.health.enter_graceful_shutdown()
    server.stop(config.shutdown_grace_s).wait()
    app.close()
    log.info("toolreg stopped")

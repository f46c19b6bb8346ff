"""Builds and runs the gRPC server. ``create_server`` is separate from
``serve`` so tests start a real server in-process on port 0."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api import tracing
from registry_server.api.app import App, build_app
from registry_server.api.auth import Authenticator, AuthInterceptor
from registry_server.api.config import MAX_MESSAGE_BYTES, ServerConfig
from registry_server.api.health_monitor import (
    LIVENESS_SERVICE as LIVENESS_SERVICE,  # re-exported: where tests and callers look for it
)
from registry_server.api.health_monitor import SERVICE_NAME, HealthMonitor, ServerHealth
from registry_server.api.metrics import MetricsInterceptor
from registry_server.api.policy_digest import PolicyDigestInterceptor
from registry_server.api.servicer import ToolRegistryServicer
from registry_server.domain.errors import (
    ConfigError,
)
from registry_server.domain.files import read_credential
from registry_server.store.page_key import page_tokens

log = logging.getLogger(__name__)


def create_server(config: ServerConfig, app: App | None = None) -> tuple[grpc.Server, int, App]:
    """A started-ready (not yet started) server bound to config.host:config.port.
    Returns the server, the bound port (useful with port 0) and its App."""
    app = app or build_app(config)
    interceptors: list[grpc.ServerInterceptor] = [
        MetricsInterceptor(app.metrics),  # before auth: it counts refused calls too
        AuthInterceptor(Authenticator(None if app.dev_mode else app.policy), app.refusals),
    ]
    live = app.policy
    if live is not None:
        interceptors.append(PolicyDigestInterceptor(lambda: live.current.digest))
    traced = tracing.server_interceptor()
    if traced is not None:
        interceptors.insert(0, traced)  # outermost: refused calls are spans too
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_threads, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_ToolRegistryServicer_to_server(
        ToolRegistryServicer(
            app.registry,
            app.executor,
            app.approvals,
            app.watches,
            app.policy,
            app.reloads,
            pages=page_tokens(app.store),
            calls=app.calls,
            relay=app.relay,
        ),
        server,
    )
    # Readiness ("" and SERVICE_NAME) and liveness (LIVENESS_SERVICE): health_monitor.py.
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    credentials = _tls_credentials(config)
    if credentials is None:
        port = server.add_insecure_port(config.address)
    else:
        port = server.add_secure_port(config.address, credentials)
    if port == 0:
        app.close()
        raise OSError(f"cannot listen on {config.address}")
    _start_health_monitor(app)
    if config.health_port is not None:
        try:
            _start_health_port(app, config.health_host, config.health_port)
        except OSError:
            app.close()
            raise
    if config.metrics_port is not None:
        http, app.metrics_port = app.metrics.serve(config.metrics_host, config.metrics_port)
        app.closers.insert(0, http.shutdown)
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, app.metrics_port)
    return server, port, app


def _start_health_monitor(app: App) -> None:
    """SERVING while both the container engine and the store answer: a load
    balancer takes a server whose engine or database is gone out of rotation."""

    def parts_answer() -> bool:
        engine, store = app.backend.health(), app.store.healthy()
        app.metrics.engine_up.set(1 if engine else 0)
        app.metrics.store_up.set(1 if store else 0)
        return engine and store

    monitor = HealthMonitor(parts_answer, app.health.set_healthy, app.config.health_interval_s)
    monitor.start()
    app.closers.insert(0, monitor.stop)


# The health port's own threads, so probes never wait for the main pool; as many RPCs
# at once as threads (a Watch holds one while open): more are refused, never queued.
HEALTH_PORT_THREADS = 4
# Seconds between the main thread's looks at the signals: Python runs a handler only on
# the main thread, at its next step; a signal the kernel hands to another thread (one of
# gRPC's) does not wake it, so it wakes on its own.
SIGNAL_LOOK_S = 0.5


def _start_health_port(app: App, host: str, port: int) -> None:
    """grpc.health.v1 alone, in cleartext, on a server of its own (TOOLREG_HEALTH_PORT):
    the same statuses as the main port's (one HealthServicer), for probes that cannot
    speak the main port's TLS. It serves nothing else, so no policy or credential is
    needed there, and its threads are its own, so a busy main port does not fail it."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=HEALTH_PORT_THREADS, thread_name_prefix="health"),
        maximum_concurrent_rpcs=HEALTH_PORT_THREADS,
        options=[("grpc.so_reuseport", 0)],
    )
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    app.health_port = server.add_insecure_port(address)
    if app.health_port == 0:
        raise OSError(f"cannot listen on {address} (health port)")
    server.start()
    app.closers.insert(0, lambda: _stop(server))
    log.info("gRPC health (cleartext) on %s", address)


def _stop(server: grpc.Server) -> None:
    server.stop(0).wait()


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ConfigError("TLS needs both --tls-cert and --tls-key")

    ca_file = config.tls_client_ca
    client_ca = read_credential(ca_file, "client CA") if ca_file else None
    key = read_credential(config.tls_key, "TLS key")
    return grpc.ssl_server_credentials(
        [(key, read_credential(config.tls_cert, "TLS certificate"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _start_reloader(app: App, asked: threading.Event, stopping: threading.Event) -> None:
    reloads = app.reloads
    if reloads is None:
        return

    def run() -> None:
        while not stopping.is_set():
            if asked.wait(0.5):
                asked.clear()
                log.info("received SIGHUP; reloading the policy")
                reloads.from_signal()

    threading.Thread(target=run, name="policy-reload", daemon=True).start()


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then leave: NOT_SERVING while still serving for
    config.drain_s, then stop accepting and finish in-flight calls (leave())."""
    stopping = threading.Event()
    hurry = threading.Event()  # a second signal: skip what is left of the drain window

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stopping.is_set():
            log.info("received %s again; stopping now", signal.Signals(signum).name)
            hurry.set()
            return
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stopping.set()

    # Installed before the server says it is serving, so a supervisor that
    # signals right after that line still gets a graceful stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reload_asked = threading.Event()
    # SIGHUP re-reads the policy, on a thread of its own (a handler must not
    # block, and a reload writes to the store).
    signal.signal(signal.SIGHUP, lambda _signum, _frame: reload_asked.set())
    server, port, app = create_server(config)
    _start_reloader(app, reload_asked, stopping)
    server.start()
    log.info(
        "toolreg serving on %s:%d (data %s, %d tools)",
        config.host,
        port,
        config.data_dir,
        len(app.registry.names()),
    )
    while not stopping.wait(SIGNAL_LOOK_S):
        pass
    leave(server, app.health, config, hurry)
    app.close()
    log.info("toolreg stopped")


def leave(
    server: grpc.Server, health: ServerHealth, config: ServerConfig, hurry: threading.Event
) -> None:
    """Leave without failing a call (docs/how-to/scaling.md, "Leaving without a failed
    call"). A load balancer learns that a server is gone only from its health checks, and
    sends it calls until then: a server that stopped accepting at once would fail them.
    So readiness turns NOT_SERVING first while every call is still served, for
    config.drain_s (long enough for the probers to see it: HAProxy's inter x fall, a
    readiness probe's period x failureThreshold); then the server stops accepting and
    calls in flight get config.shutdown_grace_s to finish. Nothing that asks for readiness
    (no prober in the last drain_s seconds), or a second signal: no window."""
    health.leave()
    window = config.drain_s if health.asked_within(config.drain_s) else 0.0
    if window > 0:
        log.info(
            "health NOT_SERVING; still serving calls for %.1f s (TOOLREG_DRAIN_S) so load "
            "balancers take this server out first",
            window,
        )
        if hurry.wait(window):
            log.info("drain window cut short")
    log.info(
        "no longer accepting calls; calls in flight get %.1f s (TOOLREG_SHUTDOWN_GRACE_S)",
        config.shutdown_grace_s,
    )
    server.stop(config.shutdown_grace_s).wait()

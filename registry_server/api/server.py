"""Builds and runs the gRPC server. ``create_server`` is separate from
``serve`` so tests start a real server in-process on port 0."""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.auth import Authenticator, AuthInterceptor
from registry_server.api.config import MAX_MESSAGE_BYTES, ServerConfig
from registry_server.api.health_monitor import HealthMonitor
from registry_server.api.metrics import Metrics, MetricsInterceptor
from registry_server.api.servicer import ToolRegistryServicer
from registry_server.approvals.service import Approvals
from registry_server.catalog.registry import OPERATOR, ImageCheck, RegisterOutcome, Registry
from registry_server.domain.errors import (
    ConfigError,
    EngineUnavailable,
    InvalidDefinition,
    Violation,
)
from registry_server.domain.manifests import load_manifests
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.execution.admission import Admission
from registry_server.execution.executor import Executor, SandboxPolicy
from registry_server.execution.warm_pool import WarmPools
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError, development_policy
from registry_server.store import audit_chain as audit
from registry_server.store.sqlite import Store
from sandbox_runner import Limits, SandboxError
from sandbox_runner.docker_backend import DockerRunner
from sandbox_runner.profiles import profile_for

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # the unprivileged user every sandbox runs as
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ToolRegistry"].full_name


@dataclass
class App:
    """Everything one server owns, so it can be closed in one call."""

    config: ServerConfig
    store: Store
    registry: Registry
    executor: Executor
    health: health.HealthServicer
    runner: DockerRunner
    approvals: Approvals
    dev_mode: bool = False
    pools: WarmPools | None = None
    metrics: Metrics = field(default_factory=Metrics)
    metrics_port: int | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        self.health.enter_graceful_shutdown()
        for close in self.closers:
            close()
        self.store.close()


def build_app(config: ServerConfig) -> App:
    _check_exposure(config)
    policy, dev_mode = _load_policy(config)
    require_gvisor = config.require_gvisor if config.require_gvisor is not None else not dev_mode
    try:
        runner = DockerRunner(
            instance_id=f"toolreg-{uuid.uuid4().hex[:12]}",
            base_url=config.docker_url,
            # one engine connection per running sandbox, plus reaping and pings
            max_pool_size=config.max_sandboxes + 4,
            remove_in_background=True,  # answer first; the container goes right after
            init_path=config.init_path,
        )
    except ValueError as exc:  # the sandbox init is missing or unusable
        raise ConfigError(f"{exc} (or set TOOLREG_INIT_PATH)") from None
    store = Store(config.data_dir)
    try:
        _check_audit_chain(config, store)
        registry = Registry(store, image_check=_image_check(runner))
        if config.tools_dir is not None:
            _register_operator_tools(registry, config.tools_dir)
    except BaseException:
        store.close()
        runner.close()
        raise
    _start_sandboxes(config, runner, require_gvisor)
    approvals = Approvals(store, policy, registry)
    executor = Executor(
        registry,
        runner,
        admission=Admission(config.max_sandboxes, config.max_queued, config.sandbox_memory_mb),
        policy=SandboxPolicy(
            ceilings=_ceilings(config, policy),
            require_gvisor=require_gvisor,
            workspace_dir=_prepare_workspace(config.workspace),
            workspace_tools=frozenset(config.workspace_tools),
        ),
        store=store,
        approvals=approvals,
    )
    app = App(config, store, registry, executor, health.HealthServicer(), runner, approvals)
    app.dev_mode = dev_mode
    app.closers.append(runner.close)
    executor.observe(app.metrics.observe_execution)
    if config.max_warm > 0:
        pools = WarmPools(
            runner,
            executor.warm_spec,
            executor.admission,
            default_size=config.warm_pool_default,
            max_total=config.max_warm,
            max_age_s=config.warm_max_age_s,
        )
        executor.use_pools(pools)
        registry.add_listener(pools.on_change)
        for tool in registry.list():
            pools.track(tool)
        app.pools = pools
        app.closers.insert(0, pools.close)  # before the runner's engine connection goes
    app.metrics.watch(executor.admission, app.pools.stats if app.pools else None)
    return app


def _image_check(runner: DockerRunner) -> ImageCheck:
    """Refuse images that declare a VOLUME: Docker gives each such path an
    anonymous volume, writable and unbounded despite the read-only root."""

    def check(tool: ToolDefinition) -> None:
        try:
            volumes = runner.image_volumes(tool.sandbox.image)
        except SandboxError as exc:
            raise EngineUnavailable(f"cannot check image '{tool.sandbox.image}': {exc}") from exc
        if volumes:
            rule = (
                f"image declares VOLUME {', '.join(volumes)}: an anonymous volume is writable"
                " and unbounded in a sandbox; use an image without VOLUME"
            )
            raise InvalidDefinition([Violation("sandbox.image", rule)])

    return check


def _register_operator_tools(registry: Registry, tools_dir: Path) -> None:
    """--tools: the operator's own manifests, replacing whatever holds the name."""
    for tool in load_manifests(tools_dir):
        try:
            outcome = registry.register(tool, replace=True, by=OPERATOR)
        except EngineUnavailable as exc:
            # The operator's images; every container start checks them again.
            log.warning("%s; registering %s unchecked", exc.message, tool.name)
            outcome = registry.register(tool, replace=True, by=OPERATOR, check_image=False)
        if outcome is not RegisterOutcome.UNCHANGED:
            log.info("tool %s %s from %s", tool.name, outcome.value, tools_dir)


def _check_exposure(config: ServerConfig) -> None:
    """An open tool runner must not be reachable from the network by accident."""
    loopback = config.host in ("127.0.0.1", "::1", "localhost") or config.host.startswith("127.")
    if loopback:
        return
    if config.policy_file is None:
        # Development mode trusts every caller: never beyond this machine.
        raise ConfigError(
            f"refusing to listen on {config.host} in development mode (no --policy):"
            " it trusts every caller; give a policy, and TLS, to serve the network"
        )
    if config.allow_insecure_remote:
        return
    if config.tls_cert is None:
        raise ConfigError(
            f"refusing to listen on {config.host} without TLS (--tls-cert/--tls-key) and a policy"
            " (--policy); set TOOLREG_ALLOW_INSECURE_REMOTE=true to force it"
        )


def _load_policy(config: ServerConfig) -> tuple[Policy, bool]:
    if config.policy_file is not None:
        try:
            return load_policy(config.policy_file), False
        except PolicyError as exc:
            raise ConfigError(str(exc)) from None
    keys: dict[str, str] = {}
    if config.approvers_dir.is_dir():
        keys = {p.stem: p.read_text().strip() for p in sorted(config.approvers_dir.glob("*.pub"))}
    log.warning(
        "DEVELOPMENT MODE (no --policy): loopback only, every client allowed with every role;"
        " dangerous tools need a token from one of %d approver key(s) in %s"
        " (add one with `toolreg keys generate --out FILE --install %s`)",
        len(keys), config.approvers_dir, config.data_dir,
    )  # fmt: skip
    try:
        return development_policy(audience=config.dev_audience, approvers=keys), True
    except PolicyError as exc:
        raise ConfigError(f"{config.approvers_dir}: {exc}") from None


def _check_audit_chain(config: ServerConfig, store: Store) -> None:
    verdict = audit.verify(store)
    if verdict.ok:
        log.info("%s", verdict)
        return
    if not config.allow_broken_audit:
        raise ConfigError(
            f"{verdict} in {store.path}; refusing to start. Investigate, then set"
            " TOOLREG_ALLOW_BROKEN_AUDIT=true to start anyway"
        )
    log.error("%s; starting anyway (TOOLREG_ALLOW_BROKEN_AUDIT)", verdict)


def _ceiling(policy: Policy, level: SafetyLevel) -> Limits:
    """The built-in profile of a level, with the policy's fields replacing its own."""
    override = policy.ceiling(level) or {}
    return profile_for(level.value).replace(**override)


def _ceilings(config: ServerConfig, policy: Policy) -> dict[SafetyLevel, Limits]:
    """Every level's ceiling; one that no call could ever fit in the sandbox
    memory budget is a configuration mistake, refused at start."""
    ceilings = {level: _ceiling(policy, level) for level in SafetyLevel}
    for level, limits in ceilings.items():
        if limits.memory_mb > config.sandbox_memory_mb:
            raise ConfigError(
                f"{level.value} sandboxes may use {limits.memory_mb} MiB, more than the whole"
                f" sandbox memory budget TOOLREG_SANDBOX_MEMORY_MB={config.sandbox_memory_mb}"
            )
    return ceilings


def _start_sandboxes(config: ServerConfig, runner: DockerRunner, require_gvisor: bool) -> None:
    """Reap leftovers and say what isolation dangerous tools will get."""
    try:
        if config.reap_on_start:
            removed = runner.reap()
            if removed:
                log.info("removed %d containers left behind by dead toolreg servers", removed)
        runtimes = runner.runtimes()
    except SandboxError as exc:
        # Serve the registry anyway; executions answer UNAVAILABLE until it returns.
        log.error("container engine unavailable at start-up: %s", exc)
        return
    if "runsc" in runtimes:
        log.info("dangerous tools run under gVisor (runsc)")
    elif require_gvisor:
        log.warning("gVisor (runsc) is not installed: dangerous tools will be refused")
    else:
        log.warning(
            "gVisor (runsc) is not installed: dangerous tools run under runc;"
            " set TOOLREG_REQUIRE_GVISOR=true to refuse them instead"
        )


def _prepare_workspace(path: Path) -> Path:
    """The shared workspace must be writable by the sandbox user (65534)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
    else:
        path.chmod(0o777)  # without root we cannot chown to the sandbox user
    return path


def create_server(config: ServerConfig, app: App | None = None) -> tuple[grpc.Server, int, App]:
    """A started-ready (not yet started) server bound to config.host:config.port.
    Returns the server, the bound port (useful with port 0) and its App."""
    app = app or build_app(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_threads, thread_name_prefix="grpc"),
        interceptors=[
            MetricsInterceptor(app.metrics),  # first: it counts refused calls too
            AuthInterceptor(Authenticator(None if app.dev_mode else app.approvals.policy)),
        ],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_ToolRegistryServicer_to_server(
        ToolRegistryServicer(app.registry, app.executor, app.approvals), server
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
    credentials = _tls_credentials(config)
    if credentials is None:
        port = server.add_insecure_port(config.address)
    else:
        port = server.add_secure_port(config.address, credentials)
    if port == 0:
        app.close()
        raise OSError(f"cannot listen on {config.address}")
    _start_health_monitor(app)
    if config.metrics_port is not None:
        http, app.metrics_port = app.metrics.serve(config.metrics_host, config.metrics_port)
        app.closers.insert(0, http.shutdown)
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, app.metrics_port)
    return server, port, app


def _start_health_monitor(app: App) -> None:
    def on_change(healthy: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        app.health.set("", status)
        app.health.set(SERVICE_NAME, status)
        app.metrics.engine_up.set(1 if healthy else 0)

    def engine_answers() -> bool:
        if not app.runner.ping():
            return False
        app.runner.retry_removals()  # what an engine outage kept us from removing
        return True

    monitor = HealthMonitor(engine_answers, on_change, app.config.health_interval_s)
    monitor.start()
    app.closers.insert(0, monitor.stop)


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise ConfigError("TLS needs both --tls-cert and --tls-key")

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None

    client_ca = read(config.tls_client_ca, "client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key, "TLS key"), read(config.tls_cert, "TLS certificate"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then finish in-flight calls and stop."""
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stopping.set()

    # Installed before the server says it is serving, so a supervisor that
    # signals right after that line still gets a graceful stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server, port, app = create_server(config)
    server.start()
    log.info(
        "toolreg serving on %s:%d (data %s, %d tools)",
        config.host,
        port,
        config.data_dir,
        len(app.registry.names()),
    )
    stopping.wait()
    app.health.enter_graceful_shutdown()
    server.stop(config.shutdown_grace_s).wait()
    app.close()
    log.info("toolreg stopped")

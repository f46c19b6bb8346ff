"""The composition root: the one place that picks the store and the sandbox
backend from configuration and wires the server's parts together
(docs/explanation/architecture.md). ``api/server.py`` puts the result behind gRPC."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from registry_server.api import staging
from registry_server.api.config import ServerConfig
from registry_server.api.health_monitor import ServerHealth
from registry_server.api.metrics import Metrics
from registry_server.api.policy_reload import PolicyReloads
from registry_server.approvals.events import ExpirySweeper
from registry_server.approvals.service import Approvals
from registry_server.approvals.watch import Watches
from registry_server.catalog.registry import OPERATOR, ImageCheck, RegisterOutcome, Registry
from registry_server.domain.errors import (
    ConfigError,
    EngineUnavailable,
    InvalidDefinition,
    StoreError,
    Violation,
)
from registry_server.domain.manifests import load_manifests
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.execution.admission import Admission
from registry_server.execution.call_log import CallLog
from registry_server.execution.call_relay import CallRelay
from registry_server.execution.executor import Executor
from registry_server.execution.heavy_gate import HeavyGate
from registry_server.execution.heavy_work import HeavyWork, Workers
from registry_server.execution.quotas import RateLimits, Shares
from registry_server.execution.refusal_log import RefusalLog
from registry_server.execution.sandbox_plan import SandboxPolicy, runsc_net_problem
from registry_server.execution.secrets import SecretStore
from registry_server.execution.warm_pool import WarmPools
from registry_server.notify.dispatcher import Dispatcher
from registry_server.notify.endpoints import Endpoint, load_endpoints
from registry_server.notify.outbox import Outbox
from registry_server.notify.siem import ocsf
from registry_server.notify.siem.exporter import Exporter
from registry_server.notify.siem.metrics import ExportMetrics
from registry_server.notify.siem.sinks import JsonlSink, Sink, SinkError, SyslogTls, SyslogTlsSink
from registry_server.notify.witnesses import WitnessEndpoint, WitnessSubmitter, parse_witness
from registry_server.policy.clients import UNRESTRICTED
from registry_server.policy.live import LivePolicy
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError, development_policy
from registry_server.signing.keys import is_encrypted, load_private_key
from registry_server.signing.notes import NoteError, Signer, check_key_name
from registry_server.store import audit_tree
from registry_server.store.base import Store
from registry_server.store.inspect import POSTGRES_URL_PREFIXES, sqlite_path
from registry_server.store.remembered import StoredIdentities
from registry_server.store.sqlite import SqliteStore
from sandbox_runner import Limits, SandboxBackend, SandboxError
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.egress.gateway import PROXY_PACKAGE_DIR, EgressConfig
from sandbox_runner.pieces import engine_fix, gvisor_fix
from sandbox_runner.profiles import (
    GVISOR,
    GVISOR_NET,
    HOSTINET,
    NETSTACK,
    gvisor_network,
    profile_for,
)

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # the unprivileged user every sandbox runs as


@dataclass
class App:
    """Everything one server owns, so it can be closed in one call."""

    config: ServerConfig
    store: Store
    registry: Registry
    executor: Executor
    health: ServerHealth
    backend: SandboxBackend
    approvals: Approvals
    dev_mode: bool = False
    pools: WarmPools | None = None
    metrics: Metrics = field(default_factory=Metrics)
    metrics_port: int | None = None
    health_port: int | None = None  # the cleartext health port's, when it listens
    closers: list[Callable[[], None]] = field(default_factory=list)
    watches: Watches | None = None
    policy: LivePolicy | None = None  # the policy in force (reloadable)
    reloads: PolicyReloads | None = None
    checkpointer: audit_tree.Checkpointer | None = None  # signs the audit log's checkpoints
    exporters: list[Exporter] = field(default_factory=list)  # SIEM export, one per destination
    calls: CallLog = field(default_factory=CallLog)  # streamed calls kept for AttachExecution
    relay: CallRelay | None = None  # publishes them to a shared store (PostgreSQL)
    refusals: RefusalLog | None = None  # refused requests on the record, folded

    def close(self) -> None:
        self.health.enter_graceful_shutdown()
        for close in self.closers:
            close()
        self.store.close()


def build_app(config: ServerConfig) -> App:
    _check_exposure(config)
    dev_mode = config.policy_file is None
    try:
        live = LivePolicy(lambda: _read_policy(config))
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    policy = live.current
    if dev_mode:
        _warn_development_mode(config, policy)
    webhooks = _webhook_endpoints(policy)  # their secrets first: no secret, no server
    require_gvisor = config.require_gvisor if config.require_gvisor is not None else not dev_mode
    log_signer = _log_signer(config, policy)  # the key file first: no key, no server
    witnesses = _witnesses(config, log_signer)
    export_sinks = _export_sinks(config)  # and the SIEM's CA and client key
    backend = open_backend(config)
    store = open_store(config.store)
    # Group-mapped IdP clients outlive this process and reach every server on the store.
    live.current.seen.remember_in(StoredIdentities(store))
    try:
        audit_start = _check_audit_log(config, store, log_signer)
        registry = Registry(
            store, image_check=_image_check(backend), egress=lambda: live.current.egress
        )
        if config.tools_dir is not None:
            _register_operator_tools(registry, config.tools_dir)
    except BaseException:
        store.close()
        backend.close()
        raise
    _start_sandboxes(config, backend, require_gvisor)
    approvals = Approvals(store, live, registry)
    watches = Watches(approvals, max_watches=config.max_watches)
    sweeper = ExpirySweeper(store, approvals.hub, approvals.hooks)
    shares = Shares(live, config.max_sandboxes, config.max_queued)
    sandboxes = _SandboxPolicies(config, require_gvisor, dev_mode)
    rates = RateLimits(shares.rate)
    heavy = HeavyWork(
        HeavyGate(
            config.heavy_turns, config.heavy_max_queued, config.heavy_queue_per_client,
            config.heavy_wait_s,
        ),
        Workers(config.heavy_turns),
        config.heavy_arguments_bytes,
    )  # fmt: skip
    executor = Executor(
        registry,
        backend,
        admission=Admission(
            config.max_sandboxes,
            config.max_queued,
            config.sandbox_memory_mb,
            limits_of=shares.limits,
        ),
        policy=sandboxes.of(policy),
        store=store,
        approvals=approvals,
        rates=rates,
        heavy=heavy,
    )
    app = App(config, store, registry, executor, ServerHealth(), backend, approvals)
    app.dev_mode = dev_mode
    app.watches = watches
    app.policy = live
    # What was derived from the policy is derived again on each reload.
    live.on_reload(lambda new: executor.use_sandbox_policy(sandboxes.of(new)))
    # Open watches were authorised, and filtered, under the old policy: each
    # client watches again (its clients do so by themselves) under the new one.
    live.on_reload(lambda _new: watches.end_all("the policy was reloaded; watch again"))
    app.reloads = PolicyReloads(live, store)
    app.closers.append(backend.close)
    app.closers.insert(0, heavy.close)
    executor.observe(app.metrics.observe_execution)
    if config.max_warm > 0:
        pools = WarmPools(
            backend,
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
        app.closers.insert(0, pools.close)  # before the backend's engine connection goes
    if webhooks:
        _start_webhooks(app, config, webhooks)
    _keep_calls(app, config)
    _record_refusals(app, config)
    app.metrics.watch(executor.admission, app.pools.stats if app.pools else None, rates)
    app.metrics.watch_heavy(heavy.gate)
    # Tools stored by other servers on the same database: served here at once.
    store.watch_tools(registry.reload)
    # Approval events from every server reach this server's watches.
    approvals.hub.start()
    sweeper.start()
    app.closers[:0] = [approvals.hub.close, sweeper.close]
    # A reload asked of any server is done by every server on the store.
    store.watch_policy(app.reloads.from_peer)
    if log_signer is not None and audit_start.ok:
        _start_checkpoints(app, log_signer, audit_start.log)
        if witnesses:
            _start_witnesses(app, log_signer.name, witnesses, audit_start.log)
    if export_sinks:
        _start_siem_export(app, export_sinks, config.log_origin or f"toolreg/{policy.audience}")
    return app


def _record_refusals(app: App, config: ServerConfig) -> None:
    """Refused requests on the audit log, identical ones folded per interval;
    what is still counted at close is written before the last checkpoint and
    the SIEM export's last batch (they are appended to the closers later)."""
    app.refusals = RefusalLog(app.store, interval_s=config.refusal_fold_s)
    app.refusals.start()
    app.closers.insert(0, app.refusals.close)


def _keep_calls(app: App, config: ServerConfig) -> None:
    """Streamed calls kept for re-attaching; on a store other servers share,
    published to it too, so a client may re-attach through any of them."""
    app.calls = CallLog(grace_s=config.attach_grace_s, max_ended=config.attach_max_ended)
    app.closers.insert(0, app.calls.close)  # stop calls no client may come back for
    if config.store.startswith(POSTGRES_URL_PREFIXES):
        app.relay = CallRelay(app.calls, app.store, f"server-{uuid.uuid4().hex}")
        app.relay.start()
        app.closers.insert(1, app.relay.close)


def _start_checkpoints(app: App, signer: Signer, log_now: audit_tree.Log) -> None:
    """Signed checkpoints of the audit log's tree, off the call path; the last
    one at close, after everything else that may still write a record."""
    config = app.config
    checkpointer = audit_tree.Checkpointer(
        app.store, signer, log_now.compact(), log_now.chain.head,
        every=config.checkpoint_every, interval_s=config.checkpoint_interval_s,
        copy_file=config.checkpoint_copy,
    )  # fmt: skip
    checkpointer.start()
    app.checkpointer = checkpointer
    app.closers.append(checkpointer.close)
    log.info(
        "audit checkpoints: log %s, every %d records or %g s; verifier key %s",
        signer.name, config.checkpoint_every, config.checkpoint_interval_s, signer.verifier,
    )  # fmt: skip


def _witnesses(config: ServerConfig, signer: Signer | None) -> list[WitnessEndpoint]:
    """The witnesses each checkpoint goes to; only signed checkpoints are witnessed."""
    if config.witnesses and signer is None:
        raise ConfigError("witnesses need the log key (--log-key): they cosign signed checkpoints")
    try:
        found = [parse_witness(text) for text in config.witnesses]
    except NoteError as exc:
        raise ConfigError(f"witnesses: {exc}") from None
    names = [w.key for w in found]
    if len(set(names)) != len(names):
        raise ConfigError("witnesses: one witness key is named twice")
    return found


def _start_witnesses(
    app: App, origin: str, witnesses: list[WitnessEndpoint], log_now: audit_tree.Log
) -> None:
    """Each new checkpoint submitted to the witnesses, off the call path
    (notify/witnesses.py); their cosignatures kept in the store."""
    checkpointer = app.checkpointer
    assert checkpointer is not None
    submitter = WitnessSubmitter(
        app.store, origin, witnesses, lambda: checkpointer.last,
        leaves=log_now.leaves, timeout_s=app.config.witness_timeout_s,
    )  # fmt: skip
    submitter.start()
    app.closers.append(submitter.close)
    log.info("audit witnesses: %s", ", ".join(f"{w.name}+{w.verifier.id.hex()}" for w in witnesses))


def _export_sinks(config: ServerConfig) -> list[Sink]:
    """The SIEM export's destinations (none unless asked for)."""
    sinks: list[Sink] = []
    if config.export_jsonl is not None:
        sinks.append(JsonlSink(config.export_jsonl, max_bytes=config.export_jsonl_max_bytes,
                               keep=config.export_jsonl_keep))  # fmt: skip
    if config.export_syslog is not None:
        host, _, port = config.export_syslog.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--export-syslog {config.export_syslog!r}: give HOST:PORT")
        if config.export_syslog_ca is None:
            raise ConfigError("--export-syslog needs --export-syslog-ca: the CA that signed the"
                              " receiver's certificate")  # fmt: skip
        if (config.export_syslog_cert is None) != (config.export_syslog_key is None):
            raise ConfigError("--export-syslog-cert and --export-syslog-key go together")
        target = SyslogTls(
            host, int(port), config.export_syslog_ca, config.export_syslog_cert,
            config.export_syslog_key, config.export_syslog_server_name,
        )  # fmt: skip
        try:
            sinks.append(SyslogTlsSink(target))
        except SinkError as exc:
            raise ConfigError(str(exc)) from None
    elif config.export_syslog_ca or config.export_syslog_cert or config.export_syslog_key:
        raise ConfigError("--export-syslog-ca/-cert/-key need --export-syslog HOST:PORT")
    return sinks


def _start_siem_export(app: App, sinks: list[Sink], log_name: str) -> None:
    """Each audit record as an OCSF event, to each destination, from a thread
    of its own that follows the committed log (notify/siem/)."""
    source = ocsf.Source(log_name)
    for sink in sinks:
        exporter = Exporter(app.store, sink, source, batch=app.config.export_batch,
                            lease_s=app.config.export_lease_s)  # fmt: skip
        app.exporters.append(exporter)
        exporter.start()
        app.closers.append(exporter.close)  # last: after everything that may write a record
    app.metrics.registry.register(ExportMetrics(app.exporters))
    log.info("SIEM export (OCSF %s, log %s): %s", ocsf.OCSF_VERSION, log_name,
             ", ".join(s.id for s in sinks))  # fmt: skip


class _SandboxPolicies:
    """The sandbox side of a policy (ceilings, egress, grants), made again for
    each policy put in force; what does not change with it is made once."""

    def __init__(self, config: ServerConfig, require_gvisor: bool, dev_mode: bool) -> None:
        self._config = config
        self._require_gvisor = require_gvisor
        self._dev_mode = dev_mode
        self._workspace = _prepare_workspace(config.workspace)
        self._secrets = SecretStore(_prepare_secrets(config.secrets))

    def of(self, policy: Policy) -> SandboxPolicy:
        return SandboxPolicy(
            ceilings=_ceilings(self._config, policy),
            require_gvisor=self._require_gvisor,
            workspace_dir=self._workspace,
            workspace_tools=frozenset(self._config.workspace_tools),
            egress=policy.egress,
            grant_of=(lambda _owner: UNRESTRICTED) if self._dev_mode else policy.grant_of,
            secrets=self._secrets,
            allow_hostinet=self._config.gvisor_hostinet == "allow",
        )


def _webhook_endpoints(policy: Policy) -> dict[str, Endpoint]:
    try:
        return load_endpoints(policy.webhooks)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None


def _start_webhooks(app: App, config: ServerConfig, endpoints: dict[str, Endpoint]) -> None:
    """Approval events reach the policy's webhooks (notify/): queued in each
    event's own transaction, sent by this server's dispatcher (on PostgreSQL,
    by whichever server claims them first)."""
    policy = app.approvals.policy  # as at start: the endpoints' secrets were read for it
    # Rules from the policy in force at each event (a reload changes them);
    # the endpoints and the console link stay as the server started.
    outbox = Outbox(policy.webhooks, lambda: app.approvals.policy, console_url=policy.console_url)
    app.approvals.hooks.append(outbox.hook)
    dispatcher = Dispatcher(
        app.store, endpoints, concurrency=config.webhook_concurrency,
        retry_base_s=config.webhook_retry_base_s, max_attempts=config.webhook_max_attempts,
        observe=app.metrics.observe_webhook,
    )  # fmt: skip
    app.approvals.hub.on_event(dispatcher.wake)
    app.metrics.webhook_backlog.set_function(lambda: dispatcher.backlog)
    dispatcher.start()
    app.closers.insert(0, dispatcher.close)
    log.info("webhooks: %d endpoint(s): %s", len(endpoints), ", ".join(sorted(endpoints)))


def _image_check(backend: SandboxBackend) -> ImageCheck:
    """Refuse images that declare a VOLUME: Docker gives each such path an
    anonymous volume, writable and unbounded despite the read-only root."""

    def check(tool: ToolDefinition) -> None:
        try:
            volumes = backend.image_volumes(tool.sandbox.image)
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


def _prepare_secrets(directory: Path) -> Path:
    """The secrets directory: created root-only; one that others can read is
    refused (each file is checked again when read)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(
            f"secrets directory {directory} is open to others (mode {mode:o}); chmod 700 it"
        )
    return directory


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


def _read_policy(config: ServerConfig) -> Policy:
    """The policy file, or in development mode the approver keys installed in
    the data directory; PolicyError names the file, line and rule."""
    if config.policy_file is not None:
        return load_policy(config.policy_file)
    keys: dict[str, str] = {}
    if config.approvers_dir.is_dir():
        keys = {p.stem: p.read_text().strip() for p in sorted(config.approvers_dir.glob("*.pub"))}
    try:
        return development_policy(audience=config.dev_audience, approvers=keys)
    except PolicyError as exc:
        raise PolicyError(f"{config.approvers_dir}: {exc}") from None


def _warn_development_mode(config: ServerConfig, policy: Policy) -> None:
    log.warning(
        "DEVELOPMENT MODE (no --policy): loopback only, every client allowed with every role;"
        " dangerous tools need a token from one of %d approver key(s) in %s"
        " (add one with `toolreg keys generate --out FILE --install %s`, then SIGHUP)",
        len(policy.approvers), config.approvers_dir, config.data_dir,
    )  # fmt: skip


def _log_signer(config: ServerConfig, policy: Policy) -> Signer | None:
    """The log key (--log-key) under the log's origin; None without one. The
    server reads it unattended, so it must not be encrypted, and a file others
    can read is refused: whoever reads it can sign a rewritten log."""
    if config.log_key_file is None:
        return None
    origin = config.log_origin or f"toolreg/{policy.audience}"
    try:
        check_key_name(origin)
    except NoteError as exc:
        raise ConfigError(f"log_origin: {exc}; set TOOLREG_LOG_ORIGIN") from None
    path = config.log_key_file
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"log key {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"log key {path} is open to others (mode {mode:o}); chmod 600 it")
    if is_encrypted(data):
        raise ConfigError(
            f"log key {path} is encrypted; the server reads it unattended: give it an"
            " unencrypted key, readable by the server's user only"
        )
    try:
        return Signer(origin, load_private_key(data))
    except ValueError as exc:
        raise ConfigError(f"log key {path}: {exc}") from None


def _check_audit_log(
    config: ServerConfig, store: Store, signer: Signer | None
) -> audit_tree.StartCheck:
    """The chain, and the tree against the last checkpoints of this log: the
    store's, and the copy this server keeps (docs/how-to/audit.md)."""
    check = audit_tree.check_log(
        store,
        origin=signer.name if signer else None,
        verifier=signer.verifier if signer else None,
        copy_file=config.checkpoint_copy,
    )
    for passed in check.passed:
        log.info("audit log: %s", passed)
    if check.ok:
        return check
    problems = "; ".join(check.problems)
    if not config.allow_broken_audit:
        raise ConfigError(
            f"audit log in {store.location}: {problems}; refusing to start. Investigate,"
            " then set TOOLREG_ALLOW_BROKEN_AUDIT=true to start anyway"
        )
    log.error(
        "audit log in %s: %s; starting anyway (TOOLREG_ALLOW_BROKEN_AUDIT)%s",
        store.location, problems,
        # A log never signs a tree that disagrees with one it signed.
        "; no audit checkpoint will be signed" if signer else "",
    )  # fmt: skip
    return check


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


def _start_sandboxes(config: ServerConfig, backend: SandboxBackend, require_gvisor: bool) -> None:
    """Reap leftovers and say what isolation dangerous tools will get."""
    try:
        if config.reap_on_start:
            removed = backend.reap()
            if removed:
                log.info("removed %d containers left behind by dead toolreg servers", removed)
        runtimes = backend.runtimes()
    except SandboxError as exc:
        # Serve the registry anyway; executions answer UNAVAILABLE until it returns.
        log.error(
            "container engine unavailable at start-up: %s; fix: %s (`toolreg doctor` checks it)",
            exc, engine_fix(),
        )  # fmt: skip
        return
    if GVISOR in runtimes:
        log.info("dangerous tools run under gVisor (%s)", GVISOR)
    elif require_gvisor:
        log.warning(
            "gVisor (%s) is not installed: dangerous tools will be refused; fix: %s",
            GVISOR, gvisor_fix(),
        )  # fmt: skip
    else:
        log.warning(
            "gVisor (%s) is not installed: dangerous tools without egress run under runc;"
            " set TOOLREG_REQUIRE_GVISOR=true to refuse them instead; gVisor: %s",
            GVISOR,
            gvisor_fix(),
        )
    net_args = runtimes.get(GVISOR_NET)
    problem = runsc_net_problem(net_args, config.gvisor_hostinet == "allow")
    if problem is not None or net_args is None:
        log.warning("dangerous tools with egress will be refused: %s, %s", GVISOR_NET, problem)
    elif gvisor_network(net_args) == HOSTINET:
        log.warning(
            "dangerous tools with egress run under gVisor (%s) with %s, not gVisor's netstack:"
            " their socket calls reach the host kernel's network stack, inside each call's own"
            " network namespace and internal network (docs/how-to/deploying.md, 1. The engine);"
            " TOOLREG_GVISOR_HOSTINET=refuse refuses them, a runsc from gVisor"
            " release-20240801 or later gives the netstack",
            GVISOR_NET,
            HOSTINET,
        )
    else:
        log.info(
            "dangerous tools with egress run under gVisor (%s) with its own network stack (%s)",
            GVISOR_NET,
            NETSTACK,
        )


def _prepare_workspace(path: Path) -> Path:
    """The shared workspace must be writable by the sandbox user (65534)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
    else:
        path.chmod(0o777)  # without root we cannot chown to the sandbox user
    return path


def open_store(url: str, *, must_exist: bool = False) -> Store:
    """The store that ``TOOLREG_STORE_URL`` names; ``must_exist``: do not
    create an empty one (the audit commands read what a server wrote)."""
    if url.startswith(POSTGRES_URL_PREFIXES):
        # Imported here: an embedded server never loads the PostgreSQL driver.
        from registry_server.store.postgres import PostgresStore

        return PostgresStore(url, must_exist=must_exist)
    if (path := sqlite_path(url)) is not None:
        if must_exist and not path.is_file():
            raise StoreError(f"no toolreg store at {path}")
        return SqliteStore(path)
    raise ConfigError("store_url: unsupported store URL; use sqlite:///<path> (TOOLREG_STORE_URL)")


def open_backend(config: ServerConfig, *, reaper: bool = False) -> SandboxBackend:
    """The sandbox backend that ``TOOLREG_SANDBOX_BACKEND`` names (Docker is the
    only one). ``reaper``: one that only removes leftovers (`toolreg reap`)."""
    if config.sandbox_backend != "docker":
        raise ConfigError(
            f"sandbox_backend: unknown backend {config.sandbox_backend!r}; use docker"
        )
    if reaper:
        return DockerBackend(
            instance_id=f"reaper-{uuid.uuid4().hex[:12]}", base_url=config.docker_url
        )
    mounted = (
        _staged(config)
        if config.stage_mounts
        else _Mounted(config.init_path, PROXY_PACKAGE_DIR, config.egress_upstream_ca)
    )
    try:
        return DockerBackend(
            instance_id=f"toolreg-{uuid.uuid4().hex[:12]}",
            base_url=config.docker_url,
            # one engine connection per running sandbox, plus reaping and pings
            max_pool_size=config.max_sandboxes + 4,
            remove_in_background=True,  # answer first; the container goes right after
            init_path=mounted.init,
            egress=EgressConfig(
                state_dir=config.egress_state,
                image=config.egress_image,
                upstream_networks=config.egress_networks,
                dns=config.egress_dns,
                upstream_ca_file=mounted.upstream_ca,
                network_pool=config.egress_network_pool,
                proxy_dir=mounted.proxy_dir,
            ),
        )
    except ValueError as exc:  # the sandbox init is missing or unusable
        raise ConfigError(f"{exc} (or set TOOLREG_INIT_PATH)") from None


@dataclass(frozen=True)
class _Mounted:
    """The host paths the engine is asked to bind-mount into containers."""

    init: Path
    proxy_dir: Path
    upstream_ca: Path


def _staged(config: ServerConfig) -> _Mounted:
    """Copies under <data_dir>/stage of what lives in the server's own container (its
    image), for an engine that sees the data directory at the same path
    (TOOLREG_STAGE_MOUNTS; docs/how-to/deploying.md, "The server image"). A file that is not
    there is left to the check that reports it (the init's, the proxy's at its start)."""
    stage = config.stage_dir
    try:
        init = config.init_path
        if init.is_file():
            init = staging.stage_file(init, stage, "init", mode=0o755)
        ca = config.egress_upstream_ca
        if ca.is_file():
            ca = staging.stage_file(ca, stage, "egress-ca")
        proxy = staging.stage_tree(PROXY_PACKAGE_DIR, stage, "egress-proxy")
    except OSError as exc:
        raise ConfigError(
            f"stage_mounts: cannot copy what the engine mounts into {stage}:"
            f" {exc.strerror or exc}; the data directory must be writable by the server"
        ) from None
    log.info("engine mounts staged in %s (init %s)", stage, init)
    return _Mounted(init, proxy, ca)

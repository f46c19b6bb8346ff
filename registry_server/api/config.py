"""Server configuration: loaded once into a frozen, validated object.

Sources, lowest to highest precedence: defaults, ``TOOLREG_*`` environment
variables, CLI flags (passed in as keyword arguments by the CLI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from registry_server.approvals.watch import DEFAULT_MAX_WATCHES
from registry_server.domain.refusals import DEFAULT_FOLD_S, MAX_FOLD_S
from registry_server.execution.call_log import DEFAULT_GRACE_S, DEFAULT_MAX_ENDED, MAX_GRACE_S
from registry_server.execution.call_relay import MAX_ATTACHED
from registry_server.execution.heavy_work import DEFAULT_THRESHOLD_BYTES, default_workers
from registry_server.execution.warm_pool import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_WARM,
    MAX_AGE_LIMIT_S,
)
from registry_server.notify.dispatcher import DEFAULT_CONCURRENCY
from registry_server.notify.outbox import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_BASE_S
from registry_server.notify.siem.exporter import DEFAULT_BATCH, DEFAULT_LEASE_S
from registry_server.notify.siem.sinks import DEFAULT_JSONL_KEEP, DEFAULT_JSONL_MAX_BYTES
from registry_server.notify.witnesses import DEFAULT_TIMEOUT_S as WITNESS_TIMEOUT_S
from registry_server.store.audit_tree import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_INTERVAL_S,
)
from registry_server.wire.endpoint import DEFAULT_HOST, DEFAULT_PORT
from sandbox_runner.egress.gateway import NETWORK_POOL_SIZE
from sandbox_runner.spec import INIT_BINARY

DB_FILENAME = "toolreg.db"  # the SQLite store's file in the data directory
# The copy of the last audit checkpoint this server signed, in the data directory.
CHECKPOINT_COPY_FILENAME = "audit-checkpoint.txt"

DEFAULT_DATA_DIR = Path.home() / ".local" / "state" / "toolreg"
DEFAULT_MAX_SANDBOXES = 8  # containers running at once, server-wide
DEFAULT_MAX_QUEUED = 32  # calls waiting for a sandbox slot before RESOURCE_EXHAUSTED
EXTRA_GRPC_THREADS = 8  # threads for registry RPCs beyond the sandbox slots and queue
SHUTDOWN_GRACE_S = 10.0  # seconds in-flight RPCs get to finish on SIGTERM
# Seconds a leaving server says NOT_SERVING, still serving, before it stops accepting: HAProxy's
# default checks (inter 2 s, fall 3) need 6 s to take it out, a Kubernetes readiness probe
# of period 5 s and failureThreshold 2 needs 10 s.
DEFAULT_DRAIN_S = 10.0
MAX_DRAIN_S = 600.0  # seconds: a longer window is a misconfiguration
DEFAULT_SANDBOX_MEMORY_MB = 4096  # MiB: the memory limits of all sandboxes, running or warm
# Bytes of one request message: 1 MiB of arguments plus approval tokens and
# framing fit; a bigger message is refused by gRPC before it is parsed.
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
DEFAULT_HEAVY_MAX_QUEUED = 16  # calls with large arguments waiting for a turn, server-wide
DEFAULT_HEAVY_QUEUE_PER_CLIENT = 2  # of one client's calls with large arguments, waiting
DEFAULT_HEAVY_WAIT_S = 10.0  # seconds a call with large arguments waits for its turn at most


class ServerConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLREG_", frozen=True, extra="forbid")

    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    data_dir: Path = DEFAULT_DATA_DIR
    # Where tools, approvals and the audit log are kept; default: the SQLite
    # file in data_dir (sqlite:///<data_dir>/toolreg.db).
    store_url: str | None = Field(None, min_length=1, max_length=4096)
    tools_dir: Path | None = None  # manifests registered (replacing) at start-up
    policy_file: Path | None = None
    max_sandboxes: int = Field(DEFAULT_MAX_SANDBOXES, ge=1, le=256)
    max_queued: int = Field(DEFAULT_MAX_QUEUED, ge=0, le=4096)
    # Calls with large arguments (docs/explanation/speed.md, "Large arguments share
    # the CPU"): above heavy_arguments_bytes of arguments JSON, a call's parsing,
    # validation and guards run in one of heavy_workers worker processes (default:
    # one fewer than the CPUs, at least 1), in turns
    # shared round robin between clients (one call of a client at a time); a call
    # waits at most heavy_wait_s for its turn, and at most heavy_queue_per_client
    # calls of a client and heavy_max_queued in all wait (more: RESOURCE_EXHAUSTED).
    heavy_arguments_bytes: int = Field(DEFAULT_THRESHOLD_BYTES, ge=1024, le=1024 * 1024)
    heavy_workers: int | None = Field(None, ge=1, le=64)
    heavy_max_queued: int = Field(DEFAULT_HEAVY_MAX_QUEUED, ge=0, le=1024)
    heavy_queue_per_client: int = Field(DEFAULT_HEAVY_QUEUE_PER_CLIENT, ge=0, le=1024)
    heavy_wait_s: float = Field(DEFAULT_HEAVY_WAIT_S, gt=0, le=600)
    # approval watches open at once (each holds a gRPC thread while open)
    max_watches: int = Field(DEFAULT_MAX_WATCHES, ge=0, le=1024)
    # MiB: running and warm sandboxes' memory limits add up to at most this.
    sandbox_memory_mb: int = Field(DEFAULT_SANDBOX_MEMORY_MB, ge=64, le=1024 * 1024)
    init_path: Path = INIT_BINARY  # the sandbox init, as `make init` builds it
    # A server in a container beside the engine (docs/how-to/deploying.md, "The server image"):
    # the files the engine bind-mounts into containers (the init, the egress proxy's
    # code, the upstream CA bundle) are copied at start into <data_dir>/stage and
    # mounted from there, so the data directory must be at the same path on the
    # engine's host. Off: they are mounted from where they are (a server on the host).
    stage_mounts: bool = False
    sandbox_backend: Literal["docker"] = "docker"  # where sandboxes run (api/app.py)
    docker_url: str | None = None  # default: DOCKER_HOST or the local socket
    # Dangerous tools run under gVisor (runsc). Without it: refuse them (True)
    # or run them under runc with a warning at start-up (False). Unset: True
    # with a policy (a real deployment), False in development mode.
    require_gvisor: bool | None = None
    # Dangerous tools with egress run under runsc-net. Where its runsc cannot start
    # gVisor's netstack, scripts/ensure_docker.sh registers it with hostinet (the
    # tool's socket calls reach the host kernel's network stack, inside the call's
    # own namespace and internal network). refuse: such calls fail (SANDBOX_ERROR)
    # before any approval is asked for; they run only with the netstack.
    gvisor_hostinet: Literal["allow", "refuse"] = "allow"
    workspace_dir: Path | None = None  # default: <data_dir>/workspace
    # Dangerous tools that get workspace_dir mounted read-write at /workspace.
    workspace_tools: tuple[str, ...] = ("write_file",)
    # Warm pools: a tool's manifest `warm_pool: N` (or this default when it
    # says 0) keeps N started single-use containers ready.
    warm_pool_default: int = Field(0, ge=0, le=32)
    max_warm: int = Field(DEFAULT_MAX_WARM, ge=0, le=256)  # warm containers across all tools
    # seconds before an unused one is replaced (an hour at most)
    warm_max_age_s: float = Field(DEFAULT_MAX_AGE_S, gt=0, le=MAX_AGE_LIMIT_S)
    # Prometheus metrics on their own HTTP port (None: off; 0: any free port).
    metrics_host: str = DEFAULT_HOST
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # grpc.health.v1 alone, in cleartext, on a port of its own (None: off): for the
    # image's HEALTHCHECK and Kubernetes' gRPC probes, which cannot speak TLS (with
    # mTLS, a probe would need a client certificate). It tells a caller only SERVING
    # or NOT_SERVING; loopback unless an operator opens it (a pod's kubelet probe).
    health_host: str = DEFAULT_HOST
    health_port: int | None = Field(None, ge=0, le=65535)
    health_interval_s: float = Field(5.0, gt=0)  # seconds between engine checks
    reap_on_start: bool = True  # remove containers left by dead toolreg servers
    # TLS: server certificate and key (PEM); with a client CA, clients must
    # present a certificate it signed (mTLS).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Listening beyond loopback without TLS and a policy exposes an open tool
    # runner; refused unless forced.
    allow_insecure_remote: bool = False
    # A broken audit chain, or an audit log whose tree does not extend its last
    # signed checkpoint, stops the server unless the operator says go on.
    allow_broken_audit: bool = False
    # Signed checkpoints of the audit log's Merkle tree (docs/how-to/audit.md): the log
    # key (an Ed25519 private key, PEM, unencrypted, kept outside the store; none:
    # no checkpoints are signed), the log's name in them (default:
    # toolreg/<the policy's audience>), and how often: once checkpoint_every
    # records are in none, or checkpoint_interval_s seconds after the last one.
    log_key_file: Path | None = None
    log_origin: str | None = Field(None, min_length=1, max_length=256)
    checkpoint_every: int = Field(DEFAULT_CHECKPOINT_EVERY, ge=1, le=10_000_000)
    checkpoint_interval_s: float = Field(DEFAULT_CHECKPOINT_INTERVAL_S, gt=0, le=86_400)
    # Where this server keeps a copy of the last checkpoint it signed, checked at
    # start like the store's own (default: <data_dir>/audit-checkpoint.txt).
    checkpoint_copy_file: Path | None = None
    # Witnesses (docs/how-to/audit.md, "Witnesses"), each "<verifier key> <submission
    # URL>": every checkpoint this server signs is submitted to each (needs
    # log_key_file), and their cosignatures kept in the store; seconds a
    # request to one may take.
    witnesses: tuple[str, ...] = ()
    witness_timeout_s: float = Field(WITNESS_TIMEOUT_S, gt=0, le=300)
    dev_audience: str = "toolreg-dev"  # the `aud` of tokens in development mode
    # Leaving (SIGTERM or SIGINT; docs/how-to/scaling.md): for drain_s seconds the server says
    # NOT_SERVING (readiness; liveness stays SERVING) and still serves new calls, so load
    # balancers take it out first; only when a prober asked for readiness in the last
    # drain_s seconds (nobody else would hear it); a second signal cuts it short; 0: off.
    # Then it stops accepting, and calls in flight get shutdown_grace_s to finish.
    drain_s: float = Field(DEFAULT_DRAIN_S, ge=0, le=MAX_DRAIN_S)
    shutdown_grace_s: float = Field(SHUTDOWN_GRACE_S, ge=0)
    # Seconds a streamed call's output and result stay attachable after it
    # ends (AttachExecution), and how many ended calls a server keeps at most.
    attach_grace_s: float = Field(DEFAULT_GRACE_S, ge=0, le=MAX_GRACE_S)
    attach_max_ended: int = Field(DEFAULT_MAX_ENDED, ge=0, le=100_000)
    # Seconds over which identical refused requests (same source, method, tool and
    # reason) share one audit record with their count (docs/how-to/audit.md, "Refused requests").
    refusal_fold_s: float = Field(DEFAULT_FOLD_S, gt=0, le=MAX_FOLD_S)
    # Egress (docs/how-to/deploying.md): the networks the egress proxy reaches the
    # world through, its resolvers, and the CAs it verifies upstreams with.
    egress_networks: tuple[str, ...] = ("bridge",)
    egress_dns: tuple[str, ...] = ()
    egress_upstream_ca: Path = Path("/etc/ssl/certs/ca-certificates.crt")
    egress_image: str = "toolreg/python"
    # Call networks made ahead of calls (0: each egress call makes its own).
    egress_network_pool: int = Field(NETWORK_POOL_SIZE, ge=0, le=32)
    secrets_dir: Path | None = None  # default: <data_dir>/secrets
    # Webhooks (the policy's `webhooks`): seconds before a failed delivery's 2nd
    # attempt (each later wait doubles), attempts before it is failed, and
    # deliveries this server sends at once.
    webhook_retry_base_s: float = Field(DEFAULT_RETRY_BASE_S, gt=0, le=3_600)
    webhook_max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1, le=20)
    webhook_concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, le=64)
    # SIEM export (docs/how-to/audit.md, "SIEM export"): every audit record as an OCSF
    # event, to a JSON Lines file (rotated past max_bytes, keep rotated files
    # kept) and/or a syslog receiver over TLS (HOST:PORT; its certificate is
    # verified against export_syslog_ca for export_syslog_server_name, default
    # the host; a client certificate when the receiver asks for one). Batch:
    # events confirmed at a time; lease: seconds a destination stays a dead
    # server's before another server on the store takes it over.
    export_jsonl: Path | None = None
    export_jsonl_max_bytes: int = Field(DEFAULT_JSONL_MAX_BYTES, ge=4096)
    export_jsonl_keep: int = Field(DEFAULT_JSONL_KEEP, ge=1, le=1000)
    export_syslog: str | None = Field(None, min_length=3, max_length=300)
    export_syslog_ca: Path | None = None
    export_syslog_cert: Path | None = None
    export_syslog_key: Path | None = None
    export_syslog_server_name: str | None = Field(None, min_length=1, max_length=253)
    export_batch: int = Field(DEFAULT_BATCH, ge=1, le=10_000)
    export_lease_s: float = Field(DEFAULT_LEASE_S, ge=1, le=3_600)

    @property
    def grpc_threads(self) -> int:
        # Every admitted or queued execution holds a thread while it waits,
        # and registry RPCs must still be served when all of those are busy.
        # Each open approval watch holds one too, for as long as it is open,
        # and so does each open AttachExecution (capped: call_relay.Attachments),
        # and each call with large arguments at its turn or waiting for one.
        return (
            self.max_sandboxes + self.max_queued + EXTRA_GRPC_THREADS + self.max_watches
            + MAX_ATTACHED + self.heavy_turns + self.heavy_max_queued
        )  # fmt: skip

    @property
    def heavy_turns(self) -> int:
        """Worker processes for calls with large arguments: calls checked at once."""
        return self.heavy_workers or default_workers()

    @property
    def store(self) -> str:
        return self.store_url or default_store_url(self.data_dir)

    @property
    def checkpoint_copy(self) -> Path:
        return self.checkpoint_copy_file or self.data_dir / CHECKPOINT_COPY_FILENAME

    @property
    def approvers_dir(self) -> Path:
        """Development mode: public keys (<id>.pub) of approvers."""
        return self.data_dir / "approvers"

    @property
    def secrets(self) -> Path:
        return self.secrets_dir or self.data_dir / "secrets"

    @property
    def egress_state(self) -> Path:
        """The egress CA, the proxy's control socket, per-call secret files."""
        return self.data_dir / "egress"

    @property
    def stage_dir(self) -> Path:
        """Copies of what the engine mounts, when stage_mounts is on (api/staging.py)."""
        return self.data_dir / "stage"

    @property
    def workspace(self) -> Path:
        return self.workspace_dir or self.data_dir / "workspace"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def default_store_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / DB_FILENAME}"

"""The server's egress gateway: one proxy container per server, and one
internal network per call that has egress.

A call's network is ``internal`` (no route off the bridge) and its bridge has
no address on the host (``inhibit_ipv4``), so the sandbox can reach exactly
one thing: the proxy container, which is attached to that network and to the
operator's upstream networks. Each call has its own network, so two
sandboxes never share a link, and its own proxy token, so a call's
connections are recorded under its execution id.

Attaching a container to a bridge network when it starts is the dearest part
of a call with egress (the engine sets up a veth pair and its firewall rules:
~0.5 s more than a start without a network, on a loaded 2-core machine). So
each call network gets a *holder*: a container that does nothing (``sleep``,
unprivileged, read-only, no capabilities) but hold a network namespace on
it, and the call's sandbox joins that namespace (``container:<holder>``),
which starts as fast as no network at all. Making a network costs the create,
connecting the proxy, inspecting it for its address there, and creating and
starting the holder, so a few are made ahead of calls (``NetworkPool``): a
call takes one, and network and holder are removed after that call, never
handed to another. A call that finds none makes its own. The token goes into
the sandbox's environment when its container is made, but the proxy learns
of it (``register``: the allow-list, the injected headers, the caps) only when
the call is released, right before its tool starts: a container made ahead
of its call (a warm pool's) holds a token the proxy refuses until then.

Engine calls go through the low-level Docker API client handed in by
docker_backend.py (the one module that imports ``docker``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets as token_source
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .. import after_call
from ..ownership import LABEL_DEADLINE
from ..spec import EgressConnection, EgressSpec, Mount, SandboxError
from . import control
from .ca import EgressCA

log = logging.getLogger(__name__)

PROXY_PORT: Final = 3128  # where the proxy listens in its container
PROXY_PACKAGE_DIR: Final = Path(__file__).resolve().parent  # mounted as the package `egress`
PROXY_MEMORY_MB: Final = 256  # MiB for the proxy container
PROXY_PIDS: Final = 256  # processes/threads of the proxy container
PROXY_START_TIMEOUT_S: Final = 20.0  # seconds for a new proxy to answer its control socket
CA_TARGET: Final = "/etc/toolreg/egress-ca.pem"  # where a sandbox finds the CA it trusts
SECRETS_TARGET: Final = "/run/secrets"  # where deliver: file secrets appear
PROXY_USER: Final = "65534:65534"  # the proxy of a root server, and every holder
SANDBOX_UID: Final = 65534  # the user sandboxes run as (docker_backend.UNPRIVILEGED_USER)
NETWORK_POOL_SIZE: Final = 3  # networks made ahead of calls (0: every call makes its own)
NETWORK_MAX_AGE_S: Final = 600.0  # seconds a network waits in the pool before it is replaced
# Seconds a pooled network's deadline label lies beyond its maximum age: room for
# the longest wait of a warm container (warm_pool.MAX_AGE_LIMIT_S) and its call.
# The reaper of another server removes a network past its deadline whoever owns it,
# so a call takes a pooled network only when its own deadline is within this one's.
NETWORK_LEASE_S: Final = 3600.0 + 600.0
NETWORK_REFILL_BACKOFF_S: Final = (0.5, 30.0)  # seconds: first and longest wait after a failure
LABEL_EGRESS_NETWORK: Final = "io.toolreg.egress-network"  # on a sandbox: its call network
HOLDER_IMAGE: Final = "toolreg/base"  # busybox: the holder only sleeps
HOLDER_COMMAND: Final = ("sleep", "2147483647")  # seconds: as long as busybox sleeps
# MiB for a holder. It only sleeps, but `runc init` starts inside its cgroup: at 16 MiB
# a busy engine's start was OOM-killed now and then, which dockerd reports as "cannot
# start a stopped process" (moby/moby#41167) and the call failed. A limit, not a reserve.
HOLDER_MEMORY_MB: Final = 64
HOLDER_PIDS: Final = 4  # processes of a holder
# On a call network Docker's embedded DNS answers in the sandbox (which shares
# the holder's resolver settings); an unroutable upstream keeps it from
# forwarding anything (older engines forwarded via the host for a loopback
# resolver: CVE-2024-29018). Names are the proxy's to resolve.
UNROUTABLE_DNS: Final = "192.0.2.1"  # TEST-NET-1 (RFC 5737): a resolver nobody answers for
_CONTROL_TARGET: Final = "/run/toolreg"
_UPSTREAM_CA_TARGET: Final = "/etc/toolreg/upstream-ca.pem"
# Names every common HTTP stack reads: urllib/requests/curl read the proxy ones,
# OpenSSL/Python/requests/curl/Node the CA ones.
_PROXY_ENV: Final = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
_CA_ENV: Final = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


@dataclass(frozen=True)
class EgressConfig:
    """What the operator decides about the proxy (server configuration)."""

    state_dir: Path  # the CA, the control socket, per-call secret files
    image: str = "toolreg/python"  # runs the proxy (stdlib python3)
    # Networks the proxy reaches the world through (default: Docker's bridge).
    upstream_networks: tuple[str, ...] = ("bridge",)
    dns: tuple[str, ...] = ()  # resolvers for the proxy (empty: the engine's default)
    upstream_ca_file: Path = Path("/etc/ssl/certs/ca-certificates.crt")
    network_pool: int = NETWORK_POOL_SIZE  # networks kept made ahead of calls
    # The proxy's code as the engine's host sees it (a server in a container mounts a
    # staged copy: registry_server/api/staging.py).
    proxy_dir: Path = PROXY_PACKAGE_DIR


@dataclass(frozen=True)
class EgressUsers:
    """Who owns what the proxy and the sandboxes are handed, decided by the server's user.

    A root server hands the proxy's control directory and each file secret to the
    sandboxes' user (``chown``) and runs the proxy as that user. A server that is not
    root (the server image's uid 10001) cannot ``chown``: its proxy runs as the server's
    own user instead (still not root, no capability, a read-only root), so it can make
    its socket in the server's 0700 directory; and a file secret gets the read bit for
    others as well as for its owner. That file sits in a directory made for its one
    call, mode 0700 and the server's, so on the host only the server's user and root
    can reach it: the bit counts only through the bind mount, where the sandbox's user
    (not the server's, nor in its group) reads the file and nothing else sees it."""

    proxy_user: str  # "uid:gid" of the proxy container
    hand_to: tuple[int, int] | None  # (uid, gid) the control dir and file secrets are given to
    secret_mode: int  # a file secret's mode


def egress_users(euid: int, egid: int) -> EgressUsers:
    """The choice for a server running as ``euid``/``egid`` (os.geteuid(), os.getegid())."""
    if euid == 0:
        return EgressUsers(PROXY_USER, (SANDBOX_UID, SANDBOX_UID), 0o400)
    # A server running as the sandboxes' own user owns what they must read already.
    return EgressUsers(f"{euid}:{egid}", None, 0o400 if euid == SANDBOX_UID else 0o404)


@dataclass(frozen=True)
class CallNetwork:
    """A network made for one call, the proxy joined to it."""

    name: str
    proxy_id: str  # the proxy container that joined it
    proxy_ip: str  # the proxy's address on it
    holder_id: str  # the container holding the call's network namespace on it
    deadline_ms: int  # its deadline label (unix epoch milliseconds)
    made: float = field(default_factory=time.monotonic)


@dataclass
class EgressCall:
    """One call's network and proxy registration."""

    execution_id: str
    network: str
    token: str = field(repr=False)
    holder: str = ""  # the holder container: the sandbox runs in its network namespace
    proxy_ip: str = ""  # the proxy's address on the network: its token is good there only
    env: tuple[tuple[str, str], ...] = field(repr=False, default=())
    mounts: tuple[Mount, ...] = ()
    secret_dir: Path | None = None
    # What the proxy is told at ``register``: the call's allow-list, injected
    # headers and caps. Empty ``allow``: the container was made ahead of its call
    # and no call is bound to it yet (``bind``): it cannot be registered.
    spec: EgressSpec | None = field(repr=False, default=None)
    pooled: bool = False  # its network came from the pool
    registered: bool = False  # the proxy knows its token
    closed: bool = False


class EgressGateway:
    def __init__(
        self, config: EgressConfig, *, name_prefix: str, labels: Mapping[str, str]
    ) -> None:
        self.config = config
        self.users = egress_users(os.geteuid(), os.getegid())
        self.ca = EgressCA(config.state_dir)
        self._name = f"{name_prefix}egress-proxy-{labels.get('io.toolreg.instance', 'x')}"
        self._name_prefix = name_prefix
        self._labels = dict(labels)
        self._lock = threading.Lock()
        self._proxy_id: str | None = None
        self._bundle: Path | None = None  # _trust_bundle, once written
        self.networks = NetworkPool(self, config.network_pool)

    @property
    def control_path(self) -> Path:
        return self.config.state_dir / "control" / "control.sock"

    # -- the proxy container ----------------------------------------------------------

    def _ensure_proxy(self, api: Any) -> str:
        """The running proxy's container id; started (again) when it is not there."""
        with self._lock:
            if self._proxy_id is not None:
                try:
                    control.request(self.control_path, {"op": "ping"}, timeout_s=2)
                    return self._proxy_id
                except control.ControlError:
                    log.warning("egress proxy stopped answering; starting a new one")
                    with contextlib.suppress(Exception):
                        api.remove_container(self._proxy_id, force=True)
                    self._proxy_id = None
            self._proxy_id = self._start_proxy(api)
            return self._proxy_id

    def _start_proxy(self, api: Any) -> str:
        cfg = self.config
        control_dir = self.control_path.parent
        control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The proxy runs unprivileged and creates its socket here; nobody else may.
        # Its user (EgressUsers): the sandboxes' for a root server, else the server's own.
        if self.users.hand_to is not None:
            with contextlib.suppress(PermissionError):
                os.chown(control_dir, *self.users.hand_to)
        control_dir.chmod(0o700)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        if not cfg.upstream_ca_file.is_file():
            raise SandboxError(f"egress: upstream CA file {cfg.upstream_ca_file} not found")
        with contextlib.suppress(Exception):
            api.remove_container(self._name, force=True)
        mounts = [
            {"Type": "bind", "Source": str(cfg.proxy_dir), "Target": "/opt/toolreg/egress",
             "ReadOnly": True},
            {"Type": "bind", "Source": str(control_dir), "Target": _CONTROL_TARGET,
             "ReadOnly": False},
            {"Type": "bind", "Source": str(cfg.upstream_ca_file.resolve()),
             "Target": _UPSTREAM_CA_TARGET, "ReadOnly": True},
        ]  # fmt: skip
        host_config = api.create_host_config(
            network_mode=cfg.upstream_networks[0],
            read_only=True,
            tmpfs={"/tmp": "rw,noexec,nosuid,nodev,size=16m"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=PROXY_MEMORY_MB * 1024 * 1024,
            memswap_limit=PROXY_MEMORY_MB * 1024 * 1024,
            pids_limit=PROXY_PIDS,
            dns=list(cfg.dns) or None,
            mounts=mounts,
            restart_policy={"Name": "no"},
        )
        try:
            created = api.create_container(
                image=cfg.image,
                command=[
                    "python3",
                    "-m",
                    "egress.proxy",
                    "--listen",
                    f"0.0.0.0:{PROXY_PORT}",
                    "--control",
                    f"{_CONTROL_TARGET}/control.sock",
                    "--upstream-ca",
                    _UPSTREAM_CA_TARGET,
                ],
                user=self.users.proxy_user,
                environment=["PYTHONPATH=/opt/toolreg", "PYTHONDONTWRITEBYTECODE=1"],
                name=self._name,
                labels=self._labels,
                host_config=host_config,
                use_config_proxy=False,
            )
            proxy_id: str = created["Id"]
            for network in cfg.upstream_networks[1:]:
                api.connect_container_to_network(proxy_id, network)
            api.start(proxy_id)
        except Exception as exc:
            raise SandboxError(f"egress: could not start the proxy: {exc}") from exc
        deadline = time.monotonic() + PROXY_START_TIMEOUT_S
        while True:
            try:
                control.request(self.control_path, {"op": "ping"}, timeout_s=2)
                break
            except control.ControlError as exc:
                if time.monotonic() > deadline:
                    logs = b""
                    with contextlib.suppress(Exception):
                        logs = api.logs(proxy_id, tail=20)
                    with contextlib.suppress(Exception):
                        api.remove_container(proxy_id, force=True)
                    raise SandboxError(
                        f"egress: the proxy did not start ({exc}): {logs.decode(errors='replace')}"
                    ) from exc
                time.sleep(0.05)
        log.info("egress proxy started (%s)", proxy_id[:12])
        return proxy_id

    def close(self, api: Any) -> None:
        """Stop the pool's refills, remove the proxy, then the pool's networks
        (with the proxy gone, nothing is attached to them)."""
        left = self.networks.close()
        with self._lock:
            if self._proxy_id is not None:
                with contextlib.suppress(Exception):
                    api.remove_container(self._proxy_id, force=True)
                self._proxy_id = None
        for network in left:
            self._remove_network(api, network.name, None, network.holder_id)

    @property
    def proxy_id(self) -> str | None:
        return self._proxy_id

    # -- one call ---------------------------------------------------------------------

    def open(self, api: Any, execution_id: str, spec: EgressSpec | None,
             secret_files: Mapping[str, bytes], *, deadline_ms: int = 0) -> EgressCall:  # fmt: skip
        """Prepare a call: its network (with egress: one from the pool, else
        made now) and its secret files, and the sandbox's proxy settings
        (a fresh token the proxy does not know yet: ``register``).
        ``deadline_ms``: the container's deadline label; its network's is never
        earlier. Undone by ``finish`` + ``release``; ``made`` once its container
        is started (or failed to be)."""
        call = EgressCall(execution_id, network="", token=token_source.token_urlsafe(32), spec=spec)
        try:
            if secret_files:
                call.secret_dir, call.mounts = self._write_secret_files(execution_id, secret_files)
            if spec is not None:
                self._take_network(api, call, spec, deadline_ms)
        except BaseException:
            self.release(api, call)
            raise
        return call

    def _take_network(self, api: Any, call: EgressCall, spec: EgressSpec, deadline_ms: int) -> None:
        proxy_id = self._ensure_proxy(api)
        network = self.networks.take(api, proxy_id, deadline_ms)
        if network is None:
            network = self._make_network(
                api, proxy_id, f"{self._name_prefix}net-{call.execution_id}", deadline_ms
            )
        else:
            call.pooled = True
        call.network, call.holder, call.proxy_ip = network.name, network.holder_id, network.proxy_ip
        url = f"http://toolreg:{call.token}@{network.proxy_ip}:{PROXY_PORT}"
        env = [(k, url) for k in _PROXY_ENV] + [("NO_PROXY", ""), ("no_proxy", "")]
        if spec.inject:
            env += [(k, CA_TARGET) for k in _CA_ENV]
            call.mounts += (Mount(str(self._trust_bundle()), CA_TARGET, read_only=True),)
        call.env = tuple(env)

    def _make_network(self, api: Any, proxy_id: str, name: str, deadline_ms: int) -> CallNetwork:
        """A new internal network, the proxy joined to it (removed again on failure)."""
        labels = {**self._labels, LABEL_DEADLINE: str(deadline_ms)} if deadline_ms else self._labels
        try:
            api.create_network(
                name,
                driver="bridge",
                internal=True,
                options={
                    "com.docker.network.bridge.inhibit_ipv4": "true",
                    "com.docker.network.bridge.enable_ip_masquerade": "false",
                },
                labels=labels,
            )
        except Exception as exc:
            raise SandboxError(f"egress: could not set up the call's network: {exc}") from exc
        try:
            api.connect_container_to_network(proxy_id, name)
            info = api.inspect_container(proxy_id)
            proxy_ip = str(info["NetworkSettings"]["Networks"][name]["IPAddress"])
            if not proxy_ip:
                raise SandboxError("the proxy has no address on it")
            holder = self._start_holder(api, name, labels)
        except Exception as exc:
            self._remove_network(api, name, proxy_id, f"{name}-holder")
            raise SandboxError(f"egress: could not set up the call's network: {exc}") from exc
        return CallNetwork(name, proxy_id, proxy_ip, holder, deadline_ms)

    def _start_holder(self, api: Any, network: str, labels: Mapping[str, str]) -> str:
        host_config = api.create_host_config(
            network_mode=network,
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=HOLDER_MEMORY_MB * 1024 * 1024,
            memswap_limit=HOLDER_MEMORY_MB * 1024 * 1024,
            pids_limit=HOLDER_PIDS,
            ipc_mode="none",
            dns=[UNROUTABLE_DNS],
            log_config={"Type": "none", "Config": {}},
            restart_policy={"Name": "no"},
        )
        created = api.create_container(
            image=HOLDER_IMAGE,
            command=list(HOLDER_COMMAND),
            user=PROXY_USER,
            name=f"{network}-holder",
            labels=dict(labels),
            host_config=host_config,
            use_config_proxy=False,
        )
        holder_id: str = created["Id"]
        api.start(holder_id)
        return holder_id

    def _make_pooled_network(self, api: Any) -> CallNetwork:
        proxy_id = self._ensure_proxy(api)
        deadline_ms = int((time.time() + NETWORK_MAX_AGE_S + NETWORK_LEASE_S) * 1000)
        name = f"{self._name_prefix}net-pool-{uuid.uuid4().hex}"
        return self._make_network(api, proxy_id, name, deadline_ms)

    def _remove_network(self, api: Any, name: str, proxy_id: str | None, holder: str = "") -> None:
        if holder:
            try:
                api.remove_container(holder, force=True)
            except Exception as exc:
                if getattr(exc, "status_code", None) != 404:
                    log.warning("egress: could not remove holder %s: %s", holder[:12], exc)
        if proxy_id is not None:
            with contextlib.suppress(Exception):
                api.disconnect_container_from_network(proxy_id, name, force=True)
        try:
            api.remove_network(name)
        except Exception as exc:
            if getattr(exc, "status_code", None) != 404:
                log.warning("egress: could not remove network %s: %s", name, exc)

    @staticmethod
    def bind(call: EgressCall, spec: EgressSpec, execution_id: str) -> None:
        """The grants of the call a container made ahead of it now serves (its
        allow-list, headers and caps as the policy says at this call) and the
        call's id (the proxy records its connections under it), to be
        registered by ``register``. Its injected hosts must be those the
        container was made for (the CA bundle is mounted for them)."""
        if call.registered or call.closed:
            raise SandboxError("egress: this sandbox's call was already registered")
        made_for = {(i.host, i.port) for i in (call.spec.inject if call.spec else ())}
        if {(i.host, i.port) for i in spec.inject} != made_for:
            raise SandboxError("egress: the call's secrets are not those the sandbox was made for")
        call.spec, call.execution_id = spec, execution_id

    def register(self, call: EgressCall) -> None:
        """Tell the proxy of the call's token, allow-list, headers and caps:
        the last step before the tool is released. Fails closed: a container
        made ahead of its call and never bound to one is refused."""
        spec = call.spec
        if not call.network or call.registered:
            return
        if spec is None or not spec.allow:
            raise SandboxError("egress: no call is bound to this sandbox; it was not released")
        inject = []
        for inj in spec.inject:
            cert_pem, key_pem = self.ca.leaf(inj.host)
            inject.append(
                {"host": inj.host, "port": inj.port, "header": inj.header, "value": inj.value,
                 "mask": list(inj.mask), "cert_pem": cert_pem, "key_pem": key_pem}
            )  # fmt: skip
        try:
            control.request(
                self.control_path,
                {"op": "open", "token": call.token, "execution_id": call.execution_id,
                 "tool": "", "address": call.proxy_ip, "egress": list(spec.allow),
                 "allow_private": list(spec.allow_private), "inject": inject,
                 "max_bytes": spec.max_bytes, "max_connections": spec.max_connections},
            )  # fmt: skip
        except control.ControlError as exc:
            raise SandboxError(f"egress: {exc}") from exc
        call.registered = True

    def _trust_bundle(self) -> Path:
        """What a sandbox with header-delivered secrets trusts: the upstream CAs
        (for hosts tunnelled as they are) plus this server's CA (for the hosts
        the proxy intercepts). SSL_CERT_FILE replaces a stack's default
        bundle, so both must be in the one file."""
        with self._lock:
            if self._bundle is None:
                # Written once per server: the CAs change only with a restart.
                self.ca.load_or_create()
                bundle = self.config.state_dir / "sandbox-trust.pem"
                tmp = bundle.with_suffix(".tmp")
                tmp.write_bytes(
                    self.config.upstream_ca_file.read_bytes().rstrip(b"\n")
                    + b"\n"
                    + self.ca.cert_path.read_bytes()
                )
                tmp.chmod(0o644)
                tmp.replace(bundle)
                self._bundle = bundle
            return self._bundle

    def _write_secret_files(
        self, execution_id: str, files: Mapping[str, bytes]
    ) -> tuple[Path, tuple[Mount, ...]]:
        # A directory only the server's user may enter on the host (the call's own,
        # made here, 0700); inside the sandbox only the bind mounts of the files are
        # visible, readable by the sandbox's user (EgressUsers: by owner or mode).
        run_dir = self.config.state_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        call_dir = run_dir / execution_id
        call_dir.mkdir(mode=0o700)
        mounts = []
        mode = self.users.secret_mode
        for name, value in files.items():
            path = call_dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)  # the umask may have taken bits the sandbox needs
                f.write(value)
            if self.users.hand_to is not None:
                with contextlib.suppress(PermissionError):
                    os.chown(path, *self.users.hand_to)
            mounts.append(Mount(str(path), f"{SECRETS_TARGET}/{name}", read_only=True))
        return call_dir, tuple(mounts)

    def finish(self, call: EgressCall) -> tuple[tuple[EgressConnection, ...], int]:
        """End the call at the proxy (its connections are cut) and collect its records."""
        if call.closed or not call.network:
            return (), 0
        call.closed = True
        if not call.registered:
            return (), 0  # the proxy never knew it: nothing to end, nothing recorded
        try:
            answer = control.request(self.control_path, {"op": "close", "token": call.token})
        except control.ControlError as exc:
            log.error("egress: could not collect the records of %s: %s", call.execution_id, exc)
            return (), 0
        records = tuple(_connection(r) for r in answer.get("connections") or [])
        return records, int(answer.get("unrecorded") or 0)

    def release(self, api: Any, call: EgressCall) -> None:
        """After the sandbox is gone: the network and the secret files go too."""
        self.finish(call)
        if call.secret_dir is not None:
            for path in call.secret_dir.glob("*"):
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                call.secret_dir.rmdir()
        if call.network:
            # Never back into the pool: a network serves one call.
            self._remove_network(api, call.network, self._proxy_id, call.holder)
            call.network = call.holder = ""


class NetworkPool:
    """Call networks made ahead of calls, the proxy already joined to each.

    A call takes one (``take``); it is removed after that call like a network
    made for it, never handed back. One thread refills the pool up to ``size``,
    backing off when the engine fails; before each engine request it yields to
    calls in flight (``after_call.yield_to_calls``, as the warm pools do), for
    at most ``after_call.YIELD_S`` from when the pool was first taken from.
    Networks older than NETWORK_MAX_AGE_S, or joined to a proxy that has since
    been replaced, are removed unused. Each carries the server's labels and a
    deadline, so the reaper removes those of a dead server."""

    def __init__(self, gateway: EgressGateway, size: int) -> None:
        self._gateway = gateway
        self.size = max(0, size)
        self._ready: collections.deque[CallNetwork] = collections.deque()
        self._stale: list[CallNetwork] = []  # for the refiller to remove (calls first)
        self._cond = threading.Condition()
        self._short_since = 0.0  # monotonic: first take since the pool was last full
        self._api: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._retry_at = 0.0  # monotonic time before which no refill is tried
        self._backoff = 0.0  # seconds waited after the last failure
        self.taken = 0  # calls that got a pooled network
        self.missed = 0  # calls that found none and made their own
        self.failures = 0  # refills the engine refused

    def ready(self) -> list[str]:
        """Names of the networks waiting for a call."""
        with self._cond:
            return [n.name for n in self._ready]

    def take(self, api: Any, proxy_id: str, deadline_ms: int) -> CallNetwork | None:
        """A network joined to this proxy whose deadline covers ``deadline_ms``,
        or None (the caller makes its own)."""
        if self.size == 0:
            return None
        now = time.monotonic()
        with self._cond:
            if self._closed:
                return None
            self._start(api)
            found = None
            keep: collections.deque[CallNetwork] = collections.deque()
            while self._ready:
                network = self._ready.popleft()
                if network.proxy_id != proxy_id or now - network.made > NETWORK_MAX_AGE_S:
                    self._stale.append(network)
                elif found is None and network.deadline_ms >= deadline_ms:
                    found = network
                else:
                    keep.append(network)
            self._ready = keep
            self._short_since = self._short_since or now
            if found is None:
                self.missed += 1
            else:
                self.taken += 1
            self._cond.notify_all()
            return found

    def close(self) -> list[CallNetwork]:
        """Stop refilling; the networks left unused, for the caller to remove."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=60)
        with self._cond:
            left = [*self._ready, *self._stale]
            self._ready.clear()
            self._stale.clear()
        return left

    def _start(self, api: Any) -> None:
        if self._thread is None:
            self._api = api
            self._thread = threading.Thread(target=self._work, name="egress-networks", daemon=True)
            self._thread.start()

    def _next(self) -> tuple[list[CallNetwork], bool] | None:
        """(stale networks to remove, whether to make one), waiting until there
        is something to do; None: closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                expired = [n for n in self._ready if now - n.made > NETWORK_MAX_AGE_S]
                if expired:
                    self._ready = collections.deque(n for n in self._ready if n not in expired)
                    self._stale += expired
                need = len(self._ready) < self.size and now >= self._retry_at
                if self._stale or need:
                    stale, self._stale = self._stale, []
                    return stale, need
                # Until the retry, or 1 s: the next expiry is at least that far (checked then).
                self._cond.wait(self._retry_at - now if now < self._retry_at else 1.0)
            return None

    def _work(self) -> None:
        gateway, api = self._gateway, self._api
        while True:
            job = self._next()
            if job is None:
                return
            stale, need = job
            after_call.yield_to_calls(self._short_since or time.monotonic())  # calls go first
            for network in stale:
                gateway._remove_network(api, network.name, network.proxy_id, network.holder_id)
            if not need:
                continue
            try:
                network = gateway._make_pooled_network(api)
            except Exception as exc:  # whatever it is, the refiller lives on
                with self._cond:
                    self.failures += 1
                    self._backoff = min(
                        max(NETWORK_REFILL_BACKOFF_S[0], self._backoff * 2),
                        NETWORK_REFILL_BACKOFF_S[1],
                    )
                    self._retry_at = time.monotonic() + self._backoff
                log.warning(
                    "egress: could not make a network ahead of calls (calls make their own"
                    " meanwhile; again in %.1f s): %s",
                    self._backoff,
                    exc,
                )
                continue
            with self._cond:
                if not self._closed:
                    self._ready.append(network)
                    self._backoff = 0.0
                    if len(self._ready) >= self.size:
                        self._short_since = 0.0
                    continue
            gateway._remove_network(api, network.name, network.proxy_id, network.holder_id)


def _connection(raw: Mapping[str, Any]) -> EgressConnection:
    return EgressConnection(
        host=str(raw.get("host", ""))[:253],
        port=int(raw.get("port") or 0),
        address=str(raw.get("address", ""))[:64],
        allowed=bool(raw.get("allowed")),
        reason=str(raw.get("reason", ""))[:200],
        bytes_up=int(raw.get("bytes_up") or 0),
        bytes_down=int(raw.get("bytes_down") or 0),
        duration_ms=int(raw.get("duration_ms") or 0),
        method=str(raw.get("method", ""))[:16],
        injected=bool(raw.get("injected")),
    )

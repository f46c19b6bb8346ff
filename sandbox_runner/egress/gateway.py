"""The server's egress gateway: one proxy container per server, and one
internal network per call that has egress.

A call's network is ``internal`` (no route off the bridge) and its bridge has
no address on the host (``inhibit_ipv4``), so the sandbox can reach exactly
one thing: the proxy container, which is attached to that network and to the
operator's upstream networks. Each call has its own network, so two
sandboxes never share a link, and its own proxy token, so a call's
connections are recorded under its execution id.

Engine calls go through the low-level Docker API client handed in by
docker_backend.py (the one module that imports ``docker``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets as token_source
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

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
PROXY_USER: Final = "65534:65534"
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


@dataclass
class EgressCall:
    """One call's network and proxy registration."""

    execution_id: str
    network: str
    token: str = field(repr=False)
    env: tuple[tuple[str, str], ...] = field(repr=False, default=())
    mounts: tuple[Mount, ...] = ()
    secret_dir: Path | None = None
    closed: bool = False


class EgressGateway:
    def __init__(
        self, config: EgressConfig, *, name_prefix: str, labels: Mapping[str, str]
    ) -> None:
        self.config = config
        self.ca = EgressCA(config.state_dir)
        self._name = f"{name_prefix}egress-proxy-{labels.get('io.toolreg.instance', 'x')}"
        self._name_prefix = name_prefix
        self._labels = dict(labels)
        self._lock = threading.Lock()
        self._proxy_id: str | None = None
        self._bundle: Path | None = None  # _trust_bundle, once written

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
        with contextlib.suppress(PermissionError):
            os.chown(control_dir, 65534, 65534)
        control_dir.chmod(0o700)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        if not cfg.upstream_ca_file.is_file():
            raise SandboxError(f"egress: upstream CA file {cfg.upstream_ca_file} not found")
        with contextlib.suppress(Exception):
            api.remove_container(self._name, force=True)
        mounts = [
            {"Type": "bind", "Source": str(PROXY_PACKAGE_DIR), "Target": "/opt/toolreg/egress",
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
                user=PROXY_USER,
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
        with self._lock:
            if self._proxy_id is not None:
                with contextlib.suppress(Exception):
                    api.remove_container(self._proxy_id, force=True)
                self._proxy_id = None

    # -- one call ---------------------------------------------------------------------

    def open(self, api: Any, execution_id: str, spec: EgressSpec | None,
             secret_files: Mapping[str, bytes]) -> EgressCall:  # fmt: skip
        """Prepare a call: its network and proxy registration (with egress), and
        its secret files. Undone by ``finish`` + ``release``."""
        call = EgressCall(execution_id, network="", token=token_source.token_urlsafe(32))
        try:
            if secret_files:
                call.secret_dir, call.mounts = self._write_secret_files(execution_id, secret_files)
            if spec is not None:
                self._open_network(api, call, spec)
        except BaseException:
            self.release(api, call)
            raise
        return call

    def _open_network(self, api: Any, call: EgressCall, spec: EgressSpec) -> None:
        proxy_id = self._ensure_proxy(api)
        name = f"{self._name_prefix}net-{call.execution_id}"
        try:
            api.create_network(
                name,
                driver="bridge",
                internal=True,
                options={
                    "com.docker.network.bridge.inhibit_ipv4": "true",
                    "com.docker.network.bridge.enable_ip_masquerade": "false",
                },
                labels=self._labels,
            )
            call.network = name
            api.connect_container_to_network(proxy_id, name)
            info = api.inspect_container(proxy_id)
            proxy_ip = info["NetworkSettings"]["Networks"][name]["IPAddress"]
        except Exception as exc:
            raise SandboxError(f"egress: could not set up the call's network: {exc}") from exc
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
                 "tool": "", "egress": list(spec.allow), "allow_private": list(spec.allow_private),
                 "inject": inject, "max_bytes": spec.max_bytes,
                 "max_connections": spec.max_connections},
            )  # fmt: skip
        except control.ControlError as exc:
            raise SandboxError(f"egress: {exc}") from exc
        url = f"http://toolreg:{call.token}@{proxy_ip}:{PROXY_PORT}"
        env = [(k, url) for k in _PROXY_ENV] + [("NO_PROXY", ""), ("no_proxy", "")]
        if spec.inject:
            env += [(k, CA_TARGET) for k in _CA_ENV]
            call.mounts += (Mount(str(self._trust_bundle()), CA_TARGET, read_only=True),)
        call.env = tuple(env)

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
        # A root-only directory on the host; inside the sandbox only the bind
        # mounts of the files are visible, readable by the sandbox's user.
        run_dir = self.config.state_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        call_dir = run_dir / execution_id
        call_dir.mkdir(mode=0o700)
        mounts = []
        for name, value in files.items():
            path = call_dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            with contextlib.suppress(PermissionError):
                os.chown(path, 65534, 65534)
            mounts.append(Mount(str(path), f"{SECRETS_TARGET}/{name}", read_only=True))
        return call_dir, tuple(mounts)

    def finish(self, call: EgressCall) -> tuple[tuple[EgressConnection, ...], int]:
        """End the call at the proxy (its connections are cut) and collect its records."""
        if call.closed or not call.network:
            return (), 0
        call.closed = True
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
            with contextlib.suppress(Exception):
                if self._proxy_id is not None:
                    api.disconnect_container_from_network(self._proxy_id, call.network, force=True)
            try:
                api.remove_network(call.network)
            except Exception as exc:
                log.warning("egress: could not remove network %s: %s", call.network, exc)


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

"""`toolreg doctor`: checks a host before it is trusted with tool calls (docs/how-to/deploying.md,
"toolreg doctor"). Each check reads the real thing (the engine, the store, the files,
the ports) with a bounded wait, changes nothing (a temporary file in the data directory
is made and removed, a port is bound and released), and returns one result per piece:
ok, warn (it works, with less than it could) or fail (a call or the server would fail),
with the command or setting that fixes it. The fixes for the engine, gVisor, the images
and the init are the ones `toolreg serve` and a call name too (sandbox_runner.pieces).
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import re
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit, urlunsplit

from registry_server.api.config import ServerConfig
from registry_server.domain.text import escape
from registry_server.execution.sandbox_plan import runsc_net_problem
from registry_server.install.images import (
    BUILD_HASH_LABEL,
    ROOT_IMAGE,
    SANDBOX_IMAGES,
    SOURCE_LABEL,
    image_sources,
)
from registry_server.install.packaged import EXAMPLE_TOOLS_DIR
from registry_server.version import version
from sandbox_runner.pieces import (
    elf_machine,
    engine_fix,
    gvisor_fix,
    host_elf_machine,
    images_fix,
    init_fix,
    init_problem,
    machine_name,
)
from sandbox_runner.profiles import GVISOR, GVISOR_NET, HOSTINET, NETSTACK, gvisor_network

if TYPE_CHECKING:
    from registry_server.policy.identity import IdentityProvider

__all__ = [
    "PROBE_TIMEOUT_S",
    "CheckResult",
    "Status",
    "exit_status",
    "redact_url",
    "render_json",
    "render_text",
    "run_checks",
]

PROBE_TIMEOUT_S: Final = 5.0  # seconds each network probe (engine, IdP discovery) may take
CERT_EXPIRY_WARN_DAYS: Final = 14  # days: a server certificate closer to expiry than this warns
JSON_FORMAT: Final = 1  # version of --json's shape; bumped only when a key changes meaning
RUNC: Final = "runc"
HOSTINET_DOCS: Final = "docs/how-to/deploying.md, 1. The engine"


class Status(enum.StrEnum):
    OK = "ok"
    WARN = "warn"  # works, with less than it could (e.g. development mode without gVisor)
    FAIL = "fail"  # a call or the server would fail: the exit status says so


@dataclass(frozen=True)
class CheckResult:
    name: str  # stable: scripts select checks by it (docs/how-to/deploying.md lists them)
    status: Status
    detail: str
    fix: str = ""  # the command or setting that fixes it; "" when nothing needs fixing

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
        }


def _ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.OK, detail)


def _warn(name: str, detail: str, fix: str) -> CheckResult:
    return CheckResult(name, Status.WARN, detail, fix)


def _fail(name: str, detail: str, fix: str) -> CheckResult:
    return CheckResult(name, Status.FAIL, detail, fix)


# -- output -----------------------------------------------------------------------------

_MARKS: Final = {Status.OK: "ok  ", Status.WARN: "warn", Status.FAIL: "FAIL"}


def exit_status(results: Sequence[CheckResult]) -> int:
    """1 when any check failed; warnings alone leave it 0."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0


def render_text(results: Sequence[CheckResult]) -> str:
    """One line per check, and under a warning or failure the line with its fix."""
    width = max((len(r.name) for r in results), default=0)
    lines: list[str] = []
    for r in results:
        # A detail may quote what a server or a file said: shown, never obeyed by the terminal.
        lines.append(f"{_MARKS[r.status]}  {r.name.ljust(width)}  {escape(r.detail)}")
        if r.fix:
            lines.append(f"{' ' * (len(_MARKS[r.status]) + 2 + width)}  fix: {escape(r.fix)}")
    failed = sum(r.status is Status.FAIL for r in results)
    warned = sum(r.status is Status.WARN for r in results)
    lines.append(
        f"toolreg {version()}: {failed} failed, {warned} warning(s), {len(results)} checks"
    )
    return "\n".join(lines)


def render_json(results: Sequence[CheckResult]) -> str:
    """The same results for scripts: stable keys, one object."""
    document = {
        "format": JSON_FORMAT,
        "version": version(),
        "ok": exit_status(results) == 0,
        "checks": [r.to_json() for r in results],
    }
    return json.dumps(document, indent=2)


def redact_url(url: str) -> str:
    """A URL as doctor may print it: no userinfo (user and password), no query or
    fragment (tokens travel there)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    if not parts.scheme:
        return urlunsplit(("", netloc, parts.path, "", ""))
    # Built by hand: urlunsplit drops the "//" of an empty host (unix:///path).
    return f"{parts.scheme}://{netloc}{parts.path}"


_URL_IN_TEXT: Final = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s\"']+")
_TRAILING: Final = ".,;:)"  # punctuation of the sentence a URL ends


def _scrub_urls(text: str) -> str:
    """``text`` with every URL in it as redact_url shows it (a store's or a library's
    message may quote the URL it was given, user and query included)."""

    def scrubbed(found: re.Match[str]) -> str:
        url = found.group(0)
        core = url.rstrip(_TRAILING)
        return redact_url(core) + url[len(core) :]

    return _URL_IN_TEXT.sub(scrubbed, text)


# -- the checks ---------------------------------------------------------------------------


def run_checks(
    config: ServerConfig,
    *,
    tools_dir: Path | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[CheckResult]:
    """Every check, in the order a newcomer fixes them: engine first, ports last.
    ``tools_dir``: serve's --tools, the manifests it would register (their images
    must be on the engine) and the sources the images were built from (default:
    the packaged examples, for the images' source hashes only)."""
    results: list[CheckResult] = []
    tools: list[ToolImage] | None = None
    if tools_dir is not None:
        tools, loaded = load_tool_images(tools_dir)
        results.append(loaded)
    results.extend(_engine_checks(config, tools_dir or EXAMPLE_TOOLS_DIR, tools, timeout_s))
    results.append(check_init(config.init_path))
    results.append(check_data_dir(config.data_dir))
    results.append(check_store(config.store))
    results.extend(check_policy(config.policy_file, timeout_s=timeout_s))
    results.extend(check_tls(config.tls_cert, config.tls_key, config.tls_client_ca))
    results.extend(check_ports(config))
    return results


@dataclass(frozen=True)
class ToolImage:
    tool: str
    image: str  # as the engine names it locally: with its tag (":latest" when none)


def local_image_name(image: str) -> str:
    """The reference as the engine stores it: a name without a tag or digest is
    ":latest" (a ":" before the last "/" is a registry's port, not a tag)."""
    last = image.rsplit("/", 1)[-1]
    return image if ":" in last or "@" in last else f"{image}:latest"


def load_tool_images(tools_dir: Path) -> tuple[list[ToolImage] | None, CheckResult]:
    """The manifests under ``tools_dir`` as serve loads them, and the images they
    name; None and a failure when serve would refuse them."""
    from registry_server.domain.errors import ToolregError
    from registry_server.domain.manifests import load_manifests

    try:
        tools = load_manifests(tools_dir)
    except ToolregError as exc:
        return None, _fail(
            "tools",
            f"{tools_dir}: {exc.message}",
            "correct the manifest it names (serve refuses it too)",
        )
    found = [ToolImage(t.name, local_image_name(t.sandbox.image)) for t in tools]
    return found, _ok("tools", f"{tools_dir}: {len(found)} manifest(s)")


def check_tool_images(
    tools: Sequence[ToolImage], labels: Mapping[str, Mapping[str, str] | None]
) -> CheckResult:
    """Every image the manifests name is on the engine: a call to a tool whose
    image is missing fails."""
    missing = sorted({t.image for t in tools if labels.get(t.image) is None})
    if not missing:
        return _ok("tool_images", f"the {len(tools)} tool(s)' images are present")
    whose = ", ".join(
        f"{image} ({', '.join(sorted(t.tool for t in tools if t.image == image))})"
        for image in missing
    )
    ours = all(image in SANDBOX_IMAGES for image in missing)
    fix = images_fix() if ours else "build or load these images on this engine (nothing is pulled)"
    return _fail("tool_images", f"missing: {whose}", fix)


def _require_gvisor(config: ServerConfig) -> bool:
    # As the server decides (api/app.py): unset means required with a policy.
    if config.require_gvisor is not None:
        return config.require_gvisor
    return config.policy_file is not None


def _engine_address(config: ServerConfig) -> str:
    where = config.docker_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    return redact_url(where)


def _engine_checks(
    config: ServerConfig, tools_dir: Path, tools: list[ToolImage] | None, timeout_s: float
) -> Iterator[CheckResult]:
    # Imported here: the engine's client library is loaded only by the checks that use it.
    from sandbox_runner.docker_backend import probe_engine
    from sandbox_runner.spec import EngineUnavailable

    where = _engine_address(config)
    try:
        wanted = tuple(dict.fromkeys([*SANDBOX_IMAGES, *(t.image for t in tools or ())]))
        facts = probe_engine(config.docker_url, wanted, timeout_s=timeout_s)
    except EngineUnavailable as exc:
        yield _fail(
            "engine", f"no Docker engine answers at {where}: {_scrub_urls(str(exc))}", engine_fix()
        )
        for name in (f"runtime.{RUNC}", f"runtime.{GVISOR}", f"runtime.{GVISOR_NET}"):
            yield _warn(name, "not checked: no engine answers", "")
        for image in SANDBOX_IMAGES:
            yield _warn(f"image.{image}", "not checked: no engine answers", "")
        if tools is not None:
            yield _warn("tool_images", "not checked: no engine answers", "")
        return
    cgroup = f"cgroup v{facts.cgroup_version}" if facts.cgroup_version else "cgroup version unknown"
    driver = f" ({facts.cgroup_driver})" if facts.cgroup_driver else ""
    yield _ok("engine", f"Docker {facts.version} at {where}, {cgroup}{driver}")
    yield from check_runtimes(
        facts.runtimes,
        require_gvisor=_require_gvisor(config),
        allow_hostinet=config.gvisor_hostinet == "allow",
    )
    yield from check_images(facts.images, tools_dir)
    if tools is not None:
        yield check_tool_images(tools, facts.images)


def check_runtimes(
    runtimes: Mapping[str, tuple[str, ...]], *, require_gvisor: bool, allow_hostinet: bool
) -> Iterator[CheckResult]:
    """runc, and gVisor's two runtimes as the server would use them: missing runsc
    fails only where dangerous tools would need it (require_gvisor), as the server
    refuses them there; elsewhere they run under runc, a warning."""
    if RUNC in runtimes:
        yield _ok(f"runtime.{RUNC}", "present (safe and cautious tools)")
    else:
        yield _fail(f"runtime.{RUNC}", "the engine offers no runc runtime", engine_fix())
    make = _fail if require_gvisor else _warn
    if GVISOR in runtimes:
        args = " ".join(runtimes[GVISOR])
        yield _ok(f"runtime.{GVISOR}", f"present ({args or 'no arguments'}): dangerous tools")
    else:
        consequence = (
            "dangerous tools will be refused (gVisor is required)"
            if require_gvisor
            else "dangerous tools run under runc (development mode; TOOLREG_REQUIRE_GVISOR=true"
            " refuses them instead)"
        )
        yield make(f"runtime.{GVISOR}", f"missing: {consequence}", gvisor_fix())
    net_args = runtimes.get(GVISOR_NET)
    problem = runsc_net_problem(net_args, allow_hostinet)
    name = f"runtime.{GVISOR_NET}"
    if net_args is None:
        yield make(name, "missing: dangerous tools with egress will be refused", gvisor_fix())
    elif problem is not None:
        yield make(
            name,
            f"dangerous tools with egress will be refused: {GVISOR_NET}, {problem}",
            gvisor_fix(),
        )
    elif gvisor_network(net_args) == HOSTINET:
        yield _warn(
            name,
            f"present, network mode {HOSTINET} ({' '.join(net_args)}): a tool's socket calls"
            " reach the host kernel's network stack, inside the call's own namespace",
            "install runsc from gVisor release-20240801 or later, then "
            + gvisor_fix()
            + f" for gVisor's {NETSTACK}; TOOLREG_GVISOR_HOSTINET=refuse refuses such calls"
            f" ({HOSTINET_DOCS})",
        )
    else:
        yield _ok(name, f"present, network mode {NETSTACK} ({' '.join(net_args) or 'default'})")


def check_images(
    labels: Mapping[str, Mapping[str, str] | None], tools_dir: Path = EXAMPLE_TOOLS_DIR
) -> Iterator[CheckResult]:
    """Each sandbox image present; ours built from this version's sources (the
    io.toolreg.source-hash label build.sh sets, recomputed here)."""
    expected = {s.image: s.source_hash() for s in image_sources(tools_dir)}
    for image in SANDBOX_IMAGES:
        name = f"image.{image}"
        found = labels.get(image)
        if found is None:
            yield _fail(name, "missing: calls to tools in it fail", images_fix())
            continue
        if image == ROOT_IMAGE:  # Debian's root: no sources of ours to compare
            build = found.get(BUILD_HASH_LABEL, "")
            yield _ok(name, f"present (build {build[:12] or 'unlabelled'})")
            continue
        want, have = expected[image], found.get(SOURCE_LABEL)
        if have == want:
            yield _ok(name, f"present, sources of this version ({want[:12]})")
        elif have is None:
            yield _warn(
                name, f"present, but built without {SOURCE_LABEL} (an older toolreg)", images_fix()
            )
        else:
            yield _warn(
                name,
                f"present, but built from other sources ({have[:12]}; this version's and"
                f" {tools_dir}'s: {want[:12]})",
                images_fix(),
            )


def check_init(path: Path) -> CheckResult:
    """The init every sandbox runs first: a regular file, o+x, an ELF for this machine."""
    problem = init_problem(path)
    if problem is not None:
        return _fail("init", str(problem), f"{init_fix()} (or set TOOLREG_INIT_PATH)")
    with open(path, "rb") as f:
        machine = elf_machine(f.read(64))
    arch = machine_name(machine) if machine is not None else "?"
    host = host_elf_machine()
    note = "" if host is not None else " (this machine's architecture is not one doctor knows)"
    return _ok("init", f"{path}: ELF for {arch}{note}")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _try_write(directory: Path) -> str | None:
    """None when a file can be made and removed in ``directory``, else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".toolreg-doctor-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_data_dir(path: Path) -> CheckResult:
    """The data directory takes files (a real file made and removed: a permission
    check alone passes root on a read-only mount); one not there yet must be
    creatable, as the server makes it at start."""
    fix = f"make {path} a directory this user can write, or set --data-dir/TOOLREG_DATA_DIR"
    if path.exists() and not path.is_dir():
        return _fail("data_dir", f"{path} is not a directory", fix)
    where = path if path.is_dir() else _nearest_existing(path)
    if not where.is_dir():
        return _fail("data_dir", f"{path} cannot be created: {where} is not a directory", fix)
    why = _try_write(where)
    if why is not None:
        return _fail("data_dir", f"{where} is not writable: {why}", fix)
    if where != path:
        return _ok("data_dir", f"{path} does not exist yet; {where} lets the server create it")
    return _ok("data_dir", f"{path} is writable")


def check_store(url: str) -> CheckResult:
    """The store reachable, and its schema at this version: behind is migrated at
    start (a warning: back it up first), ahead is refused by this version (fail)."""
    from registry_server.store.inspect import StoreUnreachable, inspect_store
    from registry_server.store.release import newer_store_error

    shown = redact_url(url) if "://" in url and not url.startswith("sqlite") else url
    try:
        state = inspect_store(url)
    except StoreUnreachable as exc:
        message = _scrub_urls(str(exc))
        fix = (
            "start PostgreSQL, or correct --store-url/TOOLREG_STORE_URL"
            if url.startswith("postgres")
            else "correct --store-url/TOOLREG_STORE_URL or the file's permissions"
        )
        detail = message if redact_url(url) in message else f"{shown}: {message}"
        return _fail("store", detail, fix)
    except ValueError as exc:
        return _fail("store", str(exc), "--store-url sqlite:///PATH or postgresql://...")
    where = f"{state.kind} {_scrub_urls(state.location)}"
    if state.schema_version == 0:
        return _ok("store", f"{where}: no store yet; created at the first start")
    if state.ahead:
        error = newer_store_error(
            state.location, state.schema_version, state.known_version, state.written_by
        )
        return _fail(
            "store",
            _scrub_urls(error.message),
            f"install toolreg {state.written_by or 'of that release'} or newer"
            " (docs/how-to/deploying.md, Upgrades)",
        )
    by = f", last opened by toolreg {state.written_by}" if state.written_by else ""
    if state.behind:
        return _warn(
            "store",
            f"{where}: schema {state.schema_version}{by}; toolreg {version()} migrates it to"
            f" schema {state.known_version} at start",
            "back the store up first (docs/how-to/deploying.md, Upgrades), then toolreg serve",
        )
    return _ok("store", f"{where}: schema {state.schema_version} (this version's){by}")


def check_policy(path: Path | None, *, timeout_s: float = PROBE_TIMEOUT_S) -> list[CheckResult]:
    """The policy file valid (the server's own loader), and each identity provider's
    discovery document (or its jwks_uri) answering."""
    if path is None:
        return [_ok("policy", "none given: development mode (loopback only, every client allowed)")]
    from registry_server.policy.loader import load_policy
    from registry_server.policy.model import PolicyError

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        shown = list(exc.problems[:5])
        more = len(exc.problems) - len(shown)
        detail = "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
        return [
            _fail("policy", f"invalid: {detail}", f"correct {path}; toolreg policy check {path}")
        ]
    providers = policy.identity_providers
    counts = f"{len(policy.approvers)} approver(s), {len(providers)} identity provider(s)"
    results = [_ok("policy", f"{path}: valid, {counts}")]
    results.extend(_check_provider(p, timeout_s) for p in providers)
    return results


def _check_provider(provider: IdentityProvider, timeout_s: float) -> CheckResult:
    import httpx

    from registry_server.api.auth.jwks import DISCOVERY_PATH, FetchError, HttpFetcher

    name = f"idp.{provider.id}"
    issuer = redact_url(provider.issuer)
    fix = (
        f"make {issuer} reachable from this host (network, ca_file), or correct the policy's"
        f" identity_providers entry {provider.id}"
    )
    try:
        fetcher = HttpFetcher(provider)
    except FetchError as exc:
        return _fail(name, f"{issuer}: {exc}", fix)
    fetcher.client.timeout = httpx.Timeout(timeout_s)
    try:
        if provider.jwks_uri is not None:
            document = fetcher(provider.jwks_uri)
            if not isinstance(document.get("keys"), list):
                return _fail(name, f"{redact_url(provider.jwks_uri)}: no keys in the JWKS", fix)
            return _ok(
                name, f"JWKS at {redact_url(provider.jwks_uri)}: {len(document['keys'])} key(s)"
            )
        document = fetcher(provider.issuer.rstrip("/") + DISCOVERY_PATH)
    except FetchError as exc:
        return _fail(name, f"discovery at {issuer}: {exc}", fix)
    finally:
        fetcher.close()
    if document.get("issuer") != provider.issuer:
        return _fail(name, f"discovery at {issuer} names another issuer", fix)
    if not isinstance(document.get("jwks_uri"), str):
        return _fail(name, f"discovery at {issuer} has no jwks_uri", fix)
    return _ok(name, f"discovery at {issuer} answers")


def check_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> list[CheckResult]:
    """The server certificate and key readable and a pair, the client CA readable."""
    if cert is None and key is None:
        if client_ca is not None:
            return [
                _fail(
                    "tls",
                    "--tls-client-ca without a server certificate",
                    "give --tls-cert and --tls-key too",
                )
            ]
        return [
            _ok(
                "tls",
                "off (plaintext: serve refuses a --host beyond loopback without it, unless"
                " TOOLREG_ALLOW_INSECURE_REMOTE=true)",
            )
        ]
    if cert is None or key is None:
        return [
            _fail(
                "tls",
                "TLS needs both a certificate and its key",
                "give both --tls-cert and --tls-key (TOOLREG_TLS_CERT/KEY)",
            )
        ]
    results = [_check_pair(cert, key)]
    if client_ca is not None:
        results.append(_check_client_ca(client_ca))
    return results


def _check_pair(cert_path: Path, key_path: Path) -> CheckResult:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    fix = "--tls-cert and --tls-key: a PEM certificate and the unencrypted PEM key it was made for"
    try:
        certs = x509.load_pem_x509_certificates(cert_path.read_bytes())
    except OSError as exc:
        return _fail("tls", f"cannot read the certificate {cert_path}: {exc.strerror}", fix)
    except ValueError:
        return _fail("tls", f"{cert_path} holds no PEM certificate", fix)
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        return _fail("tls", f"cannot read the key {key_path}: {exc.strerror}", fix)
    except (ValueError, TypeError):
        # TypeError: encrypted (the server reads it unattended); never say more of it
        return _fail("tls", f"{key_path} holds no unencrypted PEM private key", fix)
    leaf = certs[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if leaf.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        return _fail("tls", f"the key {key_path} does not match the certificate {cert_path}", fix)
    now = dt.datetime.now(dt.UTC)
    ends = leaf.not_valid_after_utc
    subject = leaf.subject.rfc4514_string()
    if ends <= now or leaf.not_valid_before_utc > now:
        return _fail(
            "tls",
            f"{subject}: not valid now (valid until {ends:%Y-%m-%d})",
            "renew the certificate",
        )
    if ends - now < dt.timedelta(days=CERT_EXPIRY_WARN_DAYS):
        return _warn(
            "tls",
            f"{subject}: certificate and key match; expires {ends:%Y-%m-%d %H:%M} UTC",
            "renew the certificate",
        )
    return _ok("tls", f"{subject}: certificate and key match, valid until {ends:%Y-%m-%d}")


def _check_client_ca(path: Path) -> CheckResult:
    from cryptography import x509

    fix = "--tls-client-ca: the PEM CA certificate(s) that sign client certificates"
    try:
        cas = x509.load_pem_x509_certificates(path.read_bytes())
    except OSError as exc:
        return _fail("tls.client_ca", f"cannot read {path}: {exc.strerror}", fix)
    except ValueError:
        return _fail("tls.client_ca", f"{path} holds no PEM certificate", fix)
    return _ok("tls.client_ca", f"{path}: {len(cas)} CA certificate(s); clients need one (mTLS)")


def _port_free(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound now (and is released at once), else why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host} does not resolve: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As a server binds: a port whose last connection is in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _check_port(name: str, host: str, port: int, setting: str) -> CheckResult:
    if port == 0:
        return _ok(name, f"{host}:0: any free port, chosen at start")
    why = _port_free(host, port)
    if why is not None:
        return _fail(
            name,
            f"{host}:{port} cannot be bound: {why}",
            f"stop what listens there (ss -ltnp 'sport = :{port}'), or set {setting} to another",
        )
    return _ok(name, f"{host}:{port} is free")


def check_ports(config: ServerConfig) -> list[CheckResult]:
    """The gRPC port and the metrics port free on this host (bound, then released)."""
    results = [_check_port("port.grpc", config.host, config.port, "--port/TOOLREG_PORT")]
    if config.metrics_port is None:
        results.append(_ok("port.metrics", "off (--metrics-port not set)"))
    elif config.metrics_port == config.port != 0 and config.metrics_host == config.host:
        results.append(
            _fail(
                "port.metrics",
                f"{config.metrics_port} is the gRPC port too",
                "--metrics-port/TOOLREG_METRICS_PORT another port",
            )
        )
    else:
        results.append(
            _check_port(
                "port.metrics",
                config.metrics_host,
                config.metrics_port,
                "--metrics-port/TOOLREG_METRICS_PORT",
            )
        )
    return results

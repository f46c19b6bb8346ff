"""What ``toolreg mcp --http HOST:PORT`` serves, checked before anything
listens (``check_settings``; the server itself: ``http.py``). Apart from
the server, so that reading and checking them does not import the MCP SDK."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from registry_server.domain.arguments import MAX_ARGUMENTS_BYTES
from registry_server.domain.errors import ConfigError
from registry_server.domain.models import SafetyLevel
from registry_server.policy.identity import IdentityProvider, check_provider_url
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError
from registry_server.web.listener import (
    check_listener,
    is_loopback,
    parse_endpoint,
    read_client_secret,
)

# bytes of one request body: the largest arguments the registry accepts, plus
# room for the JSON-RPC envelope around them
DEFAULT_MAX_BODY_BYTES = MAX_ARGUMENTS_BYTES + 64 * 1024
DEFAULT_MAX_SESSIONS = 64  # MCP sessions open at once; the next gets 503 until one ends
DEFAULT_SESSION_IDLE_S = 600.0  # seconds without a request before a session is closed
DEFAULT_APPROVAL_STATE_TTL_S = 900.0  # seconds a sealed requestState of an approval is accepted
MAX_URL_CHARS = 2048  # characters of a console URL
CLIENT_SECRET_ENV = "TOOLREG_OAUTH_CLIENT_SECRET"  # the bridge's secret at the IdP (never argv)


@dataclass(frozen=True)
class ResumeLimits:
    """How much of the SSE streams the bridge keeps so that a client whose
    stream dropped can resume it with ``Last-Event-ID`` (event_store.py).
    Every bound holds at once; the least recently written stream goes first
    (overall: of the principal holding the most, event_store.py)."""

    events_per_stream: int = 1024  # a stream's oldest events are dropped beyond this
    bytes_per_stream: int = 8 * 1024 * 1024  # likewise; a single larger event ends resumption
    streams: int = 256  # streams held, across all sessions
    total_bytes: int = 64 * 1024 * 1024  # bytes held, across all sessions
    ttl_s: float = 600.0  # seconds a stream is kept after its last event

    def problems(self) -> list[str]:
        """What is wrong with these limits (empty when they are usable)."""
        found = [
            f"{name} must be a positive number"
            for name, value in vars(self).items()
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0)
        ]
        if not found and self.bytes_per_stream > self.total_bytes:
            found.append("bytes_per_stream must not exceed total_bytes")
        return found


@dataclass(frozen=True)
class OAuthSettings:
    """``--oauth-provider``: the bridge as a resource server of one of the
    policy's identity providers (oauth.py)."""

    provider: IdentityProvider  # whose tokens hosts bring
    resource_url: str  # this bridge's MCP URL: the audience hosts' tokens must name
    scopes: tuple[str, ...]  # scopes a host's token must carry
    client_id: str  # the bridge's own client at the provider (for token exchange)
    client_secret: str = field(repr=False)
    registry_resource: str = ""  # the registry's audience, asked for in the exchange

    @property
    def metadata_url(self) -> str:
        # RFC 9728 section 3.1: the well-known part goes between host and path.
        parts = urlsplit(self.resource_url)
        return f"{parts.scheme}://{parts.netloc}/.well-known/oauth-protected-resource{parts.path}"


@dataclass(frozen=True)
class HttpSettings:
    """What ``--http`` serves, checked by ``check_settings`` before anything binds."""

    host: str
    port: int
    policy: Policy | None  # None only with insecure_dev
    insecure_dev: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host header values beyond this listener's own
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_level: SafetyLevel | None = None
    categories: tuple[str, ...] = ()
    oauth: OAuthSettings | None = None
    resume: ResumeLimits = ResumeLimits()  # SSE events kept for Last-Event-ID
    console_url: str = ""  # the approval console's base URL: approvals as input requests
    approval_state_ttl_s: float = DEFAULT_APPROVAL_STATE_TTL_S

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def check_settings(settings: HttpSettings) -> None:
    """Fail closed: refuse what would expose the registry (ConfigError)."""
    loopback = is_loopback(settings.host)
    if settings.policy is None and not settings.insecure_dev:
        raise ConfigError(
            "--http needs --policy FILE: the policy whose clients' bearer tokens it accepts"
            " (the file `toolreg serve` reads); for development on loopback only,"
            " --insecure-dev serves without authentication"
        )
    if settings.policy is not None and settings.insecure_dev:
        raise ConfigError("--insecure-dev and --policy exclude each other")
    if settings.insecure_dev and not loopback:
        raise ConfigError(
            f"refusing to serve MCP on {settings.host} with --insecure-dev: without"
            " authentication it listens on loopback only (127.0.0.1, ::1, localhost)"
        )
    problems = settings.resume.problems()
    if problems:
        raise ConfigError("--resume-*: " + "; ".join(problems))
    if settings.oauth is not None:
        _check_oauth(settings.oauth)
    elif settings.policy is not None and not any(c.token_sha256 for c in settings.policy.clients):
        raise ConfigError(
            f"{settings.policy.source}: no client has a token_sha256, so no MCP client could"
            " authenticate over HTTP"
        )
    check_listener(
        settings.host, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
        allowed_hosts=settings.allowed_hosts, serving="MCP",
        caps=(settings.max_sessions, settings.session_idle_s, settings.max_body_bytes),
    )  # fmt: skip


def _check_oauth(oauth: OAuthSettings) -> None:
    try:
        # http only to loopback, where the bridge itself may listen without TLS
        check_provider_url(oauth.resource_url, "--resource-url", allow_http_loopback=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if urlsplit(oauth.resource_url).path != "/mcp":
        raise ConfigError("--resource-url: must be this bridge's MCP endpoint (its path is /mcp)")
    if not oauth.client_id or not oauth.client_secret:
        raise ConfigError(
            f"--oauth-provider needs --oauth-client-id and its secret ({CLIENT_SECRET_ENV} or"
            " --oauth-client-secret-file): the bridge exchanges hosts' tokens for registry"
            " tokens as its own client at the identity provider"
        )
    if not oauth.registry_resource:
        raise ConfigError("--registry-resource: the registry's audience is needed")


def oauth_settings(
    policy: Policy | None,
    provider_id: str,
    *,
    resource_url: str | None,
    scopes: Sequence[str] = (),
    client_id: str | None = None,
    client_secret_file: Path | None = None,
    registry_resource: str | None = None,
) -> OAuthSettings:
    """The --oauth-* options as settings; ConfigError names the problem."""
    if policy is None:
        raise ConfigError("--oauth-provider needs --policy FILE, which names the provider")
    provider = policy.identity_provider(provider_id)
    if provider is None:
        known = ", ".join(p.id for p in policy.identity_providers) or "none"
        raise ConfigError(f"--oauth-provider {provider_id!r}: not in {policy.source} ({known})")
    if not resource_url:
        raise ConfigError("--oauth-provider needs --resource-url: this bridge's public MCP URL")
    secret = read_client_secret(CLIENT_SECRET_ENV, client_secret_file, "--oauth-client-secret-file")
    return OAuthSettings(
        provider=provider, resource_url=resource_url, scopes=tuple(scopes),
        client_id=client_id or "", client_secret=secret,
        registry_resource=registry_resource or provider.audiences[0],
    )  # fmt: skip


def resume_limits(ttl_s: float | None, max_bytes: int | None) -> ResumeLimits:
    """``--resume-ttl-s`` and ``--resume-max-bytes`` (None = the default). A
    total below the per-stream default lowers that too, so one flag suffices."""
    base = ResumeLimits()
    total = base.total_bytes if max_bytes is None else max_bytes
    return ResumeLimits(
        events_per_stream=base.events_per_stream,
        bytes_per_stream=min(base.bytes_per_stream, total) if total > 0 else base.bytes_per_stream,
        streams=base.streams,
        total_bytes=total,
        ttl_s=base.ttl_s if ttl_s is None else ttl_s,
    )


def http_settings(
    endpoint: str,
    *,
    policy_file: Path | None,
    insecure_dev: bool = False,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    max_sessions: int | None = None,
    session_idle_s: float | None = None,
    max_body_bytes: int | None = None,
    max_level: SafetyLevel | None = None,
    categories: Sequence[str] = (),
    oauth_provider: str | None = None,
    resource_url: str | None = None,
    oauth_scopes: Sequence[str] = (),
    oauth_client_id: str | None = None,
    oauth_client_secret_file: Path | None = None,
    registry_resource: str | None = None,
    resume_ttl_s: float | None = None,
    resume_max_bytes: int | None = None,
    console_url: str | None = None,
    approval_state_ttl_s: float | None = None,
) -> HttpSettings:
    """The CLI's options as checked settings (None = the default); ConfigError
    names the first problem, PolicyError's lines included."""
    host, port = parse_endpoint(endpoint)
    policy = None
    if policy_file is not None:
        try:
            policy = load_policy(policy_file)
        except PolicyError as exc:
            raise ConfigError(str(exc)) from None
    settings = HttpSettings(
        host=host,
        port=port,
        policy=policy,
        insecure_dev=insecure_dev,
        allowed_hosts=tuple(allowed_hosts),
        allowed_origins=tuple(allowed_origins),
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_sessions=DEFAULT_MAX_SESSIONS if max_sessions is None else max_sessions,
        session_idle_s=DEFAULT_SESSION_IDLE_S if session_idle_s is None else session_idle_s,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
        max_level=max_level,
        categories=tuple(categories),
        resume=resume_limits(resume_ttl_s, resume_max_bytes),
        # Default: the console the policy's webhooks link to.
        console_url=check_console_url(
            console_url if console_url is not None else policy.console_url if policy else ""
        ),
        approval_state_ttl_s=check_state_ttl(approval_state_ttl_s),
        oauth=None
        if oauth_provider is None
        else oauth_settings(
            policy,
            oauth_provider,
            resource_url=resource_url,
            scopes=oauth_scopes,
            client_id=oauth_client_id,
            client_secret_file=oauth_client_secret_file,
            registry_resource=registry_resource,
        ),
    )
    check_settings(settings)
    return settings


def check_console_url(url: str) -> str:
    """The approval console's base URL, as given to ``--console-url``: http(s),
    no credentials, query or fragment (the bridge adds ``/#/requests/ID``);
    "" for none. ConfigError otherwise."""
    if not url:
        return ""
    parts = urlsplit(url)
    if (
        len(url) > MAX_URL_CHARS
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.password is not None
        or parts.query
        or parts.fragment
    ):
        raise ConfigError(
            "--console-url: an http(s) URL of the approval console, without credentials,"
            f" query or fragment (at most {MAX_URL_CHARS} characters)"
        )
    return url.rstrip("/")


def check_state_ttl(ttl_s: float | None) -> float:
    if ttl_s is None:
        return DEFAULT_APPROVAL_STATE_TTL_S
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= 86_400):
        raise ConfigError("--approval-state-ttl-s: a number of seconds, above 0, at most 86400")
    return ttl_s

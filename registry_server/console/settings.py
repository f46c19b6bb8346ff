"""What ``toolreg console`` accepts before anything listens, checked to fail
closed (docs/how-to/approvals.md, "The approval console").

The console holds approvers' sessions and passes their bearer tokens on to the
registry, so it refuses whatever would expose them: no policy (nobody to check
a token against, and no development mode: a page that signs approvals must
know who is signing), a policy in which no client could sign in, plain HTTP
beyond loopback, and an every-interface listener with no Host name to check
against DNS rebinding. The sign-in throttle's window (``signin_window_s``)
is bounded both ways: a short one would hardly slow a guesser.

With SSO (``SsoSettings``: one of the policy's identity providers, the
console's client id there and its secret, read from $TOOLREG_CONSOLE_SSO_
CLIENT_SECRET or a file, never an argument) approvers may also sign in
through the provider (``sso.py``); the provider must be one the policy
trusts and the resource asked for one of its audiences.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

from registry_server.console.forwarded import (
    FORWARDED_HEADERS,
    X_FORWARDED_FOR,
    Network,
    parse_trusted_proxies,
)
from registry_server.console.throttle import DEFAULT_WINDOW_S, MAX_WINDOW_S, MIN_WINDOW_S
from registry_server.domain.errors import ConfigError
from registry_server.policy.clients import Client, Role
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError
from registry_server.policy.webhooks import is_loopback
from registry_server.web.listener import (
    check_listener,
    parse_endpoint,
    read_client_secret,
)

DEFAULT_ENDPOINT = "127.0.0.1:8780"  # where `toolreg console` listens without --http
DEFAULT_MAX_SESSIONS = 32  # signed-in sessions at once; the next sign-in gets 503
DEFAULT_SESSION_IDLE_S = 900.0  # seconds without a request before a session ends
# bytes of one request body: an approval token (~1 KiB) or a rejection reason
# (at most 1,000 characters, up to 4 bytes each) in a small JSON object
DEFAULT_MAX_BODY_BYTES = 64 * 1024
# The sign-in throttle's window in seconds, when the caller gives none (throttle.py)
SIGNIN_WINDOW_ENV = "TOOLREG_CONSOLE_SIGNIN_WINDOW_S"
SSO_SECRET_ENV = "TOOLREG_CONSOLE_SSO_CLIENT_SECRET"  # the console's client secret at the IdP
DEFAULT_SSO_SCOPES = ("groups",)  # asked beside openid: the scope that brings the groups claim
CALLBACK_PATH = "/auth/callback"


@dataclass(frozen=True)
class SsoSettings:
    provider: IdentityProvider
    client_id: str
    client_secret: str = field(repr=False)
    scopes: tuple[str, ...] = DEFAULT_SSO_SCOPES  # beside openid
    resource: str = ""  # the registry's audience at the provider (RFC 8707)
    redirect_uri: str | None = None  # None: this listener's URL + /auth/callback

    @classmethod
    def from_options(
        cls,
        policy: Policy,
        *,
        provider_id: str | None,
        client_id: str | None,
        secret_file: Path | None = None,
        scopes: str | None = None,
        resource: str | None = None,
        redirect_uri: str | None = None,
    ) -> SsoSettings | None:
        """None without --sso-provider; ConfigError names the first problem."""
        if provider_id is None:
            if client_id is not None or secret_file is not None:
                raise ConfigError(
                    "--sso-client-id and --sso-client-secret-file need --sso-provider"
                )
            return None
        provider = policy.identity_provider(provider_id)
        if provider is None:
            known = ", ".join(p.id for p in policy.identity_providers) or "none"
            raise ConfigError(f"--sso-provider {provider_id}: {policy.source} names no such"
                              f" identity provider (identity_providers: {known})")  # fmt: skip
        if not client_id:
            raise ConfigError("--sso-provider needs --sso-client-id: the console's client id"
                              " at the provider")  # fmt: skip
        if resource is None:
            if len(provider.audiences) != 1:
                raise ConfigError(f"--sso-resource: provider {provider.id} accepts several"
                                  " audiences; name the registry's")  # fmt: skip
            resource = provider.audiences[0]
        return cls(
            provider=provider,
            client_id=client_id,
            client_secret=_client_secret(secret_file),
            scopes=DEFAULT_SSO_SCOPES if scopes is None else tuple(scopes.split()),
            resource=resource,
            redirect_uri=redirect_uri,
        )

    def check(self) -> None:
        if self.resource not in self.provider.audiences:
            raise ConfigError(f"--sso-resource {self.resource}: not an audience the policy"
                              f" accepts from provider {self.provider.id}")  # fmt: skip
        if self.redirect_uri is not None:
            parts = urlsplit(self.redirect_uri)
            if parts.path != CALLBACK_PATH or parts.query or parts.fragment or not parts.hostname:
                raise ConfigError(f"--sso-redirect-uri: must be the console's URL with the path"
                                  f" {CALLBACK_PATH}")  # fmt: skip
            if not (parts.scheme == "https" or (parts.scheme == "http"
                                                and is_loopback(parts.hostname))):  # fmt: skip
                raise ConfigError("--sso-redirect-uri: must be https (http only on loopback)")


@dataclass(frozen=True)
class ConsoleSettings:
    host: str
    port: int
    policy: Policy
    allowed_hosts: tuple[str, ...] = ()  # Host header values beyond this listener's own
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    signin_window_s: float = DEFAULT_WINDOW_S  # seconds a sign-in throttle window lasts
    sso: SsoSettings | None = None  # sign-in through the organization's IdP, when set
    # Reverse proxies whose forwarded header names the client (forwarded.py); none by default
    trusted_proxies: tuple[Network, ...] = ()
    forwarded_header: str = X_FORWARDED_FOR  # the one header those proxies set

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @classmethod
    def from_options(
        cls,
        endpoint: str,
        *,
        policy_file: Path | None,
        allowed_hosts: tuple[str, ...] = (),
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        max_sessions: int | None = None,
        session_idle_s: float | None = None,
        max_body_bytes: int | None = None,
        signin_window_s: float | None = None,
        sso_provider: str | None = None,
        sso_client_id: str | None = None,
        sso_client_secret_file: Path | None = None,
        sso_scopes: str | None = None,
        sso_resource: str | None = None,
        sso_redirect_uri: str | None = None,
        trusted_proxies: tuple[str, ...] = (),
        forwarded_header: str | None = None,
    ) -> Self:
        """The CLI's options as checked settings (None = the default, or for
        ``signin_window_s`` $TOOLREG_CONSOLE_SIGNIN_WINDOW_S if set);
        ConfigError names the first problem in one line."""
        host, port = parse_endpoint(endpoint)
        try:
            proxies = parse_trusted_proxies(trusted_proxies)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if forwarded_header is not None and not proxies:
            raise ConfigError(
                "--forwarded-header: only with --trusted-proxy (without trusted proxies no"
                " forwarded header is read)"
            )
        if signin_window_s is None:
            signin_window_s = _seconds_from_env(SIGNIN_WINDOW_ENV, DEFAULT_WINDOW_S)
        if policy_file is None:
            raise ConfigError(
                "toolreg console needs --policy FILE: the policy whose approvers may sign in"
                " (the file `toolreg serve` reads)"
            )
        try:
            policy = load_policy(policy_file)
        except PolicyError as exc:
            raise ConfigError(str(exc).replace("\n", "; ")) from None
        settings = cls(
            host=host,
            port=port,
            policy=policy,
            allowed_hosts=allowed_hosts,
            tls_cert=tls_cert,
            tls_key=tls_key,
            max_sessions=DEFAULT_MAX_SESSIONS if max_sessions is None else max_sessions,
            session_idle_s=DEFAULT_SESSION_IDLE_S if session_idle_s is None else session_idle_s,
            max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
            signin_window_s=signin_window_s,
            trusted_proxies=proxies,
            forwarded_header=(forwarded_header or X_FORWARDED_FOR).lower(),
            sso=SsoSettings.from_options(
                policy,
                provider_id=sso_provider,
                client_id=sso_client_id,
                secret_file=sso_client_secret_file,
                scopes=sso_scopes,
                resource=sso_resource,
                redirect_uri=sso_redirect_uri,
            ),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Fail closed: refuse what would expose approvers' tokens (ConfigError)."""
        if self.sso is not None:
            self.sso.check()
        if not any(may_sign_in(self.policy, c) for c in self.policy.clients) and not (
            self.sso is not None and sso_could_sign_in(self.policy, self.sso.provider)
        ):
            raise ConfigError(
                f"{self.policy.source}: no client could sign in to the console (it needs a"
                " token_sha256, the approve role and an approver identity"
                + (
                    "; or, through SSO, the approve role from a group or a pinned subject"
                    if self.sso is not None else ""
                ) + ")"
            )  # fmt: skip
        if self.forwarded_header not in FORWARDED_HEADERS:
            raise ConfigError(
                f"--forwarded-header: one of {', '.join(FORWARDED_HEADERS)}"
                f" (the header the trusted proxies set), not {self.forwarded_header[:64]!r}"
            )
        if not MIN_WINDOW_S <= self.signin_window_s <= MAX_WINDOW_S:
            raise ConfigError(
                f"the sign-in throttle's window must be {MIN_WINDOW_S:g} to {MAX_WINDOW_S:g}"
                f" seconds, not {self.signin_window_s:g}"
            )
        check_listener(
            self.host, tls_cert=self.tls_cert, tls_key=self.tls_key,
            allowed_hosts=self.allowed_hosts, serving="the console",
            caps=(self.max_sessions, self.session_idle_s, self.max_body_bytes),
        )  # fmt: skip


def _seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text) if len(text) <= 32 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"${name}: a number of seconds, not {text[:32]!r}")
    return value


def may_sign_in(policy: Policy, client: Client) -> bool:
    """A console user is an approver: a bearer token to prove it, the approve
    role, and an approver id whose key the policy holds (the token's ``iss``)."""
    return client.token_sha256 is not None and is_approver(policy, client)


def is_approver(policy: Policy, client: Client) -> bool:
    """The approve role, and an approver id whose key the policy holds."""
    identity = policy.approver_identity(client)
    return (
        client.may(Role.APPROVE) and identity is not None and policy.approver(identity) is not None
    )


def sso_could_sign_in(policy: Policy, provider: IdentityProvider) -> bool:
    """Someone could sign in through the provider: a client pinned to one of
    its subjects is an approver, or a group mapping grants the approve role."""
    pinned = any(
        c.idp_subject is not None and c.idp_subject[0] == provider.id and is_approver(policy, c)
        for c in policy.clients
    )
    return pinned or any(Role.APPROVE in g.roles for g in provider.groups)


def _client_secret(path: Path | None) -> str:
    """From $TOOLREG_CONSOLE_SSO_CLIENT_SECRET or a file (one, not both);
    never an argument, where other users of the host would see it."""
    secret = read_client_secret(SSO_SECRET_ENV, path, "--sso-client-secret-file")
    if not secret:
        raise ConfigError(f"SSO needs the console's client secret: set ${SSO_SECRET_ENV} or"
                          " give --sso-client-secret-file FILE")  # fmt: skip
    return secret

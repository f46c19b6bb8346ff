"""What ``toolreg console`` accepts before anything listens, checked to fail
closed (docs/approvals.md, "The approval console").

The console holds approvers' sessions and passes their bearer tokens on to the
registry, so it refuses whatever would expose them: no policy (nobody to check
a token against, and no development mode: a page that signs approvals must
know who is signing), a policy in which no client could sign in, plain HTTP
beyond loopback, and an every-interface listener with no Host name to check
against DNS rebinding. The sign-in throttle's window (``signin_window_s``)
is bounded both ways: a short one would hardly slow a guesser.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from registry_server.client.console.throttle import DEFAULT_WINDOW_S, MAX_WINDOW_S, MIN_WINDOW_S
from registry_server.client.http_listener import check_listener, parse_endpoint
from registry_server.domain.errors import ConfigError
from registry_server.policy.clients import Client, Role
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError

DEFAULT_ENDPOINT = "127.0.0.1:8780"  # where `toolreg console` listens without --http
DEFAULT_MAX_SESSIONS = 32  # signed-in sessions at once; the next sign-in gets 503
DEFAULT_SESSION_IDLE_S = 900.0  # seconds without a request before a session ends
# bytes of one request body: an approval token (~1 KiB) or a rejection reason
# (at most 1,000 characters, up to 4 bytes each) in a small JSON object
DEFAULT_MAX_BODY_BYTES = 64 * 1024
# The sign-in throttle's window in seconds, when the caller gives none (throttle.py)
SIGNIN_WINDOW_ENV = "TOOLREG_CONSOLE_SIGNIN_WINDOW_S"


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
    ) -> Self:
        """The CLI's options as checked settings (None = the default, or for
        ``signin_window_s`` $TOOLREG_CONSOLE_SIGNIN_WINDOW_S if set);
        ConfigError names the first problem in one line."""
        host, port = parse_endpoint(endpoint)
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
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Fail closed: refuse what would expose approvers' tokens (ConfigError)."""
        if not any(may_sign_in(self.policy, c) for c in self.policy.clients):
            raise ConfigError(
                f"{self.policy.source}: no client could sign in to the console (it needs a"
                " token_sha256, the approve role and an approver identity)"
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
    identity = policy.approver_identity(client)
    return (
        client.token_sha256 is not None
        and client.may(Role.APPROVE)
        and identity is not None
        and policy.approver(identity) is not None
    )

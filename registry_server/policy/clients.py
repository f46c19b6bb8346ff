"""Who a client of the policy is and what it may do: its roles, the most
dangerous level it may execute, what it may register, and its share of each
server. A client comes from the policy file (a token, a certificate subject, a
pinned identity provider subject) or from an identity provider's groups
(policy/identity.py); either way it is this same kind of object, and every
rule applies to it alike."""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from dataclasses import dataclass, field

from registry_server.domain.models import SafetyLevel
from sandbox_runner.egress import rules

ID_PATTERN = r"^[a-z0-9][a-z0-9_.@-]{0,63}$"  # approver and client ids
# What a client may register when the policy does not say: the images this
# project builds, at the safe level (a higher level is granted, never assumed).
DEFAULT_REGISTER_IMAGES = ("toolreg/base", "toolreg/base:*", "toolreg/python", "toolreg/python:*")
DEFAULT_REGISTER_LEVEL = "safe"


class Role(enum.StrEnum):
    REGISTER = "register"
    EXECUTE = "execute"
    APPROVE = "approve"
    ADMIN = "admin"  # an operator: may replace any tool, and register without the limits


@dataclass(frozen=True)
class RegisterGrant:
    """What a client may register: tools up to ``max_level``, from images
    matching one of ``images`` (shell-style globs on the image reference)."""

    max_level: SafetyLevel = SafetyLevel.SAFE  # DEFAULT_REGISTER_LEVEL
    images: tuple[str, ...] = DEFAULT_REGISTER_IMAGES
    # "host:port" patterns its tools may reach (policy/egress.py); none by default
    egress: tuple[str, ...] = ()
    secrets: frozenset[str] = frozenset()  # secret names its tools may use
    any_egress: bool = False  # operators and admins: every host, every secret

    def allows_image(self, image: str) -> bool:
        return any(fnmatch.fnmatchcase(image, pattern) for pattern in self.images)

    def allows_egress(self, wanted: rules.Entry) -> bool:
        return self.any_egress or any(
            rules.parse_entry(granted).covers(wanted) for granted in self.egress
        )

    def allows_secret(self, name: str) -> bool:
        return self.any_egress or name in self.secrets


# operators and admins
UNRESTRICTED = RegisterGrant(SafetyLevel.DANGEROUS, ("*",), any_egress=True)


MAX_QUOTA_COUNT = 4_096  # sandboxes, queued calls or pending requests one quota may allow
MAX_QUOTA_RATE = 10_000.0  # calls per second
MAX_QUOTA_BURST = 100_000  # calls
MAX_QUOTA_SERVERS = 1_024  # servers a rate may be split across


@dataclass(frozen=True)
class Quota:
    """A client's share of each server (docs/how-to/deploying.md, "Sharing a
    server"); None: not set here (the default, then the built-in share)."""

    max_concurrent: int | None = None  # sandboxes running its calls at once
    max_queued: int | None = None  # its calls waiting for a slot
    rate_per_s: float | None = None  # calls per second, as a token bucket...
    burst: int | None = None  # ...holding this many
    max_pending_approvals: int | None = None  # its approval requests waiting for approvers

    def over(self, base: Quota) -> Quota:
        """These settings, with ``base``'s where these say nothing."""
        mine = dataclasses.asdict(self)
        return dataclasses.replace(
            base, **{name: value for name, value in mine.items() if value is not None}
        )


@dataclass(frozen=True)
class Client:
    id: str
    roles: frozenset[Role]
    max_safety_level: SafetyLevel = SafetyLevel.SAFE  # the most dangerous level it may execute
    token_sha256: str | None = field(default=None, repr=False)  # lowercase hex
    mtls_subject: str | None = None
    register: RegisterGrant = field(default_factory=RegisterGrant)
    # The approver this client is (the same person): never approves its calls.
    approver: str | None = None
    quota: Quota = Quota()
    # (provider id, subject): an IdP's token for this subject is this client
    idp_subject: tuple[str, str] | None = None

    def may(self, role: Role, level: SafetyLevel | None = None) -> bool:
        """Whether this client holds ``role``; for EXECUTE, also at ``level``."""
        if role not in self.roles:
            return False
        if role is Role.EXECUTE and level is not None:
            return level.at_most(self.max_safety_level)
        return True

"""The policy's webhook endpoints, ready to send to: each with its signing
secret read and checked, and the TLS context its receiver is verified with.

Read once, at start, before the server opens anything: a server told to
notify approvers that cannot sign (a missing, unreadable, world-readable or
malformed secret, a missing CA file) refuses to start, naming the policy
file and line, rather than send unsigned messages or none at all. The secret
never leaves this module except inside the signer; errors name where it
lives, never what it is.
"""

from __future__ import annotations

import base64
import binascii
import os
import ssl
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from standardwebhooks.webhooks import Webhook

from registry_server.policy.model import PolicyError
from registry_server.policy.webhooks import WebhookSpec

SECRET_PREFIX = "whsec_"  # Standard Webhooks: whsec_ + base64 of the key
MIN_SECRET_BYTES = 24  # bytes of key: the Standard Webhooks range
MAX_SECRET_BYTES = 64
MAX_SECRET_FILE_BYTES = 4_096  # bytes read from a secret file (a secret is ~90)


@dataclass(frozen=True)
class Endpoint:
    spec: WebhookSpec
    signer: Webhook = field(repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False)  # None: the system's CAs

    @property
    def id(self) -> str:
        return self.spec.id


def load_endpoints(
    specs: Sequence[WebhookSpec], environ: Mapping[str, str] | None = None
) -> dict[str, Endpoint]:
    """Every endpoint by id; PolicyError lists every one that cannot be used."""
    environ = os.environ if environ is None else environ
    endpoints: dict[str, Endpoint] = {}
    problems: list[str] = []
    for spec in specs:
        try:
            endpoints[spec.id] = Endpoint(spec, _signer(spec, environ), _tls(spec))
        except ValueError as exc:
            problems.append(f"{spec.where}: {exc}")
    if problems:
        raise PolicyError(problems)
    return endpoints


def _signer(spec: WebhookSpec, environ: Mapping[str, str]) -> Webhook:
    if spec.secret_env is not None:
        text = environ.get(spec.secret_env)
        where = f"secret_env: ${spec.secret_env}"
        if text is None:
            raise ValueError(f"{where} is not set in the server's environment")
    else:
        assert spec.secret_file is not None  # the policy schema asks for one of the two
        where = f"secret_file: {spec.secret_file}"
        text = _read_private(spec.secret_file, where)
    return Webhook(_checked_secret(text.strip(), where))


def _read_private(path: str, where: str) -> str:
    """The file's text, when only the server's user may read it: a signing
    secret others can read lets them forge our messages."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(f"{where}: group or others may read it (mode"
                             f" {stat.S_IMODE(info.st_mode):o}); chmod 600 it")  # fmt: skip
        data = f.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{where}: larger than {MAX_SECRET_FILE_BYTES} bytes; not a secret")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not ASCII; expected whsec_ and base64") from None


def _checked_secret(text: str, where: str) -> str:
    """``whsec_`` + strict base64 of 24-64 bytes. The library would skip
    stray characters and accept a short key; we refuse both."""
    if not text.startswith(SECRET_PREFIX):
        raise ValueError(f"{where}: must start with {SECRET_PREFIX!r} (a Standard Webhooks secret)")
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: what follows {SECRET_PREFIX!r} is not base64") from None
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(f"{where}: the key is {len(key)} bytes; use {MIN_SECRET_BYTES}"
                         f" to {MAX_SECRET_BYTES} random bytes")  # fmt: skip
    return text


def _tls(spec: WebhookSpec) -> ssl.SSLContext | None:
    if spec.ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=spec.ca_file)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(
            f"ca_file: {spec.ca_file}: cannot load CA certificates ({reason})"
        ) from None


def new_secret() -> str:
    """A fresh secret in the form the policy wants (for operators and tests)."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()

"""Where `toolreg login` keeps a person's sign-in between commands: one file
per registry address in the user's config directory
(``$XDG_CONFIG_HOME/toolreg/logins/``, else ``~/.config/toolreg/logins/``).

The directory is 0700 and each file 0600, written whole to a temporary file
and renamed over the old one, so a reader never sees half a file. A refresh
holds ``<file>.lock`` (flock), so two commands refreshing at once do not both
spend one rotating refresh token. Nothing here prints or logs a token.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote

CONFIG_DIR_ENV = "XDG_CONFIG_HOME"
MAX_FILE_BYTES = 256 * 1024  # bytes of one stored sign-in


class StoreError(Exception):
    """A stored sign-in that cannot be read or written (no token in the message)."""


@dataclass(frozen=True)
class StoredLogin:
    """A person's sign-in for one registry: the identity provider's tokens and
    what a refresh needs (the token endpoint, the client, the resource)."""

    address: str  # the registry, as the CLI's --address names it
    issuer: str
    client_id: str
    resource: str  # the registry's audience (RFC 8707)
    token_endpoint: str
    access_token: str = field(repr=False)
    expires_at: float  # the access token's expiry, seconds since the epoch
    refresh_token: str | None = field(default=None, repr=False)
    revocation_endpoint: str | None = None
    ca_file: str | None = None  # the CA that signed the provider's TLS certificate
    scope: str | None = None  # the scope asked for at sign-in
    subject: str | None = None  # who signed in (shown only)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StoredLogin:
        try:
            data = json.loads(text)
        except ValueError:
            raise StoreError("not JSON") from None
        if not isinstance(data, dict):
            raise StoreError("not a JSON object")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, spec in known.items():
            value = data.get(name)
            optional = spec.default is None
            if value is None and optional:
                values[name] = None
            elif name == "expires_at":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise StoreError("expires_at is not a number")
                values[name] = float(value)
            elif isinstance(value, str) and value:
                values[name] = value
            else:
                raise StoreError(f"{name} is missing or not a string")
        return cls(**values)


def config_dir() -> Path:
    """toolreg's directory in the user's configuration (XDG base directories)."""
    base = os.environ.get(CONFIG_DIR_ENV, "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    return root / "toolreg"


class TokenStore:
    """The stored sign-ins, one file per registry address."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else config_dir() / "logins"

    def path_for(self, address: str) -> Path:
        return self.directory / f"{quote(address, safe='')}.json"

    def load(self, address: str) -> StoredLogin | None:
        """The sign-in stored for ``address``; None when there is none."""
        path = self.path_for(address)
        try:
            with path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        if len(data) > MAX_FILE_BYTES:
            raise StoreError(f"{path} is too large")
        try:
            login = StoredLogin.from_json(data.decode("utf-8"))
        except (StoreError, UnicodeDecodeError) as exc:
            raise StoreError(f"{path} is not a stored sign-in ({exc})") from None
        if login.address != address:
            raise StoreError(f"{path} is the sign-in of another address")
        return login

    def save(self, login: StoredLogin) -> Path:
        """Writes the sign-in (0600, atomically) and returns its file."""
        self._make_directory()
        path = self.path_for(login.address)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=self.directory)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(login.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    def delete(self, address: str) -> bool:
        """Removes the sign-in of ``address``; whether there was one."""
        try:
            self.path_for(address).unlink()
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def locked(self, address: str) -> Iterator[None]:
        """Holds the address's lock file (one refresh at a time, across processes)."""
        self._make_directory()
        lock = self.path_for(address).with_suffix(".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _make_directory(self) -> None:
        """The directory (and toolreg's, when it makes that too), 0700."""
        self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.mkdir(mode=0o700, exist_ok=True)
        if self.directory.stat().st_mode & 0o077:
            os.chmod(self.directory, 0o700)

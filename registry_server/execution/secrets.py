"""Secret values, held by the server only: one file per secret in the
secrets directory (<data-dir>/secrets/NAME, mode 0600 or stricter), or the
server's environment (TOOLREG_SECRET_NAME). Read at every call, so a
rotated file takes effect on the next call without a restart.

A value never leaves this module except into a SandboxSpec: never into a
definition, a listing, an approval request, a log line, an audit record, a
metric or an error (errors name the secret, not its value).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from registry_server.domain.egress import SECRET_NAME_PATTERN

MAX_SECRET_BYTES = 65_536  # bytes of one secret value
ENV_PREFIX = "TOOLREG_SECRET_"


class SecretUnavailable(Exception):
    """A secret a tool needs is missing or unusable (the message names it)."""


class SecretStore:
    def __init__(self, directory: Path, environ: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self._environ = os.environ if environ is None else environ

    def value(self, name: str) -> bytes:
        """The secret's bytes (one trailing newline dropped: files end in one)."""
        if not re.match(SECRET_NAME_PATTERN, name):
            raise SecretUnavailable(f"secret name {name[:64]!r} is not valid")
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            from_env = self._environ.get(ENV_PREFIX + name)
            if from_env is None:
                raise SecretUnavailable(
                    f"secret {name} is not configured on this server"
                    f" (no file {path}, no ${ENV_PREFIX}{name})"
                ) from None
            return self._checked(name, from_env.encode())
        except OSError as exc:
            raise SecretUnavailable(f"secret {name}: cannot open {path}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise SecretUnavailable(f"secret {name}: {path} is not a regular file")
            if info.st_mode & 0o077:
                raise SecretUnavailable(
                    f"secret {name}: {path} is readable by others (mode"
                    f" {stat.S_IMODE(info.st_mode):o}); chmod 600 it"
                )
            data = f.read(MAX_SECRET_BYTES + 2)
        return self._checked(name, data)

    @staticmethod
    def _checked(name: str, data: bytes) -> bytes:
        if data.endswith(b"\n"):
            data = data[:-1]
        if not data:
            raise SecretUnavailable(f"secret {name} is empty")
        if len(data) > MAX_SECRET_BYTES:
            raise SecretUnavailable(f"secret {name} is longer than {MAX_SECRET_BYTES} bytes")
        return data

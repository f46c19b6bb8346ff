"""Reading the small files an operator or a client names (TLS keys and
certificates): one reader, one error naming the file and why."""

from __future__ import annotations

from pathlib import Path

from registry_server.domain.errors import ConfigError


def read_credential(path: Path, what: str) -> bytes:
    """The file's bytes; ConfigError "cannot read the <what> <path>: <why>"."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None

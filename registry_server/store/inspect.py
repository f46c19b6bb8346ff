"""Which store a URL names, and reading its state without opening it for work
(`toolreg doctor`; the server's composition root opens the same URLs)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from registry_server.store.release import StoreState, StoreUnreachable

__all__ = ["StoreState", "StoreUnreachable", "inspect_store", "sqlite_path"]

SQLITE_URL_PREFIX: Final = "sqlite:///"  # sqlite:///relative/path, sqlite:////absolute/path
POSTGRES_URL_PREFIXES: Final = ("postgresql://", "postgres://")


def sqlite_path(url: str) -> Path | None:
    """The file a sqlite:/// URL names; None for any other URL."""
    if url.startswith(SQLITE_URL_PREFIX) and len(url) > len(SQLITE_URL_PREFIX):
        return Path(url[len(SQLITE_URL_PREFIX) :])
    return None


def inspect_store(url: str) -> StoreState:
    """The store's schema version, this code's, and the release that last opened it.
    Read-only; StoreUnreachable (no password in it) when it cannot be read, ValueError
    for a URL that names no store kind."""
    if url.startswith(POSTGRES_URL_PREFIXES):
        # Imported here: a host with SQLite alone never loads the PostgreSQL driver.
        from registry_server.store.postgres import inspect_postgres

        return inspect_postgres(url)
    path = sqlite_path(url)
    if path is None:
        raise ValueError("store_url: unsupported store URL; use sqlite:///<path> or postgresql://")
    from registry_server.store.sqlite import inspect_sqlite

    return inspect_sqlite(path)

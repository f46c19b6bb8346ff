"""Which toolreg release a store was written by, and the one rule about it that
both stores keep (docs/how-to/deploying.md, "Upgrades"): a store whose schema is newer
than this code knows is refused before anything is written to it, with both
releases named, so a rollback never half-reads or rewrites a newer store."""

from __future__ import annotations

from dataclasses import dataclass

from registry_server.domain.errors import StoreError
from registry_server.version import version


@dataclass(frozen=True)
class StoreState:
    """What `toolreg doctor` reads of a store without changing it."""

    kind: str  # "sqlite" or "postgresql"
    location: str  # a path, or the URL without its password
    schema_version: int  # 0: no toolreg store there yet
    known_version: int  # the newest schema this code knows
    written_by: str | None  # the release that last opened it (None: before 0.2.0, or empty)

    @property
    def behind(self) -> bool:
        """Older than this release: `toolreg serve` migrates it at start."""
        return 0 < self.schema_version < self.known_version

    @property
    def ahead(self) -> bool:
        """Newer than this release: refused."""
        return self.schema_version > self.known_version


def newer_store_error(location: str, found: int, known: int, written_by: str | None) -> StoreError:
    by = f"toolreg {written_by}" if written_by else "a newer toolreg"
    return StoreError(
        f"{location} was written by {by} (store schema {found}); this is toolreg"
        f" {version()}, which knows schema {known}. Upgrade toolreg to"
        f" {written_by or 'that release'} or newer, or restore the backup taken before"
        " the upgrade (docs/how-to/deploying.md, Upgrades); the store was left unchanged"
    )


class StoreUnreachable(StoreError):
    """The store could not be opened or read (its message names no password)."""

"""What a witness remembers of each log: the latest checkpoint it cosigned
(size, root, the note itself), and the evidence of misbehaviour it was
shown (forks). Kept in one JSON file, replaced whole at each change:
written to a temporary file beside it, fsynced, renamed over it, and the
directory fsynced, so a crash leaves either the old state or the new one,
and an answer is sent only once the new one is on disk (the spec's MUST).

A witness that forgot its state would cosign a fork (it would take any
checkpoint as its first), so a state file that cannot be read stops the
witness from starting, and one process at a time holds it (an exclusive
lock on ``<state>.lock``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from registry_server.domain.errors import ConfigError

STATE_VERSION = 1
MAX_EVIDENCE = 16  # refused checkpoints kept per log as evidence (the first ones)


@dataclass(frozen=True)
class LogState:
    """The latest checkpoint of one log this witness cosigned."""

    size: int
    root: bytes
    checkpoint: str  # the signed note as submitted
    cosigned_at: int  # the cosignature's timestamp

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "root": base64.b64encode(self.root).decode(),
            "checkpoint": self.checkpoint,
            "cosigned_at": self.cosigned_at,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LogState:
        return cls(
            int(data["size"]),
            base64.b64decode(data["root"], validate=True),
            str(data["checkpoint"]),
            int(data["cosigned_at"]),
        )


class WitnessState(Protocol):
    def get(self, origin: str) -> LogState | None: ...

    def put(self, origin: str, state: LogState) -> None:
        """Durable before it returns; OSError if it cannot be."""
        ...

    def add_evidence(self, origin: str, evidence: dict[str, Any]) -> None: ...


class MemoryState:
    """For tests of the decision logic: nothing is kept across processes."""

    def __init__(self) -> None:
        self.logs: dict[str, LogState] = {}
        self.evidence: dict[str, list[dict[str, Any]]] = {}

    def get(self, origin: str) -> LogState | None:
        return self.logs.get(origin)

    def put(self, origin: str, state: LogState) -> None:
        self.logs[origin] = state

    def add_evidence(self, origin: str, evidence: dict[str, Any]) -> None:
        kept = self.evidence.setdefault(origin, [])
        if len(kept) < MAX_EVIDENCE:
            kept.append(evidence)


class FileState:
    """The state in ``path`` (a JSON file), held by this process alone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one writer of the file at a time
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = _hold(path.with_name(f"{path.name}.lock"))
        try:
            self._logs, self._evidence = _load(path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._lock_file)

    @property
    def origins(self) -> list[str]:
        return sorted(self._logs)

    def get(self, origin: str) -> LogState | None:
        with self._lock:
            return self._logs.get(origin)

    def put(self, origin: str, state: LogState) -> None:
        with self._lock:
            logs = {**self._logs, origin: state}
            self._write(logs, self._evidence)
            self._logs = logs

    def add_evidence(self, origin: str, evidence: dict[str, Any]) -> None:
        with self._lock:
            kept = self._evidence.get(origin, [])
            if len(kept) >= MAX_EVIDENCE:
                return
            merged = {**self._evidence, origin: [*kept, evidence]}
            self._write(self._logs, merged)
            self._evidence = merged

    def _write(self, logs: dict[str, LogState], evidence: dict[str, list[dict[str, Any]]]) -> None:
        data = {
            "version": STATE_VERSION,
            "logs": {origin: s.to_json() for origin, s in sorted(logs.items())},
            "evidence": evidence,
        }
        text = json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _hold(lock_path: Path) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"witness state {lock_path.with_suffix('')}: another witness process holds it"
            f" ({lock_path}); one witness per state file"
        ) from None
    return fd


def _load(path: Path) -> tuple[dict[str, LogState], dict[str, list[dict[str, Any]]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, {}  # a new witness: it has cosigned nothing yet
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"witness state {path}: {why}") from None
    try:
        data = json.loads(text)
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {STATE_VERSION}")
        logs = {str(o): LogState.from_json(s) for o, s in dict(data["logs"]).items()}
        evidence = {str(o): list(e) for o, e in dict(data.get("evidence", {})).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # Starting afresh would cosign whatever comes first, a fork included.
        raise ConfigError(
            f"witness state {path} is unreadable ({exc}); refusing to start: a witness that"
            " forgot what it cosigned would cosign a fork. Restore it from a backup"
        ) from None
    return logs, evidence

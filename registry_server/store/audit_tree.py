"""The audit log's Merkle tree and its signed checkpoints (docs/how-to/audit.md).

The hash chain (audit_chain.py) shows an edit in the middle of the log, but
not records cut off its end, nor a chain recomputed from an edit onwards by
whoever holds the database. So the log is also an RFC 9162 Merkle tree
(domain/merkle.py) whose leaves are the entries' canonical bytes
(``audit_chain.canonical``: seq, at, kind, record, prev_hash), leaf i being
seq i+1; and a log key the operator keeps outside the database signs
checkpoints of it (c2sp.org/tlog-checkpoint: origin, size, root). Anyone
holding an old checkpoint and the log's public key can then check that the
log of today extends it (a consistency proof), and that a record is in it
(an inclusion proof): an edit, a rewritten chain or a cut end all change the
tree, and the key is not in the database to sign the changed one.

One tree per store: every server on one PostgreSQL database appends to one
chain in one seq order (appends take one lock and commit in seq order, so a
reader always sees a prefix of the log), so they all build the same tree,
and two servers signing the same size sign the same note (Ed25519 is
deterministic); the store keeps one per (origin, size).

Checkpoints are signed off the call path: a ``Checkpointer`` thread reads the
committed log as it grows and keeps only the tree's right edge in memory (a
compact range, O(log n)); calls never wait for it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from registry_server.domain import merkle
from registry_server.domain.errors import StoreError
from registry_server.signing.notes import (
    Checkpoint,
    NoteError,
    Signer,
    Verifier,
    open_checkpoint,
    parse_checkpoint,
    parse_note,
)
from registry_server.store import audit_chain
from registry_server.store.audit_chain import GENESIS_HASH, Verdict
from registry_server.store.base import AuditEntry, CheckpointRecord, Store

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_EVERY = 1_000  # records: a checkpoint once this many are not yet in one
# seconds: at most this long between a record and the checkpoint that covers it
DEFAULT_CHECKPOINT_INTERVAL_S = 60.0
POLL_S = 1.0  # seconds between the checkpointer's looks at the log
READ_BATCH = 5_000  # entries read per query while the checkpointer catches up


@dataclass(frozen=True)
class Log:
    """The audit log as the store holds it now, with its tree's leaves."""

    entries: list[AuditEntry]
    leaves: list[bytes]  # merkle.leaf_hash of each entry's canonical bytes
    chain: Verdict

    @property
    def size(self) -> int:
        return len(self.leaves)

    def root(self, size: int | None = None) -> bytes:
        return merkle.root(self.leaves, size)

    def leaf_bytes(self, seq: int) -> bytes:
        return audit_chain.canonical(self.entries[seq - 1])

    def compact(self) -> merkle.CompactRange:
        tree = merkle.CompactRange()
        for leaf in self.leaves:
            tree.append(leaf)
        return tree


def read_log(store: Store) -> Log:
    """Every entry, its leaf, and the chain's verdict: each entry's canonical
    bytes are made once for both."""
    with store.reading() as reads:
        entries = reads.audit_entries()
    data = [audit_chain.canonical(e) for e in entries]
    leaves = [merkle.leaf_hash(d) for d in data]
    return Log(entries, leaves, audit_chain.verify_entries(entries, data))


@dataclass(frozen=True)
class Extension:
    """Whether the log's tree extends a checkpoint, and how that was shown."""

    ok: bool
    reason: str  # why not, or what was proved
    proof: tuple[bytes, ...] = ()


def extends(log: Log, checkpoint: Checkpoint) -> Extension:
    """Check, with a consistency proof from the checkpoint's size to the log's,
    that the log's tree extends the checkpoint's."""
    old, new = checkpoint.size, log.size
    if new < old:
        return Extension(
            False,
            f"the log holds {new} records, fewer than the {old} the checkpoint signed:"
            f" records were cut off its end",
        )
    proof = merkle.consistency_proof(log.leaves, old)
    if not merkle.verify_consistency(old, new, checkpoint.root, log.root(), proof):
        return Extension(
            False,
            f"the log's first {old} records are not those the checkpoint signed (root"
            f" {log.root(old).hex()[:16]}, signed {checkpoint.root.hex()[:16]}): records were"
            f" edited, replaced or removed, or the chain rewritten",
        )
    if old == new:
        return Extension(True, f"the log is the checkpoint's tree ({new} records)")
    return Extension(
        True,
        f"consistency proof {old} -> {new} records verified ({len(proof)} hashes)",
        tuple(proof),
    )


def checkpoint_of(record: CheckpointRecord, verifier: Verifier | None) -> Checkpoint:
    """The checkpoint a stored row holds: its note opened with ``verifier``
    (only parsed when None), and the row's own size and root the note's."""
    if verifier is not None:
        checkpoint = open_checkpoint(record.note, verifier)
    else:
        checkpoint = parse_checkpoint(parse_note(record.note).text)
    if (checkpoint.origin, checkpoint.size, checkpoint.root.hex()) != (
        record.origin, record.size, record.root,
    ):  # fmt: skip
        raise NoteError("the stored row does not say what its signed note says")
    return checkpoint


@dataclass
class StartCheck:
    """What the server checks of its audit log before it serves."""

    log: Log
    problems: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_log(
    store: Store,
    *,
    origin: str | None,
    verifier: Verifier | None,
    copy_file: Path | None = None,
) -> StartCheck:
    """The chain, and the tree against the last checkpoint of log ``origin``
    (of any log when None) in the store, and against the copy of the last one
    this server made (``copy_file``, kept outside the database: rows deleted
    from the store do not hide it). With a ``verifier`` each checkpoint's
    signature is checked too."""
    check = StartCheck(read_log(store))
    (check.passed if check.log.chain.ok else check.problems).append(str(check.log.chain))
    with store.reading() as reads:
        latest = reads.latest_checkpoint(origin)
    found: list[tuple[str, Checkpoint]] = []
    if latest is not None:
        what = f"the store's last checkpoint ({latest.size} records)"
        try:
            found.append((what, checkpoint_of(latest, verifier)))
        except NoteError as exc:
            check.problems.append(f"{what}: {exc}")
    if copy_file is not None and copy_file.is_file():
        what = f"the last checkpoint this server made ({copy_file})"
        try:
            copied = _copied(copy_file.read_text(encoding="utf-8", errors="replace"), verifier)
        except (NoteError, OSError) as exc:
            check.problems.append(f"{what}: {exc}")
        else:
            # The copy of another log's checkpoint (the origin was changed) is not this log's.
            if origin is None or copied.origin == origin:
                found.append((what, copied))
    for what, checkpoint in found:
        outcome = extends(check.log, checkpoint)
        (check.passed if outcome.ok else check.problems).append(f"{what}: {outcome.reason}")
    return check


def _copied(note: str, verifier: Verifier | None) -> Checkpoint:
    checkpoint = parse_checkpoint(parse_note(note).text)
    if verifier is not None and checkpoint.origin == verifier.name:
        return open_checkpoint(note, verifier)
    return checkpoint


def sign(signer: Signer, size: int, root: bytes, now: float) -> CheckpointRecord:
    note = signer.sign(Checkpoint(signer.name, size, root).body())
    return CheckpointRecord(signer.name, size, root.hex(), note, now)


class CheckpointRefused(Exception):
    """The log is not one to sign: its chain is broken, or it does not extend
    a checkpoint already signed (a log never signs two trees that disagree)."""


def checkpoint_now(store: Store, signer: Signer, *, now: float | None = None) -> CheckpointRecord:
    """On demand (`toolreg audit checkpoint --make`): sign the whole log as the
    store holds it, once its chain and its last checkpoint check out. The one
    already stored when the log has not grown since."""
    log_now = read_log(store)
    if not log_now.chain.ok:
        raise CheckpointRefused(str(log_now.chain))
    with store.reading() as reads:
        latest = reads.latest_checkpoint(signer.name)
    if latest is not None:
        try:
            previous = checkpoint_of(latest, signer.verifier)
        except NoteError as exc:
            raise CheckpointRefused(f"the last checkpoint of {signer.name}: {exc}") from None
        outcome = extends(log_now, previous)
        if not outcome.ok:
            raise CheckpointRefused(outcome.reason)
        if previous.size == log_now.size:
            return latest
    record = sign(signer, log_now.size, log_now.root(), time.time() if now is None else now)
    with store.unit_of_work() as uow:
        uow.add_checkpoint(record)
    return record


def write_copy(path: Path, note: str) -> None:
    """Replace the copy of the last checkpoint at once (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(note, encoding="utf-8")
    os.replace(temporary, path)


class Checkpointer:
    """Signs a checkpoint when ``every`` records are not in one yet, or when
    the oldest such record is ``interval_s`` old (by the last checkpoint's
    time), and once more when closed. Reads only committed entries, on its
    own thread: calls never wait for it.

    It starts from the tree the start check built (``tree``, ending in the
    entry whose hash is ``head``) and checks that each new entry links to the
    one before: a log that stops being a chain is not signed again."""

    def __init__(
        self,
        store: Store,
        signer: Signer,
        tree: merkle.CompactRange,
        head: str,
        *,
        every: int = DEFAULT_CHECKPOINT_EVERY,
        interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
        copy_file: Path | None = None,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._signer = signer
        self._tree = tree
        self._head = head if tree.size else GENESIS_HASH
        self._every = every
        self._interval_s = interval_s
        self._copy_file = copy_file
        self._poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()  # one catch-up or signing at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.broken = ""  # why this server signs no more (the log stopped being a chain)
        self.last: CheckpointRecord | None = None  # the last one this server stored
        self._covered = -1  # the size of the latest checkpoint seen (-1: none looked for yet)

    @property
    def size(self) -> int:
        return self._tree.size

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="audit-checkpoints", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop, then sign what is committed and not yet in a checkpoint."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.tick(force=True)
        except StoreError as exc:
            log.warning("audit checkpoint at shutdown not made: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.tick()
            except StoreError as exc:  # the database is away: try again next time
                log.warning("audit checkpoints: %s", exc)
            except Exception:
                log.exception("audit checkpoints: unexpected error")

    def tick(self, *, force: bool = False) -> CheckpointRecord | None:
        """Catch up with the log; sign a checkpoint when one is due (``force``:
        whenever the tree has grown past the last one). The one stored, if any."""
        with self._lock:
            if self.broken:
                return None
            self._catch_up()
            if self.broken or self._tree.size <= self._covered:
                return None  # an idle log costs one query a poll
            with self._store.reading() as reads:
                latest = reads.latest_checkpoint(self._signer.name)
            self._covered = latest.size if latest is not None else -1
            now = self._clock()
            if not self._due(latest, now, force):
                return None
            record = sign(self._signer, self._tree.size, self._tree.root(), now)
            with self._store.unit_of_work() as uow:
                stored = uow.add_checkpoint(record)
            self._covered = record.size
            if not stored:  # another server signed this very size first
                return None
            self.last = record
            if self._copy_file is not None:
                try:
                    write_copy(self._copy_file, record.note)
                except OSError as exc:
                    log.warning("cannot keep a copy of the checkpoint in %s: %s",
                                self._copy_file, exc.strerror)  # fmt: skip
            log.info("audit checkpoint: %s, %d records, root %s", record.origin, record.size,
                     record.root[:16])  # fmt: skip
            return record

    def _due(self, latest: CheckpointRecord | None, now: float, force: bool) -> bool:
        covered = latest.size if latest is not None else 0
        waiting = self._tree.size - covered
        if waiting <= 0:
            return False
        if force or latest is None or waiting >= self._every:
            return True
        return now - latest.made_at >= self._interval_s

    def _catch_up(self) -> None:
        while True:
            with self._store.reading() as reads:
                entries = reads.audit_entries_after(self._tree.size, READ_BATCH)
            for entry in entries:
                problem = self._append(entry)
                if problem:
                    self.broken = f"record {entry.seq}: {problem}"
                    log.error("audit checkpoints stopped: the log is no longer a chain at %s;"
                              " no checkpoint will be signed", self.broken)  # fmt: skip
                    return
            if len(entries) < READ_BATCH:
                return

    def _append(self, entry: AuditEntry) -> str:
        if entry.seq != self._tree.size + 1:
            return f"expected record {self._tree.size + 1}"
        if entry.prev_hash != self._head:
            return "does not link to the record before it"
        data = audit_chain.canonical(entry)
        if hashlib.sha256(data).hexdigest() != entry.hash:
            return "content does not match its hash"
        self._tree.append(merkle.leaf_hash(data))
        self._head = entry.hash
        return ""

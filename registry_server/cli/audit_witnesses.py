"""What `toolreg audit` does with witnesses' cosignatures (docs/how-to/audit.md,
"Witnesses"): show them with a checkpoint, and count those an auditor
trusts.

``verify --checkpoint OLD --witness VKEY ... --min-witnesses K`` passes when
at least K of the given witnesses each cosigned a checkpoint of this log
that covers OLD (its size or more) and that is the log's own tree at that
size: a cosignature on OLD itself (as `audit checkpoint` prints it, with its
cosignatures), or the latest each witness made that the store holds. The
log extends OLD (the consistency proof) and is those witnesses' tree at
their sizes, so OLD lies on the history every one of them saw, and none
of them will cosign another: the holder of the log key cannot show this
auditor one log and the witnesses another.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from registry_server.signing.cosignatures import (
    CosignatureVerifier,
    check_cosignatures,
    with_signature_lines,
)
from registry_server.signing.notes import Checkpoint, NoteError
from registry_server.store.audit_tree import Log
from registry_server.store.base import CheckpointRecord, CosignatureRecord, StoreReads


def witness_verifiers(texts: Sequence[str]) -> list[CosignatureVerifier]:
    """``--witness`` values: a witness's verifier key (or a file holding one),
    optionally followed by its URL (a tlog-policy witness line's last two
    fields). NoteError naming the bad one."""
    verifiers = []
    for text in texts:
        path = Path(text)
        value = path.read_text(encoding="utf-8") if path.is_file() else text
        fields = value.split()
        if not fields:
            raise NoteError("--witness: empty")
        try:
            verifiers.append(CosignatureVerifier.from_text(fields[0]))
        except NoteError as exc:
            raise NoteError(f"--witness {fields[0][:60]!r}: {exc}") from None
    return verifiers


def cosigned_note(reads: StoreReads, record: CheckpointRecord) -> str:
    """The checkpoint's note with the cosignatures the store holds of it."""
    lines = [c.line for c in reads.cosignatures(record.origin, record.size)]
    return with_signature_lines(record.note, lines)


def _when(timestamp: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


@dataclass
class Witnessed:
    shown: list[str]  # one line per witness: what it cosigned, or why it does not count
    count: int  # distinct trusted witnesses that count


def witnessed(
    old_note: str,
    old: Checkpoint,
    log: Log,
    stored: Sequence[CosignatureRecord],
    witnesses: Sequence[CosignatureVerifier],
) -> Witnessed:
    """Which trusted witnesses cosigned this log at or beyond OLD's size."""
    best: dict[str, tuple[int, int, str]] = {}  # witness -> (size, time, where)
    shown: list[str] = []
    on_old = check_cosignatures(old_note, witnesses)
    for c in on_old.valid:
        best[f"{c.name}+{c.key_id.hex()}"] = (old.size, c.timestamp, "on the checkpoint")
    shown += [f"witness {name}: its cosignature on the checkpoint does not verify"
              for name in on_old.invalid]  # fmt: skip
    keys = {(w.name, w.id.hex()): w for w in witnesses}
    for record in stored:
        witness = keys.get((record.witness, record.key_id))
        if witness is None:
            continue
        label = f"{witness.name}+{witness.id.hex()}"
        body = Checkpoint(record.origin, record.size, bytes.fromhex(record.root)).body()
        check = check_cosignatures(f"{body}\n{record.line}\n", [witness])
        if not check.valid:
            shown.append(f"witness {label}: its stored cosignature of {record.size} records does"
                         " not verify")  # fmt: skip
            continue
        if record.size > log.size or log.root(record.size).hex() != record.root:
            shown.append(f"witness {label}: cosigned {record.size} records with root"
                         f" {record.root[:16]}, which is NOT this log's tree")  # fmt: skip
            continue
        if record.size < old.size:
            shown.append(f"witness {label}: cosigned {record.size} records, fewer than the"
                         f" checkpoint's {old.size}")  # fmt: skip
            continue
        if label not in best or best[label][0] < record.size:
            best[label] = (record.size, check.valid[0].timestamp, "in the store")
    for label, (size, at, where) in sorted(best.items()):
        shown.append(f"witness {label}: cosigned {size} records of this log at {_when(at)}"
                     f" ({where})")  # fmt: skip
    return Witnessed(shown, len(best))


def proof_witnessed(note: str, witnesses: Sequence[CosignatureVerifier]) -> Witnessed:
    """The trusted witnesses' cosignatures on a proof's checkpoint, offline."""
    check = check_cosignatures(note, witnesses)
    shown = [f"witness {c.name}+{c.key_id.hex()}: cosigned the checkpoint at {_when(c.timestamp)}"
             for c in check.valid]  # fmt: skip
    shown += [f"witness {name}: its cosignature does not verify" for name in check.invalid]
    return Witnessed(shown, check.count())

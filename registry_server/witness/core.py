"""The witness's decision on one ``add-checkpoint`` request
(c2sp.org/tlog-witness), apart from HTTP: bytes in, an answer out.

In the spec's order: a malformed request is 400; a log it does not know 404;
a checkpoint no trusted key of that log signed 403; an old size above the
checkpoint's 400; an old size other than the size it last cosigned for the
log 409, with that size as a ``text/x.tlog.size`` body; a checkpoint of the
size it last cosigned with another root 409 too, a **fork** (two trees of
one size signed by the log), said in a ``text/plain`` body and logged at
ERROR with both roots; a consistency proof that does not verify from the
checkpoint it last cosigned 422. Otherwise it records the checkpoint (on
disk, before answering) and answers 200 with its cosignature.

The check of the old size and the record of the new checkpoint are one step
per log (a lock per origin): two requests at once cannot roll a log back.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from registry_server.domain import merkle
from registry_server.signing.cosignatures import Cosigner
from registry_server.signing.notes import (
    NoteError,
    Verifier,
    open_note,
    parse_checkpoint,
    parse_note,
)
from registry_server.signing.tlog_witness import (
    SIZE_CONTENT_TYPE,
    AddCheckpoint,
    parse_add_checkpoint,
)
from registry_server.witness.state import LogState, WitnessState

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Answer:
    status: int
    body: str
    content_type: str = TEXT


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Witness:
    """Cosigns checkpoints of the logs it knows (origin -> their keys)."""

    def __init__(
        self,
        cosigner: Cosigner,
        logs: Mapping[str, Sequence[Verifier]],
        state: WitnessState,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for origin, keys in logs.items():
            if not keys or any(k.name != origin for k in keys):
                raise ValueError(f"log {origin}: its keys must be named {origin}")
        self.cosigner = cosigner
        self._logs = {origin: tuple(keys) for origin, keys in logs.items()}
        self._state = state
        self._clock = clock
        self._locks = {origin: threading.Lock() for origin in logs}

    @property
    def origins(self) -> list[str]:
        return sorted(self._logs)

    def add_checkpoint(self, body: bytes) -> Answer:
        try:
            request = parse_add_checkpoint(body)
            text = parse_note(request.checkpoint).text
            checkpoint = parse_checkpoint(text)
        except NoteError as exc:
            return Answer(400, f"malformed request: {exc}\n")
        keys = self._logs.get(checkpoint.origin)
        if keys is None:
            return Answer(404, f"unknown log {checkpoint.origin!r}\n")
        try:
            open_note(request.checkpoint, keys)
        except NoteError as exc:
            log.warning("checkpoint of %s refused: %s", checkpoint.origin, exc)
            return Answer(403, f"the checkpoint's signature does not verify: {exc}\n")
        if request.old_size > checkpoint.size:
            return Answer(
                400, f"old size {request.old_size} is above the checkpoint's {checkpoint.size}\n"
            )
        with self._locks[checkpoint.origin]:
            return self._decide(request, text, checkpoint.origin, checkpoint.size, checkpoint.root)

    def _decide(
        self, request: AddCheckpoint, text: str, origin: str, size: int, root: bytes
    ) -> Answer:
        last = self._state.get(origin)
        have = last.size if last is not None else 0
        if request.old_size != have:
            return Answer(409, f"{have}\n", SIZE_CONTENT_TYPE)
        if last is not None and size == last.size and root != last.root:
            return self._fork(origin, last, request, root)
        old_root = last.root if last is not None else merkle.EMPTY_ROOT
        if not merkle.verify_consistency(have, size, old_root, root, request.proof):
            return self._inconsistent(origin, last, request, size, root)
        timestamp = int(self._clock())
        cosignature = self.cosigner.cosign(text, timestamp)
        try:
            self._state.put(origin, LogState(size, root, request.checkpoint, timestamp))
        except OSError as exc:
            log.error("cannot record the checkpoint of %s (%d): %s; not cosigned", origin,
                      size, exc.strerror or exc)  # fmt: skip
            return Answer(500, "the witness cannot record its state; not cosigned\n")
        log.info("cosigned %s at size %d (root %s), after size %d", origin, size,
                 _b64(root), have)  # fmt: skip
        return Answer(200, cosignature)

    def _fork(self, origin: str, last: LogState, request: AddCheckpoint, root: bytes) -> Answer:
        log.error(
            "FORK DETECTED: log %s signed two checkpoints of size %d with different roots:"
            " cosigned %s, now offered %s; refusing. Both signed notes are kept as evidence",
            origin, last.size, _b64(last.root), _b64(root),
        )  # fmt: skip
        self._evidence(origin, "fork", last, request)
        return Answer(
            409,
            f"fork detected: log {origin} has two checkpoints of size {last.size} with"
            f" different roots (cosigned {_b64(last.root)}, offered {_b64(root)}); refusing\n",
        )

    def _inconsistent(
        self, origin: str, last: LogState | None, request: AddCheckpoint, size: int, root: bytes
    ) -> Answer:
        have = last.size if last is not None else 0
        old_root = _b64(last.root) if last is not None else "(none)"
        log.error(
            "log %s: the consistency proof from the cosigned checkpoint (size %d, root %s) to"
            " the offered one (size %d, root %s) does not verify; refusing (a fork of the log,"
            " or a wrong proof)", origin, have, old_root, size, _b64(root),
        )  # fmt: skip
        if last is not None:
            self._evidence(origin, "inconsistent", last, request)
        return Answer(
            422,
            f"the consistency proof from size {have} (the last checkpoint of {origin} this"
            f" witness cosigned) to size {size} does not verify: not an extension of the log it"
            " cosigned\n",
        )

    def _evidence(self, origin: str, kind: str, last: LogState, request: AddCheckpoint) -> None:
        evidence = {
            "kind": kind,
            "seen_at": int(self._clock()),
            "cosigned": last.checkpoint,
            "offered": request.checkpoint,
            "proof": [_b64(h) for h in request.proof],
        }
        try:
            self._state.add_evidence(origin, evidence)
        except OSError as exc:
            log.error("cannot keep the evidence of %s: %s", origin, exc.strerror or exc)

"""The wire format of the witness protocol (c2sp.org/tlog-witness): the body
of ``POST <prefix>/add-checkpoint`` and of its 409 answer. Both sides use it:
the witness (witness/) and the server that submits its checkpoints
(notify/witnesses.py).

A request body is ``old <size>\\n``, then the consistency proof from that
size to the checkpoint's, one base64 hash a line (at most 63, none when the
old size is 0), then an empty line, then the signed checkpoint note.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from registry_server.domain.merkle import HASH_BYTES
from registry_server.signing.notes import MAX_NOTE_BYTES, NoteError

ADD_CHECKPOINT = "/add-checkpoint"  # the path after the submission prefix
SIZE_CONTENT_TYPE = "text/x.tlog.size"  # a 409's body: the witness's size for that log
MAX_PROOF_LINES = 63  # the spec's bound: a proof of a tree of up to 2^63 leaves
# bytes of a request: the old size, 63 hashes and a checkpoint with its signatures
MAX_REQUEST_BYTES = 64 * 1024
_DECIMAL = re.compile(r"^(0|[1-9][0-9]{0,19})$")


@dataclass(frozen=True)
class AddCheckpoint:
    old_size: int
    proof: tuple[bytes, ...]
    checkpoint: str  # the signed note, verbatim

    def body(self) -> bytes:
        lines = [f"old {self.old_size}", *(base64.b64encode(h).decode() for h in self.proof)]
        return ("".join(f"{line}\n" for line in lines) + "\n" + self.checkpoint).encode()


def parse_add_checkpoint(data: bytes) -> AddCheckpoint:
    """The request, checked for form only (the checkpoint's signature and the
    proof are the witness's to check). NoteError saying what is malformed."""
    if len(data) > MAX_REQUEST_BYTES:
        raise NoteError(f"request larger than {MAX_REQUEST_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise NoteError("the request is not UTF-8 text") from None
    head, blank, checkpoint = text.partition("\n\n")
    if not blank:
        raise NoteError("no empty line between the old size and proof, and the checkpoint")
    first, *proof_lines = head.split("\n")
    if not first.startswith("old ") or not _DECIMAL.match(first[len("old ") :]):
        raise NoteError("the first line must be 'old <size>' (a decimal without leading zeros)")
    if len(proof_lines) > MAX_PROOF_LINES:
        raise NoteError(f"more than {MAX_PROOF_LINES} consistency proof lines")
    proof = []
    for line in proof_lines:
        try:
            node = base64.b64decode(line, validate=True)
        except (binascii.Error, ValueError):
            raise NoteError("a consistency proof line is not base64") from None
        if len(node) != HASH_BYTES:
            raise NoteError(f"a consistency proof hash of {len(node)} bytes, not {HASH_BYTES}")
        proof.append(node)
    if not checkpoint or len(checkpoint.encode()) > MAX_NOTE_BYTES:
        raise NoteError("no checkpoint after the empty line")
    return AddCheckpoint(int(first[len("old ") :]), tuple(proof), checkpoint)


def parse_size(body: bytes) -> int:
    """A 409 answer's body: the size of the witness's latest cosigned
    checkpoint of the log, in decimal, then a newline."""
    text = body.decode("ascii", errors="replace")
    if not text.endswith("\n") or not _DECIMAL.match(text[:-1]):
        raise NoteError("a tlog size answer must be a decimal and a newline")
    return int(text[:-1])

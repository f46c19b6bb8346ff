"""Each new checkpoint of the audit log, submitted to the witnesses the
configuration names (docs/how-to/audit.md, "Witnesses"; c2sp.org/tlog-witness),
and their cosignatures kept in the store (``audit_cosignatures``).

A thread of its own does it, off the call path: it looks once a second for
a checkpoint newer than the last it submitted (the ones this server signs,
and at start the store's latest), and asks every witness that has not
cosigned it, at once, each on a thread of the round's pool. For each
witness it sends the consistency proof from the size that witness last
cosigned (known from the store's cosignatures, else 0: the witness answers
409 with its size, and the proof from that size is sent next, as the spec
suggests). Each request has a timeout; an unreachable witness or a 5xx is
tried ``attempts`` times with a doubling wait, then left until the next
checkpoint (a later one carries a proof from wherever the witness stopped).

A witness that refuses says why: a 409 that is not a size is the witness
saying the log **forked** (it cosigned another tree of that size), a 422 a
proof it could not verify; both are logged at ERROR, with the witness's
words (escaped, cut short). 403/404/400 are a configuration problem (the
witness does not know this log or its key). Logs name a witness by its key
name, never by its URL (which may hold credentials).

The proofs come from a SubtreeCache (domain/merkle_cache.py) that follows
the log as the checkpoints do, about 0.25 bytes a record: a proof reads at
most one chunk of 256 records again. Before a checkpoint is submitted the
cache's root at its size must be the checkpoint's: a log that no longer
matches what it signed is never submitted again by this server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from registry_server.domain import merkle
from registry_server.domain.errors import StoreError
from registry_server.domain.merkle_cache import SubtreeCache
from registry_server.domain.text import escape
from registry_server.signing.cosignatures import (
    CosignatureVerifier,
    check_cosignatures,
    parse_signature_lines,
    with_signature_lines,
)
from registry_server.signing.notes import NoteError
from registry_server.signing.tlog_witness import (
    ADD_CHECKPOINT,
    SIZE_CONTENT_TYPE,
    AddCheckpoint,
    parse_size,
)
from registry_server.store import audit_chain
from registry_server.store.base import CheckpointRecord, CosignatureRecord, Store

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # seconds for one request to a witness (connect, send, answer)
DEFAULT_ATTEMPTS = 3  # tries of one checkpoint at an unreachable or failing witness
RETRY_BASE_S = 1.0  # seconds before the 2nd try; each later wait doubles
POLL_S = 1.0  # seconds between looks for a new checkpoint
MAX_SIZE_ANSWERS = 2  # 409 size answers followed in a row before giving up on a checkpoint
MAX_ANSWER_BYTES = 64 * 1024  # bytes of a witness's answer read
SHOWN_CHARS = 300  # characters of a witness's refusal in the log
READ_BATCH = 5_000  # records read per query while the tree catches up


@dataclass(frozen=True)
class WitnessEndpoint:
    """A witness: its verifier key (its name and cosigning key), and its
    submission prefix (``<prefix>/add-checkpoint`` is posted to)."""

    verifier: CosignatureVerifier
    url: str

    @property
    def name(self) -> str:
        return self.verifier.name

    @property
    def key(self) -> tuple[str, str]:
        return self.verifier.name, self.verifier.id.hex()


def parse_witness(text: str) -> WitnessEndpoint:
    """``<verifier key> <URL>``, as a tlog-policy ``witness`` line gives them
    (without its local name). NoteError naming what is wrong (never the URL,
    which may hold a credential)."""
    parts = text.split()
    if len(parts) != 2:
        raise NoteError("a witness is '<its verifier key> <its submission URL>'")
    verifier = CosignatureVerifier.from_text(parts[0])
    try:
        url = httpx.URL(parts[1])
    except (httpx.InvalidURL, ValueError):
        raise NoteError(f"witness {verifier.name}: not a URL") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise NoteError(f"witness {verifier.name}: the URL must be http(s)://host[:port][/prefix]")
    return WitnessEndpoint(verifier, parts[1].rstrip("/"))


@dataclass(frozen=True)
class Outcome:
    """What one witness did with one checkpoint (for the log and the tests)."""

    witness: str
    result: str  # cosigned, ahead, refused, fork, failed
    detail: str = ""


class WitnessSubmitter:
    """Submits checkpoints of log ``origin`` to ``witnesses``. ``latest``
    gives the newest checkpoint to submit (the checkpointer's last); ``leaves``
    seeds the tree (the start check's), else it is read from the store."""

    def __init__(
        self,
        store: Store,
        origin: str,
        witnesses: Sequence[WitnessEndpoint],
        latest: Callable[[], CheckpointRecord | None],
        *,
        leaves: Sequence[bytes] = (),
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        retry_base_s: float = RETRY_BASE_S,
        poll_s: float = POLL_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._store = store
        self._origin = origin
        self._witnesses = tuple(witnesses)
        self._latest = latest
        self._attempts = attempts
        self._retry_base_s = retry_base_s
        self._poll_s = poll_s
        self._client = httpx.Client(
            timeout=timeout_s, transport=transport, follow_redirects=False,
            headers={"user-agent": "toolreg-log", "content-type": "text/plain; charset=utf-8"},
        )  # fmt: skip
        self._tree = SubtreeCache(self._read_leaves)
        self._seed = leaves  # appended on the submitter's own thread, not the caller's
        self._tree_lock = threading.Lock()
        self._sizes: dict[tuple[str, str], int] = {}  # what each witness cosigned last
        self._asked: dict[tuple[str, str], int] = {}  # the largest size each was asked about
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.broken = ""  # why this server submits no more

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="audit-witnesses", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._client.close()

    def _run(self) -> None:
        try:
            with self._store.reading() as reads:
                first = reads.latest_checkpoint(self._origin)
            self.load_sizes()
        except StoreError as exc:
            log.warning("audit witnesses: %s", exc)
            first = None
        if first is not None:
            self._guarded(first)
        while not self._stop.wait(self._poll_s):
            latest = self._latest()
            if latest is not None:
                self._guarded(latest)

    def _guarded(self, checkpoint: CheckpointRecord) -> None:
        try:
            self.submit(checkpoint)
        except StoreError as exc:  # the database is away: the next checkpoint tries again
            log.warning("audit witnesses: %s", exc)
        except Exception:
            log.exception("audit witnesses: unexpected error")

    def load_sizes(self) -> None:
        """What each witness cosigned last, as the store holds it."""
        with self._store.reading() as reads:
            latest = reads.latest_cosignatures(self._origin)
        for c in latest:
            key = (c.witness, c.key_id)
            self._sizes[key] = max(self._sizes.get(key, 0), c.size)

    def submit(self, checkpoint: CheckpointRecord) -> list[Outcome]:
        """Ask every witness that was not asked about this checkpoint (or a
        later one) yet; their outcomes."""
        if self.broken or checkpoint.origin != self._origin:
            return []
        pending = [w for w in self._witnesses if self._asked.get(w.key, -1) < checkpoint.size]
        if not pending:
            return []
        with self._tree_lock:
            problem = self._follow(checkpoint)
        if problem:
            self.broken = problem
            log.error("audit witnesses stopped: %s; no checkpoint will be submitted", problem)
            return []
        for w in pending:
            self._asked[w.key] = checkpoint.size
        with ThreadPoolExecutor(len(pending), thread_name_prefix="audit-witness") as pool:
            outcomes = list(pool.map(lambda w: self._submit_to(w, checkpoint), pending))
        return outcomes

    def _follow(self, checkpoint: CheckpointRecord) -> str:
        """Grow the tree to the checkpoint's size; what is wrong if the log
        lacks records it covers, or the tree's root there is not its root."""
        if self._seed:
            for leaf in self._seed:
                self._tree.append(leaf)
            self._seed = ()
        while self._tree.size < checkpoint.size:
            start = self._tree.size
            with self._store.reading() as reads:
                entries = reads.audit_entries_after(start, min(READ_BATCH, checkpoint.size - start))
            if not entries or [e.seq for e in entries] != list(
                range(start + 1, start + 1 + len(entries))
            ):
                return (f"the log lacks record {start + 1}, which the checkpoint of"
                        f" {checkpoint.size} records covers")  # fmt: skip
            for entry in entries:
                self._tree.append(merkle.leaf_hash(audit_chain.canonical(entry)))
        if self._tree.root(checkpoint.size).hex() != checkpoint.root:
            return (f"the log's first {checkpoint.size} records are not those of the checkpoint"
                    f" this server submits (root {checkpoint.root[:16]})")  # fmt: skip
        return ""

    def _read_leaves(self, start: int, count: int) -> list[bytes]:
        """Leaves ``start``..``start + count - 1`` again (a chunk a proof cuts through)."""
        with self._store.reading() as reads:
            entries = reads.audit_entries_after(start, count)
        if [e.seq for e in entries] != list(range(start + 1, start + 1 + count)):
            raise StoreError(f"audit records {start + 1}..{start + count} could not be read")
        return [merkle.leaf_hash(audit_chain.canonical(e)) for e in entries]

    def _submit_to(self, witness: WitnessEndpoint, checkpoint: CheckpointRecord) -> Outcome:
        size_answers = 0
        attempt = 0
        while attempt < self._attempts and not self._stop.is_set():
            old = self._sizes.get(witness.key, 0)
            if old > checkpoint.size:
                return Outcome(witness.name, "ahead", f"it cosigned {old} records")
            with self._tree_lock:
                proof = self._tree.consistency_proof(old, checkpoint.size)
            body = AddCheckpoint(old, tuple(proof), checkpoint.note).body()
            try:
                status, kind, text = self._post(witness.url + ADD_CHECKPOINT, body)
            except httpx.HTTPError as exc:
                attempt += 1
                self._retry(witness, checkpoint, attempt, type(exc).__name__)
                continue
            if status == 200:
                return self._cosigned(witness, checkpoint, text)
            if status == 409 and kind == SIZE_CONTENT_TYPE:
                try:
                    self._sizes[witness.key] = parse_size(text.encode())
                except NoteError as exc:
                    return self._refused(witness, checkpoint, status, str(exc))
                size_answers += 1
                if size_answers > MAX_SIZE_ANSWERS:
                    return self._refused(witness, checkpoint, status, "its size keeps changing")
                continue
            if status in (400, 403, 404, 409, 422):
                return self._refused(witness, checkpoint, status, text)
            attempt += 1
            self._retry(witness, checkpoint, attempt, f"HTTP {status}")
        return Outcome(witness.name, "failed", f"{attempt} attempt(s)")

    def _post(self, url: str, body: bytes) -> tuple[int, str, str]:
        with self._client.stream("POST", url, content=body) as response:
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    break
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            return (
                response.status_code,
                kind,
                bytes(data[:MAX_ANSWER_BYTES]).decode("utf-8", errors="replace"),
            )

    def _retry(
        self, witness: WitnessEndpoint, checkpoint: CheckpointRecord, attempt: int, why: str
    ) -> None:
        if attempt >= self._attempts:
            log.warning("audit checkpoint %d of %s not cosigned by witness %s: %s, %d attempts;"
                        " the next checkpoint tries again", checkpoint.size, self._origin,
                        witness.name, why, attempt)  # fmt: skip
            return
        delay = self._retry_base_s * 2 ** (attempt - 1)
        log.warning("witness %s: %s; trying again in %g s (attempt %d of %d)", witness.name,
                    why, delay, attempt + 1, self._attempts)  # fmt: skip
        self._stop.wait(delay)

    def _cosigned(
        self, witness: WitnessEndpoint, checkpoint: CheckpointRecord, text: str
    ) -> Outcome:
        try:
            lines = parse_signature_lines(text)
            check = check_cosignatures(
                with_signature_lines(checkpoint.note, lines), [witness.verifier]
            )
        except NoteError as exc:
            check = None
            why = str(exc)
        else:
            why = "no cosignature by its key verifies"
        if check is None or not check.valid:
            log.error("witness %s answered checkpoint %d of %s without a valid cosignature: %s",
                      witness.name, checkpoint.size, self._origin, why)  # fmt: skip
            return Outcome(witness.name, "refused", why)
        self._sizes[witness.key] = checkpoint.size
        with self._store.unit_of_work() as uow:
            for c in check.valid:
                uow.add_cosignature(CosignatureRecord(
                    self._origin, checkpoint.size, checkpoint.root, c.name, c.key_id.hex(),
                    c.line, c.timestamp,
                ))  # fmt: skip
        log.info("audit checkpoint %d of %s cosigned by witness %s", checkpoint.size,
                 self._origin, witness.name)  # fmt: skip
        return Outcome(witness.name, "cosigned")

    def _refused(
        self, witness: WitnessEndpoint, checkpoint: CheckpointRecord, status: int, text: str
    ) -> Outcome:
        said = escape(text.strip()[:SHOWN_CHARS])
        if status == 409:
            log.error("witness %s REFUSES checkpoint %d of %s as a FORK of the log it cosigned:"
                      " %s", witness.name, checkpoint.size, self._origin, said)  # fmt: skip
            return Outcome(witness.name, "fork", said)
        if status == 422:
            log.error("witness %s refuses checkpoint %d of %s: the consistency proof from what it"
                      " cosigned does not verify: %s", witness.name, checkpoint.size,
                      self._origin, said)  # fmt: skip
        else:
            log.error("witness %s refuses checkpoint %d of %s (HTTP %d; does it know this log"
                      " and its key?): %s", witness.name, checkpoint.size, self._origin, status,
                      said)  # fmt: skip
        return Outcome(witness.name, "refused", f"HTTP {status}: {said}")

"""The server's side of witnessing, in memory: the subtree cache's proofs
are merkle.py's (domain/merkle_cache.py), and the submitter
(notify/witnesses.py) gets a growing log's checkpoints cosigned by a real
witness decision (witness/core.py) behind an in-process transport:
from size 0, from a size the witness reports (409), through failures and
retries, and it reports a fork and a wrong key without storing anything."""

from __future__ import annotations

import functools
import hashlib
import logging

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.domain import merkle
from registry_server.domain.merkle_cache import SubtreeCache
from registry_server.notify.witnesses import WitnessEndpoint, WitnessSubmitter, parse_witness
from registry_server.signing.cosignatures import Cosigner
from registry_server.signing.notes import NoteError, Signer
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import CheckpointRecord
from registry_server.store.memory import MemoryStore
from registry_server.witness.core import Witness
from registry_server.witness.state import LogState, MemoryState

ORIGIN = "toolreg/unit"
URL = "http://witness.test/w"


LEAVES_70 = [merkle.leaf_hash(hashlib.sha256(bytes([i, 7])).digest()) for i in range(70)]


@functools.cache
def _merkle_py(m: int, n: int) -> tuple[bytes, tuple[bytes, ...]]:
    """merkle.py's root of the first m leaves and proof from m to n, made once
    for every chunk size below (they are most of this test's time)."""
    return merkle.root(LEAVES_70, m), tuple(merkle.consistency_proof(LEAVES_70, m, n))


@pytest.mark.parametrize("chunk_bits", [0, 1, 2, 3, 4])
def test_the_subtree_cache_makes_merkle_py_proofs_and_roots(chunk_bits: int) -> None:
    leaves = LEAVES_70
    reads: list[int] = []

    def read(start: int, count: int) -> list[bytes]:
        reads.append(start)
        return leaves[start : start + count]

    cache = SubtreeCache(read, chunk_bits=chunk_bits)
    for n, leaf in enumerate(leaves, start=1):
        cache.append(leaf)
        assert cache.root() == _merkle_py(n, n)[0]
        for m in range(n + 1):
            root, proof = _merkle_py(m, n)
            assert cache.consistency_proof(m, n) == list(proof)
            assert cache.root(m) == root
    with pytest.raises(ValueError):
        cache.consistency_proof(5, 71)


def test_a_proof_reads_at_most_the_chunks_it_cuts() -> None:
    leaves = [merkle.leaf_hash(bytes([i % 256, i // 256])) for i in range(5000)]
    reads: list[int] = []

    def read(start: int, count: int) -> list[bytes]:
        reads.append(start)
        return leaves[start : start + count]

    cache = SubtreeCache(read)  # 256-leaf chunks
    for leaf in leaves:
        cache.append(leaf)
    assert cache.consistency_proof(4097, 5000) == merkle.consistency_proof(leaves, 4097, 5000)
    assert reads == [4096]  # the chunk holding leaf 4097; 5000's is the tail in memory
    reads.clear()
    assert cache.consistency_proof(4096, 4999) == merkle.consistency_proof(leaves, 4096, 4999)
    assert reads == []  # 4096 is a chunk boundary; 4999's chunk is the tail


class Deployment:
    """A log in a memory store, its key, and a witness behind a transport."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.signer = Signer(ORIGIN, Ed25519PrivateKey.generate())
        self.state = MemoryState()
        self.witness = Witness(
            Cosigner("witness.test/w1", Ed25519PrivateKey.generate()),
            {ORIGIN: [self.signer.verifier]}, self.state,
        )  # fmt: skip
        self.failures: list[Exception | int] = []  # what the next requests meet first
        self.requests: list[bytes] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert str(request.url) == URL + "/add-checkpoint"
        self.requests.append(request.content)
        if self.failures:
            failure = self.failures.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return httpx.Response(failure, text="busy\n")
        answer = self.witness.add_checkpoint(request.content)
        return httpx.Response(
            answer.status, content=answer.body, headers={"content-type": answer.content_type}
        )

    def grow(self, count: int) -> CheckpointRecord:
        for i in range(count):
            with self.store.unit_of_work() as uow:
                audit_chain.append(uow, "execution", {"n": i})
        return audit_tree.checkpoint_now(self.store, self.signer)

    def submitter(self, latest: CheckpointRecord | None = None, **kw: object) -> WitnessSubmitter:
        endpoint = WitnessEndpoint(self.witness.cosigner.verifier, URL)
        return WitnessSubmitter(
            self.store, ORIGIN, [endpoint], lambda: latest,
            transport=httpx.MockTransport(self.handle), retry_base_s=0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    def cosigned_sizes(self) -> list[int]:
        with self.store.reading() as reads:
            return [c.size for c in reads.latest_cosignatures(ORIGIN)]


def test_a_growing_log_is_cosigned_checkpoint_after_checkpoint() -> None:
    d = Deployment()
    submitter = d.submitter()
    for count, expected_old in ((5, 0), (7, 5), (300, 12), (1, 312)):
        checkpoint = d.grow(count)
        [outcome] = submitter.submit(checkpoint)
        assert outcome.result == "cosigned", outcome
        assert d.requests[-1].startswith(f"old {expected_old}\n".encode())
        assert d.cosigned_sizes() == [checkpoint.size]
        with d.store.reading() as reads:
            [stored] = reads.cosignatures(ORIGIN, checkpoint.size)
        assert stored.root == checkpoint.root and stored.witness == "witness.test/w1"
    assert len(d.requests) == 4  # each one right the first time
    assert submitter.submit(checkpoint) == []  # asked already


def test_the_size_a_witness_reports_is_where_the_proof_starts() -> None:
    d = Deployment()
    first = d.grow(10)
    assert d.submitter().submit(first)[0].result == "cosigned"
    d.store._data.cosignatures.clear()  # the store forgot; the witness did not
    second = d.grow(10)
    fresh = d.submitter()
    fresh.load_sizes()
    assert fresh.submit(second)[0].result == "cosigned"
    assert [r.split(b"\n")[0] for r in d.requests[-2:]] == [b"old 0", b"old 10"]


def test_a_fork_the_witness_saw_is_reported_and_nothing_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Deployment()
    checkpoint = d.grow(8)
    d.state.put(ORIGIN, LogState(8, b"\x01" * 32, "another tree", 1))  # it cosigned another 8
    with caplog.at_level(logging.ERROR, logger="registry_server"):
        [outcome] = d.submitter().submit(
            CheckpointRecord(ORIGIN, 8, checkpoint.root, checkpoint.note, 0)
        )
    assert outcome.result == "fork" and "fork detected" in outcome.detail
    assert "REFUSES checkpoint 8 of toolreg/unit as a FORK" in caplog.text
    assert d.cosigned_sizes() == []


def test_unreachable_or_failing_witnesses_are_tried_a_few_times() -> None:
    d = Deployment()
    checkpoint = d.grow(3)
    d.failures = [httpx.ConnectError("refused"), 503]
    assert d.submitter().submit(checkpoint)[0].result == "cosigned"  # the third try
    assert len(d.requests) == 3
    d.failures = [503, 503, 503, 503]
    later = d.grow(1)
    [outcome] = d.submitter().submit(later)
    assert outcome.result == "failed" and len(d.requests) == 6
    assert d.cosigned_sizes() == [3]
    # The next checkpoint carries the proof from wherever the witness stopped.
    d.failures = []
    assert d.submitter().submit(d.grow(1))[0].result == "cosigned"


def test_a_cosignature_by_another_key_is_not_kept() -> None:
    d = Deployment()
    checkpoint = d.grow(4)
    impostor = Cosigner("witness.test/w1", Ed25519PrivateKey.generate())
    endpoint = WitnessEndpoint(impostor.verifier, URL)  # the server expects this key
    submitter = WitnessSubmitter(d.store, ORIGIN, [endpoint], lambda: None,
                                 transport=httpx.MockTransport(d.handle))  # fmt: skip
    [outcome] = submitter.submit(checkpoint)
    assert outcome.result == "refused" and "verifies" in outcome.detail
    assert d.cosigned_sizes() == []


def test_a_log_that_no_longer_matches_its_checkpoint_is_not_submitted() -> None:
    d = Deployment()
    checkpoint = d.grow(5)
    d.store._data.audit = d.store._data.audit[:3]  # cut under the server
    submitter = d.submitter()
    assert submitter.submit(checkpoint) == []
    assert "lacks record 4" in submitter.broken and d.requests == []


def test_witness_settings_are_a_verifier_key_and_a_url() -> None:
    vkey = str(Cosigner("witness.test/w1", Ed25519PrivateKey.generate()).verifier)
    endpoint = parse_witness(f"  {vkey}   https://w.example/prefix/ ")
    assert endpoint.url == "https://w.example/prefix" and endpoint.name == "witness.test/w1"
    for bad in (vkey, f"{vkey} ftp://w.example", f"{vkey} https://a https://b", "x https://a"):
        with pytest.raises(NoteError):
            parse_witness(bad)

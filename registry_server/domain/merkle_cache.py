"""Roots and consistency proofs of a growing RFC 9162 tree without its leaves
in memory: what the server needs to prove each new checkpoint to witnesses
(notify/witnesses.py) from whatever size each of them last cosigned.

The tree is kept as the roots of its complete, aligned subtrees of at least
``chunk`` leaves (one 32-byte hash per ``chunk`` leaves per level: about
0.25 bytes a leaf with 256-leaf chunks), plus the leaves of the last,
incomplete chunk. A tree hash over a range is then those subtree roots
combined as the RFC splits the range; only a range that cuts through a
chunk needs that chunk's leaves, which are read again (``read_leaves``):
a consistency proof from size m to n reads at most the chunk holding the
m-th leaf. Everything else is merkle.py's definitions: the proofs are the
same hashes its ``consistency_proof`` makes (the unit tests compare them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from registry_server.domain import merkle
from registry_server.domain.merkle import HASH_BYTES

DEFAULT_CHUNK_BITS = 8  # chunks of 256 leaves


def _split(n: int) -> int:
    """k: the largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


class SubtreeCache:
    """``read_leaves(start, count)``: the leaf hashes of leaves ``start`` to
    ``start + count - 1`` (zero-based), for chunks no longer in memory."""

    def __init__(
        self,
        read_leaves: Callable[[int, int], Sequence[bytes]],
        *,
        chunk_bits: int = DEFAULT_CHUNK_BITS,
    ) -> None:
        self._read = read_leaves
        self._bits = chunk_bits
        self._chunk = 1 << chunk_bits
        # level j: roots of the complete aligned subtrees of chunk * 2^j leaves
        self._levels: list[bytearray] = []
        self._tail: list[bytes] = []  # leaves of the incomplete last chunk
        self._size = 0
        # Chunks read again, the last two: a proof cuts through at most two (at m and n).
        self._read_chunks: dict[int, list[bytes]] = {}

    @property
    def size(self) -> int:
        return self._size

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash."""
        self._tail.append(leaf)
        self._size += 1
        if len(self._tail) < self._chunk:
            return
        node, self._tail = merkle.root(self._tail), []
        j = 0
        while True:
            if j == len(self._levels):
                self._levels.append(bytearray())
            level = self._levels[j]
            level += node
            if (len(level) // HASH_BYTES) % 2:
                return
            node = merkle.node_hash(bytes(level[-2 * HASH_BYTES : -HASH_BYTES]),
                                    bytes(level[-HASH_BYTES:]))  # fmt: skip
            j += 1

    def root(self, size: int | None = None) -> bytes:
        """The tree hash of the first ``size`` leaves (all of them by default)."""
        n = self._size if size is None else size
        self._check(0, n)
        return self._mth(0, n)

    def consistency_proof(self, old_size: int, size: int | None = None) -> list[bytes]:
        """PROOF(old_size, D[size]) of RFC 9162 2.1.4.1, as merkle.consistency_proof."""
        n = self._size if size is None else size
        self._check(old_size, n)
        if old_size in (0, n):
            return []
        return self._subproof(old_size, 0, n, True)

    def _check(self, old_size: int, size: int) -> None:
        if not 0 <= old_size <= size <= self._size:
            raise ValueError(f"sizes {old_size}..{size} out of range (0..{self._size})")

    def _subproof(self, m: int, lo: int, hi: int, whole: bool) -> list[bytes]:
        n = hi - lo
        if m == n:
            return [] if whole else [self._mth(lo, hi)]
        k = _split(n)
        if m <= k:
            return [*self._subproof(m, lo, lo + k, whole), self._mth(lo + k, hi)]
        return [*self._subproof(m - k, lo + k, hi, False), self._mth(lo, lo + k)]

    def _mth(self, lo: int, hi: int) -> bytes:
        n = hi - lo
        if n <= 0:
            return merkle.EMPTY_ROOT
        if n >= self._chunk and n & (n - 1) == 0 and lo % n == 0:  # complete, aligned: held
            height = n.bit_length() - 1
            level = self._levels[height - self._bits]
            at = (lo >> height) * HASH_BYTES
            return bytes(level[at : at + HASH_BYTES])
        if lo >> self._bits == (hi - 1) >> self._bits:  # within one chunk
            return merkle.root(self._leaves(lo, hi))
        k = _split(n)
        return merkle.node_hash(self._mth(lo, lo + k), self._mth(lo + k, hi))

    def _leaves(self, lo: int, hi: int) -> list[bytes]:
        start = lo - lo % self._chunk
        if start == self._size - len(self._tail):
            return self._tail[lo - start : hi - start]
        chunk = self._read_chunks.get(start)
        if chunk is None:
            chunk = list(self._read(start, self._chunk))
            if len(chunk) != self._chunk or any(len(h) != HASH_BYTES for h in chunk):
                raise ValueError(f"leaves {start}..{start + self._chunk - 1} could not be read")
            if len(self._read_chunks) >= 2:
                del self._read_chunks[next(iter(self._read_chunks))]
            self._read_chunks[start] = chunk
        return chunk[lo - start : hi - start]

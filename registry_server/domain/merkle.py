"""The Merkle tree of RFC 9162 (Certificate Transparency 2.0; the same tree as
RFC 6962): tree hashes, inclusion and consistency proofs, and their
verification. Pure functions over leaf hashes; the audit log's tree
(store/audit_tree.py, docs/how-to/audit.md) is built with them.

Hashing is domain-separated as the RFC says: a leaf is SHA-256(0x00 || data),
an interior node SHA-256(0x01 || left || right), so no leaf can pass for a
node. A tree of n > 1 leaves splits at k, the largest power of two below n.

Every function here takes the leaf *hashes* (``leaf_hash`` of each entry) and,
where it matters, a ``size``: the tree of the first ``size`` of them, so a
proof against an older checkpoint needs no copy of the list.

The verification functions are the algorithms of RFC 9162 section 2.1.3.2
(inclusion) and 2.1.4.2 (consistency), step by step; the proof builders are
the PATH and PROOF/SUBPROOF definitions of sections 2.1.3.1 and 2.1.4.1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_BYTES = 32  # SHA-256
EMPTY_ROOT = hashlib.sha256(b"").digest()  # MTH({}): the root of the empty tree


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """k: the largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def _mth(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    """MTH(D[lo:hi]). Built level by level, an odd node out moving up as it is:
    the same tree as the RFC's split at the largest power of two (the left
    subtree is always complete), without a call per node."""
    if hi <= lo:
        return EMPTY_ROOT
    level = list(leaves[lo:hi])
    while len(level) > 1:
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def _size(leaves: Sequence[bytes], size: int | None) -> int:
    n = len(leaves) if size is None else size
    if not 0 <= n <= len(leaves):
        raise ValueError(f"tree size {n} out of range (0..{len(leaves)})")
    return n


def root(leaves: Sequence[bytes], size: int | None = None) -> bytes:
    """The tree hash of the first ``size`` leaves (all of them by default)."""
    return _mth(leaves, 0, _size(leaves, size))


def inclusion_proof(leaves: Sequence[bytes], index: int, size: int | None = None) -> list[bytes]:
    """PATH(index, D[size]): the audit path of leaf ``index`` (zero-based) in the
    tree of the first ``size`` leaves, from the leaf's sibling up to the root's
    child."""
    n = _size(leaves, size)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} is not in a tree of {n} leaves")
    path: list[bytes] = []
    lo, hi = 0, n
    while hi - lo > 1:  # walk down from the root; the path is collected top first
        k = _split(hi - lo)
        if index < lo + k:
            path.append(_mth(leaves, lo + k, hi))
            hi = lo + k
        else:
            path.append(_mth(leaves, lo, lo + k))
            lo = lo + k
    path.reverse()
    return path


def consistency_proof(
    leaves: Sequence[bytes], old_size: int, size: int | None = None
) -> list[bytes]:
    """PROOF(old_size, D[size]): the hashes that show the tree of the first
    ``old_size`` leaves is a prefix of the tree of the first ``size``. Empty
    when old_size is 0 or equals size."""
    n = _size(leaves, size)
    if not 0 <= old_size <= n:
        raise ValueError(f"no consistency proof from {old_size} to {n} leaves")
    if old_size in (0, n):
        return []
    return _subproof(leaves, old_size, 0, n, True)


def _subproof(leaves: Sequence[bytes], m: int, lo: int, hi: int, whole: bool) -> list[bytes]:
    """SUBPROOF(m, D[lo:hi], b) of RFC 9162 section 2.1.4.1."""
    n = hi - lo
    if m == n:
        return [] if whole else [_mth(leaves, lo, hi)]
    k = _split(n)
    if m <= k:
        return [*_subproof(leaves, m, lo, lo + k, whole), _mth(leaves, lo + k, hi)]
    return [*_subproof(leaves, m - k, lo + k, hi, False), _mth(leaves, lo, lo + k)]


def _well_formed(*hashes: bytes) -> bool:
    return all(len(h) == HASH_BYTES for h in hashes)


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], root_hash: bytes
) -> bool:
    """Whether ``proof`` shows the leaf hash ``leaf`` at ``index`` in the tree
    of ``size`` leaves whose root is ``root_hash`` (RFC 9162 2.1.3.2)."""
    if not _well_formed(leaf, root_hash, *proof):
        return False
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root_hash


def verify_consistency(
    old_size: int, size: int, old_root: bytes, root_hash: bytes, proof: Sequence[bytes]
) -> bool:
    """Whether ``proof`` shows the tree of ``old_size`` leaves with root
    ``old_root`` is a prefix of the tree of ``size`` leaves with root
    ``root_hash`` (RFC 9162 2.1.4.2). Every tree extends the empty one; a tree
    extends itself only with an empty proof and the same root."""
    if not _well_formed(old_root, root_hash, *proof):
        return False
    if not 0 <= old_size <= size:
        return False
    if old_size == size:
        return not proof and old_root == root_hash
    if old_size == 0:
        return not proof
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is a node of the new tree
        path.insert(0, old_root)
    fn, sn = old_size - 1, size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == root_hash and sn == 0


class CompactRange:
    """The tree's right edge: the roots of its complete subtrees, largest first
    (at most one per bit of the size). Appending a leaf merges equal-sized
    subtrees, so the root of a growing tree costs O(log n) memory and O(1)
    hashes per leaf, amortised: what the server keeps to sign checkpoints
    without reading the log again."""

    def __init__(self) -> None:
        self._size = 0
        self._peaks: list[bytes] = []  # subtree roots, left to right

    @property
    def size(self) -> int:
        return self._size

    def append(self, leaf: bytes) -> None:
        """Add one leaf hash."""
        self._size += 1
        node = leaf
        # Each trailing 0 bit of the new size is a merge of two equal subtrees.
        merges = (self._size & -self._size).bit_length() - 1
        for _ in range(merges):
            node = node_hash(self._peaks.pop(), node)
        self._peaks.append(node)

    def root(self) -> bytes:
        if not self._peaks:
            return EMPTY_ROOT
        node = self._peaks[-1]
        for peak in reversed(self._peaks[:-1]):
            node = node_hash(peak, node)
        return node

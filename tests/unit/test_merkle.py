"""The RFC 9162 tree (domain/merkle.py): the reference vectors published with
Certificate Transparency (transparency-dev/merkle's testonly and proof
tests), and every tree of 1..64 leaves against a reference written here
straight from the RFC's recursive definitions, with every proof verified and
every one-bit change to it refused."""

from __future__ import annotations

import functools
import hashlib

import pytest

from registry_server.domain import merkle

# Leaf inputs and the roots of the trees of their first 0..8 (testonly/constants.go).
LEAVES = [bytes.fromhex(h) for h in
          ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
           "606162636465666768696a6b6c6d6e6f"]]  # fmt: skip
ROOTS = [bytes.fromhex(h) for h in [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]]  # fmt: skip
H = {  # the node hashes the reference proofs are made of, by their first hex digits
    h[:4]: bytes.fromhex(h) for h in [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
    ]
}  # fmt: skip
# (leaf index, tree size, proof) and (size1, size2, proof) from proof/verify_test.go
INCLUSION = [
    (0, 8, ["96a2", "5f08", "6b47"]),
    (5, 8, ["bc1a", "ca85", "d37e"]),
    (2, 3, ["fac5"]),
    (1, 5, ["6e34", "5f08", "bc1a"]),
]
CONSISTENCY = [
    (1, 8, ["96a2", "5f08", "6b47"]),
    (6, 8, ["0ebc", "ca85", "d37e"]),
    (2, 5, ["5f08", "bc1a"]),
    (6, 7, ["0ebc", "b086", "d37e"]),
]


def hashed(leaves: list[bytes]) -> list[bytes]:
    return [merkle.leaf_hash(leaf) for leaf in leaves]


# -- the reference: RFC 9162 section 2.1.1, 2.1.3.1 and 2.1.4.1, as written --------


def ref_mth(d: list[bytes]) -> bytes:
    return _ref_mth(tuple(d))


@functools.cache  # the same subtrees recur in every tree and proof below
def _ref_mth(d: tuple[bytes, ...]) -> bytes:
    n = len(d)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return hashlib.sha256(b"\x00" + d[0]).digest()
    k = 1
    while k * 2 < n:
        k *= 2
    return hashlib.sha256(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:])).digest()


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [ref_mth(d)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]


def flipped(proof: list[bytes], i: int) -> list[bytes]:
    changed = list(proof)
    changed[i] = bytes([changed[i][0] ^ 0x10]) + changed[i][1:]
    return changed


# -- the reference vectors ----------------------------------------------------------


def test_roots_of_the_reference_tree() -> None:
    assert ROOTS[0] == merkle.EMPTY_ROOT
    for n in range(9):
        assert merkle.root(hashed(LEAVES), n) == ROOTS[n], n


@pytest.mark.parametrize(("index", "size", "proof"), INCLUSION)
def test_reference_inclusion_proofs(index: int, size: int, proof: list[str]) -> None:
    expected = [H[p] for p in proof]
    leaves = hashed(LEAVES)
    assert merkle.inclusion_proof(leaves, index, size) == expected
    assert merkle.verify_inclusion(index, size, leaves[index], expected, ROOTS[size])
    assert not merkle.verify_inclusion(index, size, leaves[index], expected, ROOTS[size - 1])


@pytest.mark.parametrize(("old", "new", "proof"), CONSISTENCY)
def test_reference_consistency_proofs(old: int, new: int, proof: list[str]) -> None:
    expected = [H[p] for p in proof]
    assert merkle.consistency_proof(hashed(LEAVES), old, new) == expected
    assert merkle.verify_consistency(old, new, ROOTS[old], ROOTS[new], expected)
    assert not merkle.verify_consistency(old, new, ROOTS[new], ROOTS[old], expected)


def test_trivial_consistency() -> None:
    some = hashlib.sha256(b"some").digest()
    assert merkle.verify_consistency(0, 0, some, some, [])
    assert merkle.verify_consistency(0, 5, some, ROOTS[5], [])  # every tree extends the empty one
    assert merkle.verify_consistency(3, 3, ROOTS[3], ROOTS[3], [])
    assert not merkle.verify_consistency(3, 3, ROOTS[3], ROOTS[4], [])  # same size, another root
    assert not merkle.verify_consistency(3, 3, ROOTS[3], ROOTS[3], [some])  # a proof too many
    assert not merkle.verify_consistency(4, 3, ROOTS[4], ROOTS[3], [])  # a tree never shrinks
    assert not merkle.verify_consistency(2, 5, ROOTS[2], ROOTS[5], [])  # a proof is needed
    assert not merkle.verify_consistency(0, 5, some, ROOTS[5], [some])
    assert merkle.consistency_proof(hashed(LEAVES), 0) == []
    assert merkle.consistency_proof(hashed(LEAVES), 8) == []


def test_malformed_inputs_never_verify() -> None:
    leaves = hashed(LEAVES)
    proof = merkle.inclusion_proof(leaves, 5, 8)
    assert not merkle.verify_inclusion(5, 8, leaves[5], [*proof[:2], proof[2][:31]], ROOTS[8])
    assert not merkle.verify_inclusion(5, 8, leaves[5][:31], proof, ROOTS[8])
    assert not merkle.verify_inclusion(8, 8, leaves[5], proof, ROOTS[8])
    assert not merkle.verify_inclusion(-1, 8, leaves[5], proof, ROOTS[8])
    assert not merkle.verify_inclusion(0, 0, leaves[0], [], ROOTS[0])
    with pytest.raises(ValueError):
        merkle.inclusion_proof(leaves, 8, 8)
    with pytest.raises(ValueError):
        merkle.root(leaves, 9)
    with pytest.raises(ValueError):
        merkle.consistency_proof(leaves, 5, 4)


# -- every tree of 1..64 leaves -------------------------------------------------------

MAX = 64
DATA = [f"record {i}".encode() for i in range(MAX)]
HASHES = hashed(DATA)


def test_roots_match_the_rfc_definition_and_the_compact_range() -> None:
    compact = merkle.CompactRange()
    assert compact.root() == merkle.EMPTY_ROOT
    for n in range(1, MAX + 1):
        compact.append(HASHES[n - 1])
        expected = ref_mth(DATA[:n])
        assert merkle.root(HASHES, n) == expected, n
        assert compact.size == n and compact.root() == expected, n


def test_every_inclusion_proof() -> None:
    for n in range(1, MAX + 1):
        root = ref_mth(DATA[:n])
        for i in range(n):
            proof = merkle.inclusion_proof(HASHES, i, n)
            assert proof == ref_path(i, DATA[:n]), (i, n)
            assert merkle.verify_inclusion(i, n, HASHES[i], proof, root), (i, n)
            other = (i + 1) % n
            if other != i:  # another leaf, or this leaf at another index
                assert not merkle.verify_inclusion(i, n, HASHES[other], proof, root)
                assert not merkle.verify_inclusion(other, n, HASHES[i], proof, root)
            assert not merkle.verify_inclusion(i, n * 2, HASHES[i], proof, root)
            assert not merkle.verify_inclusion(i, n // 2, HASHES[i], proof, root)
            assert not merkle.verify_inclusion(i, n, HASHES[i], [*proof, root], root)
            for k in range(len(proof)):
                assert not merkle.verify_inclusion(i, n, HASHES[i], flipped(proof, k), root)
            if proof:
                assert not merkle.verify_inclusion(i, n, HASHES[i], proof[:-1], root)


def test_every_consistency_proof() -> None:
    roots = [ref_mth(DATA[:n]) for n in range(MAX + 1)]
    for n in range(1, MAX + 1):
        for m in range(1, n + 1):
            proof = merkle.consistency_proof(HASHES, m, n)
            assert proof == (ref_subproof(m, DATA[:n], True) if m < n else []), (m, n)
            assert merkle.verify_consistency(m, n, roots[m], roots[n], proof), (m, n)
            if m == n:
                continue
            assert not merkle.verify_consistency(m, n, roots[m - 1], roots[n], proof)
            assert not merkle.verify_consistency(m, n, roots[m], roots[n - 1], proof)
            assert not merkle.verify_consistency(m, n, roots[n], roots[m], proof)
            assert not merkle.verify_consistency(m, n, roots[m], roots[n], [*proof, roots[n]])
            if m > 1:
                assert not merkle.verify_consistency(m - 1, n, roots[m], roots[n], proof)
            for k in range(len(proof)):
                assert not merkle.verify_consistency(m, n, roots[m], roots[n], flipped(proof, k))


def test_an_edited_leaf_changes_every_root_from_it_on() -> None:
    edited = list(HASHES)
    edited[20] = merkle.leaf_hash(b"record 20, edited")
    for n in range(1, MAX + 1):
        assert (merkle.root(edited, n) == merkle.root(HASHES, n)) == (n <= 20), n
    # No consistency proof made from the edited tree convinces about the old root.
    proof = merkle.consistency_proof(edited, 30, MAX)
    assert not merkle.verify_consistency(
        30, MAX, merkle.root(HASHES, 30), merkle.root(edited), proof
    )

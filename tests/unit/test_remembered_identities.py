"""Group-mapped clients remembered beyond one server (policy/seen.py): when a
sighting is written, what a lookup reads, the caps, and what a remembered
client is under the policy in force. The store here is a dict (pure logic);
the real stores are tests/cluster/test_store_contract.py's, the real servers
tests/identity/test_remembered_clients.py's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from registry_server.policy.live import LivePolicy
from registry_server.policy.loader import load_policy
from registry_server.policy.seen import (
    MAX_GROUP_CHARS,
    MAX_REMEMBERED_GROUPS,
    RECHECK_S,
    REMEMBER_EVERY_S,
    SeenIdentities,
    Sighting,
)
from tests.unit.test_identity import provider_yaml, write


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class DictStore:
    """Remembered as a dict, counting reads and writes."""

    def __init__(self) -> None:
        self.rows: dict[str, Sighting] = {}
        self.saves: list[tuple[str, float]] = []
        self.loads = 0
        self.failing = False

    def load(self, client_id: str) -> Sighting | None:
        self.loads += 1
        if self.failing:
            raise OSError("store down")
        return self.rows.get(client_id)

    def save(self, client_id: str, sighting: Sighting, now: float) -> None:
        if self.failing:
            raise OSError("store down")
        self.saves.append((client_id, now))
        held = self.rows.get(client_id)
        if held is None or held.issued_at <= sighting.issued_at:
            self.rows[client_id] = sighting


def seen_with(store: DictStore, clock: Clock) -> SeenIdentities:
    seen = SeenIdentities(clock=clock)
    seen.remember_in(store)
    return seen


BOB = Sighting("corp", "bob", frozenset({"agents"}), issued_at=10.0, expires_at=10_000.0)


def test_a_mapped_client_is_written_once_per_interval_and_at_once_when_its_groups_change() -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    seen.saw("corp.bob", BOB, remember=True)
    assert [c for c, _ in store.saves] == ["corp.bob"]
    for _ in range(50):  # every call presents the token: no write per call
        clock.now += 1
        seen.saw("corp.bob", BOB, remember=True)
    assert len(store.saves) == 1
    clock.now += REMEMBER_EVERY_S
    seen.saw("corp.bob", BOB, remember=True)
    assert len(store.saves) == 2  # last_seen, once per interval
    clock.now += 1
    more = Sighting("corp", "bob", frozenset({"agents", "ops"}), issued_at=20.0)
    seen.saw("corp.bob", more, remember=True)
    assert len(store.saves) == 3 and store.rows["corp.bob"].groups == more.groups


def test_a_client_the_policy_maps_to_nothing_never_reaches_the_store() -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    seen.saw("corp.eve", Sighting("corp", "eve", frozenset({"strangers"})), remember=False)
    assert store.saves == [] and seen.get("corp.eve") is not None  # known here, as before


def test_an_unseen_client_is_read_from_the_store_and_the_answer_kept_for_a_while() -> None:
    store, clock = DictStore(), Clock()
    store.rows["corp.bob"] = BOB  # another server saw bob
    seen = seen_with(store, clock)
    assert seen.get("corp.bob") == BOB
    assert seen.get("corp.nobody") is None
    loads = store.loads
    for _ in range(20):
        seen.get("corp.bob"), seen.get("corp.nobody")
    assert store.loads == loads  # hits and misses alike are kept for RECHECK_S
    clock.now += RECHECK_S
    newer = Sighting("corp", "bob", frozenset(), issued_at=99.0)
    store.rows["corp.bob"] = newer  # the other server saw a newer token: bob left "agents"
    store.rows["corp.nobody"] = BOB
    assert seen.get("corp.bob") == newer and seen.get("corp.nobody") == BOB


def test_an_older_stored_token_never_replaces_a_newer_one_seen_here() -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    seen.saw("corp.bob", BOB, remember=True)
    store.rows["corp.bob"] = Sighting("corp", "bob", frozenset({"ops"}), issued_at=1.0)
    clock.now += RECHECK_S
    assert seen.get("corp.bob") == BOB


def test_a_forgotten_client_is_nobody_on_every_server_after_the_recheck() -> None:
    store, clock = DictStore(), Clock()
    here, there = seen_with(store, clock), seen_with(store, clock)
    here.saw("corp.bob", BOB, remember=True)
    assert there.get("corp.bob") == BOB
    del store.rows["corp.bob"]  # the operator forgets bob
    clock.now += RECHECK_S
    assert here.get("corp.bob") is None and there.get("corp.bob") is None
    # Bob's next token makes him known (and remembered) again: forgetting is not denying.
    here.saw("corp.bob", BOB, remember=True)
    assert store.rows["corp.bob"] == BOB


@pytest.mark.parametrize(
    "groups",
    [
        frozenset(f"g{i}" for i in range(MAX_REMEMBERED_GROUPS + 1)),
        frozenset({"x" * (MAX_GROUP_CHARS + 1)}),
        frozenset(f"{i:03d}" + "y" * 200 for i in range(100)),  # 20 300 characters in all
    ],
    ids=["too-many-groups", "a-group-too-long", "too-many-characters"],
)
def test_a_client_over_the_caps_is_not_stored_and_is_said_so_once_per_interval(
    groups: frozenset[str], caplog: pytest.LogCaptureFixture
) -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    with caplog.at_level(logging.WARNING, "registry_server.policy.seen"):
        for _ in range(10):
            seen.saw("corp.bob", Sighting("corp", "bob", groups, 1.0), remember=True)
            clock.now += 1
    assert store.saves == [] and store.rows == {}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "not remembered in the store" in said[0], said
    assert "bob" not in said[0]  # names the cap, not the client's groups or id
    clock.now += RECHECK_S
    assert seen.get("corp.bob") is not None  # still known here, from its verified token


def test_a_client_id_over_the_cap_is_not_stored() -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    seen.saw("c" * 65, BOB, remember=True)
    assert store.saves == []


def test_a_store_that_fails_costs_no_call_and_fails_closed_for_clients_not_seen_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, clock = DictStore(), Clock()
    seen = seen_with(store, clock)
    store.failing = True
    seen.saw("corp.bob", BOB, remember=True)  # no exception
    clock.now += RECHECK_S
    assert seen.get("corp.bob") == BOB  # what this server verified itself
    assert seen.get("corp.carol") is None  # nobody
    store.failing = False
    clock.now += 1
    seen.saw("corp.bob", BOB, remember=True)  # the next sighting writes it
    assert store.rows["corp.bob"] == BOB


def test_the_least_recently_seen_are_dropped_beyond_the_cap() -> None:
    store, clock = DictStore(), Clock()
    seen = SeenIdentities(capacity=3, clock=clock)
    seen.remember_in(store)
    for name in ("a", "b", "c", "d"):
        seen.saw(f"corp.{name}", Sighting("corp", name, frozenset({"agents"})), remember=True)
    assert len(seen) == 3
    assert seen.get("corp.a") is not None  # from the store, as any server would read it


# ------------------------------------------------- a remembered client under the policy


def test_a_remembered_client_takes_its_roles_from_the_policy_in_force(tmp_path: Path) -> None:
    """A restart: a new server (new SeenIdentities) on a store that remembers
    bob the builder. Roles come from the current mappings of the stored
    groups; a reload that unmaps his group makes him nobody, and his tools
    unserved, without a token of his."""
    store = DictStore()
    store.rows["corp.bob"] = Sighting("corp", "bob", frozenset({"builders"}), 1.0, 2.0)
    path = write(tmp_path, [provider_yaml()])
    live = LivePolicy(lambda: load_policy(path))
    live.current.seen.remember_in(store)
    bob = live.current.client("corp.bob")
    assert bob is not None and {r.value for r in bob.roles} == {"register", "execute"}
    assert live.current.grant_of("corp.bob") is not None
    unmapped = provider_yaml()
    unmapped["groups"] = [g for g in unmapped["groups"] if g["group"] != "builders"]
    write(tmp_path, [unmapped])
    live.reload()
    assert live.current.client("corp.bob") is None
    assert live.current.grant_of("corp.bob") is None
    # The IdP is trusted for who, never for what: a stored row for another
    # provider's prefix, or a subject that is not this id's, is nobody.
    store.rows["corp.mallory"] = Sighting("corp", "bob", frozenset({"ops"}), 1.0)
    assert live.current.client("corp.mallory") is None

"""The unit tests' in-memory store: a unit of work is all or nothing, though
it copies only the store's containers, not its (frozen) records."""

from __future__ import annotations

import dataclasses

import pytest

from registry_server.store.memory import MemoryStore, _Data


def test_a_draft_has_new_containers_for_every_field() -> None:
    data = _Data()
    data.tokens["r1"] = {"alice": "t"}
    draft = data.draft()
    for f in dataclasses.fields(_Data):
        assert getattr(draft, f.name) == getattr(data, f.name)
        assert getattr(draft, f.name) is not getattr(data, f.name), f.name
    assert draft.tokens["r1"] is not data.tokens["r1"]


def test_a_failed_unit_of_work_leaves_nothing_behind() -> None:
    store = MemoryStore()
    with store.unit_of_work() as uow:
        uow.put_approval_token("r1", "alice", "jti-1", "token-1", 0.0)
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        uow.put_approval_token("r1", "bob", "jti-2", "token-2", 0.0)  # nested: r1's dict
        assert uow.use_jti("jti-2", "bob", "e1", 0.0)
        raise RuntimeError("the rest of the unit failed")
    with store.unit_of_work() as uow:  # the spent jti was rolled back with the rest
        assert uow.use_jti("jti-2", "bob", "e2", 0.0)
    assert store._data.tokens == {"r1": {"alice": "token-1"}}

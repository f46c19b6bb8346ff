"""Listing answers are reused until the registry changes, never after."""

from __future__ import annotations

from registry_server.catalog.registry import Registry
from registry_server.catalog.views import MAX_CACHED_ANSWERS, RegistryViews
from registry_server.store.memory import MemoryStore
from tests.factories import tool


def test_answer_is_reused_until_a_registration() -> None:
    registry = Registry(MemoryStore())
    views = RegistryViews(registry)
    builds: list[int] = []

    def names() -> list[str]:
        builds.append(1)
        return registry.names()

    assert views.get("k", names) == [] and views.get("k", names) == []
    assert len(builds) == 1
    registry.register(tool(name="fresh"))
    assert views.get("k", names) == ["fresh"]  # stale the moment the registry changed
    assert len(builds) == 2
    registry.register(tool(name="fresh"))  # identical: no change, still cached
    assert views.get("k", names) == ["fresh"] and len(builds) == 2


def test_keys_are_separate_and_bounded() -> None:
    views = RegistryViews(Registry(MemoryStore()))
    for i in range(MAX_CACHED_ANSWERS + 5):
        assert views.get(i, lambda i=i: i) == i
    rebuilt: list[int] = []
    views.get(0, lambda: rebuilt.append(0) or 0)  # the oldest was evicted
    assert rebuilt == [0]

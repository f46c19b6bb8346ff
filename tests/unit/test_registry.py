"""Registry rules: idempotence, duplicates, replace, look-ups and filters."""

from __future__ import annotations

import threading

import pytest

from registry_server.catalog.registry import RegisterOutcome, Registry
from registry_server.domain.errors import AlreadyExists, NotFound
from registry_server.domain.models import SafetyLevel
from registry_server.store.memory import MemoryStore
from tests.factories import tool


def filled() -> Registry:
    reg = Registry(MemoryStore())
    reg.register(tool(name="read_a", safety_level="safe", categories=["files"]))
    reg.register(tool(name="calc", safety_level="safe", categories=["math"]))
    reg.register(tool(name="shell", safety_level="cautious", categories=["code", "files"]))
    reg.register(tool(name="rm_rf", safety_level="dangerous", categories=["files"]))
    return reg


def names(tools: list) -> list[str]:  # type: ignore[type-arg]
    return [t.name for t in tools]


def test_identical_registration_is_idempotent() -> None:
    reg = Registry(MemoryStore())
    assert reg.register(tool()) is RegisterOutcome.CREATED
    version = reg.version
    assert reg.register(tool()) is RegisterOutcome.UNCHANGED
    assert reg.version == version


def test_different_definition_under_same_name_fails_unless_replace() -> None:
    reg = Registry(MemoryStore())
    reg.register(tool())
    with pytest.raises(AlreadyExists, match="already exists"):
        reg.register(tool(description="changed"))
    assert reg.get("echo").description == "Returns its arguments."
    assert reg.register(tool(description="changed"), replace=True) is RegisterOutcome.REPLACED
    assert reg.get("echo").description == "changed"


def test_get_missing_is_not_found_with_the_name() -> None:
    with pytest.raises(NotFound, match="Tool 'nope' not found"):
        Registry(MemoryStore()).get("nope")


def test_empty_registry_lists_nothing() -> None:
    reg = Registry(MemoryStore())
    assert reg.list() == [] and reg.names() == []


def test_list_is_sorted_and_unfiltered_by_default() -> None:
    assert names(filled().list()) == ["calc", "read_a", "rm_rf", "shell"]
    assert filled().names() == ["calc", "read_a", "rm_rf", "shell"]


@pytest.mark.parametrize(
    ("level", "cats", "expected"),
    [
        (SafetyLevel.SAFE, [], ["calc", "read_a"]),
        (SafetyLevel.CAUTIOUS, [], ["calc", "read_a", "shell"]),
        (SafetyLevel.DANGEROUS, [], ["calc", "read_a", "rm_rf", "shell"]),
        (None, ["files"], ["read_a", "rm_rf", "shell"]),
        (None, ["math", "code"], ["calc", "shell"]),
        (SafetyLevel.CAUTIOUS, ["files"], ["read_a", "shell"]),  # both criteria: ANDed
        (SafetyLevel.SAFE, ["code"], []),
        (None, ["nothing"], []),
    ],
)
def test_filters_are_anded(level: SafetyLevel | None, cats: list[str], expected: list[str]) -> None:
    assert names(filled().list(level, cats)) == expected


def test_listing_is_a_copy() -> None:
    reg = filled()
    listing = reg.list()
    listing.clear()
    assert len(reg.list()) == 4


def test_listener_sees_old_and_new() -> None:
    reg = Registry(MemoryStore())
    seen: list[tuple[str | None, str]] = []
    reg.add_listener(
        lambda old, new: seen.append((old.description if old else None, new.description))
    )
    reg.register(tool())
    reg.register(tool())
    reg.register(tool(description="v2"), replace=True)
    assert seen == [(None, "Returns its arguments."), ("Returns its arguments.", "v2")]


def test_concurrent_registration_keeps_every_tool_once() -> None:
    reg = Registry(MemoryStore())
    errors: list[BaseException] = []
    outcomes: list[RegisterOutcome] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            for j in range(25):
                out = reg.register(tool(name=f"t{(i * 25 + j) % 100}"))
                with lock:
                    outcomes.append(out)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(reg.names()) == 100
    assert outcomes.count(RegisterOutcome.CREATED) == 100
    assert outcomes.count(RegisterOutcome.UNCHANGED) == 16 * 25 - 100

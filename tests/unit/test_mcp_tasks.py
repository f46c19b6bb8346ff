"""The bridge's task store (registry_server/mcp/tasks.py): tasks are kept per
principal and bounded (unfinished per principal, kept per principal, in
all), finished ones expire after their ttlMs, an ended task never changes,
and the wire shape uses the SEP-2663 names."""

from __future__ import annotations

from typing import Any, cast

from registry_server.client.registry_client import RegistryClient
from registry_server.mcp.tasks import MAX_TASK_ID_CHARS, Task, TaskStore

NO_CLIENT = cast(RegistryClient, None)  # the store never calls the registry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def task(n: int, principal: str = "agent", **kw: Any) -> Task:
    return Task(f"{n:032x}", principal, "slow", "{}", NO_CLIENT, **kw)


def test_tasks_are_the_principals_own() -> None:
    store = TaskStore()
    mine = task(1)
    assert store.add(mine)
    assert store.get("agent", mine.task_id) is mine
    assert store.get("rival", mine.task_id) is None
    assert store.get("agent", "f" * 32) is None
    assert store.get("agent", "x" * (MAX_TASK_ID_CHARS + 1)) is None


def test_unfinished_tasks_per_principal_are_capped() -> None:
    store = TaskStore(max_open=2, max_kept=10)
    first, second = task(1), task(2)
    assert store.add(first) and store.add(second)
    assert not store.add(task(3))  # two unfinished: the third call runs plain
    assert store.add(task(4, principal="rival"))  # another principal's own room
    store.update(first, status="completed")
    assert store.add(task(5))


def test_kept_tasks_per_principal_push_out_the_oldest_finished() -> None:
    store = TaskStore(max_open=5, max_kept=2)
    first, second = task(1), task(2)
    assert store.add(first) and store.add(second)
    assert not store.add(task(3))  # both unfinished: nothing may go
    store.update(first, status="completed")
    third = task(3)
    assert store.add(third)
    assert store.get("agent", first.task_id) is None  # the oldest finished went
    assert store.get("agent", second.task_id) is second


def test_the_bridge_wide_bound_holds() -> None:
    store = TaskStore(max_open=5, max_kept=5, max_tasks=2)
    assert store.add(task(1, principal="a")) and store.add(task(2, principal="b"))
    assert not store.add(task(3, principal="c"))
    assert len(store) == 2


def test_finished_tasks_expire_after_their_ttl_and_running_ones_never() -> None:
    clock = Clock()
    store = TaskStore(clock=clock)
    done = task(1, ttl_ms=1000, born=clock.now)
    running = task(2, ttl_ms=1000, born=clock.now)
    assert store.add(done) and store.add(running)
    store.update(done, status="completed")
    clock.now += 0.9
    assert store.get("agent", done.task_id) is done  # never before its ttlMs
    clock.now += 0.2
    assert store.get("agent", done.task_id) is None
    assert store.get("agent", running.task_id) is running


def test_an_ended_task_never_changes() -> None:
    store = TaskStore()
    cancelled = task(1)
    store.add(cancelled)
    assert store.update(cancelled, status="cancelled")
    assert not store.update(cancelled, status="completed", result={"content": []})
    assert cancelled.status == "cancelled" and cancelled.result is None


def test_the_wire_shape() -> None:
    t = task(1)
    created = t.wire(detailed=False)
    assert set(created) == {
        "taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs",
    }  # fmt: skip
    assert created["createdAt"].endswith("Z") and isinstance(created["ttlMs"], int)
    t.status, t.result = "completed", {"content": [{"type": "text", "text": "hi"}]}
    t.input_requests = {"k": {}}  # only shown while input is required
    got = t.wire(detailed=True)
    assert got["result"] == t.result and "inputRequests" not in got and "error" not in got

"""Warm pools (execution/warm_pool.py) against a fake sandbox backend
(tests/unit/fakes.py) and a real ``Admission``: filling a tracked tool's pool
within the caps, handing out a warm sandbox only for exactly the definition
and spec it was made from, never handing out a dead or too-old one, never
pooling a tool whose sandbox gets host mounts, giving room back under
pressure (oldest first), backing off when the engine cannot make more, and
``close`` leaving nothing behind, not even a sandbox made while it closed.

The pool's worker is a real thread: tests wait for it with a polling loop
(never more than a second); it works at once when notified.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from registry_server.domain.models import ToolDefinition
from registry_server.execution import warm_pool
from registry_server.execution.admission import Admission
from registry_server.execution.sandbox_plan import (
    WORKSPACE_TARGET,
    SandboxPlanner,
    SandboxPolicy,
)
from registry_server.execution.warm_pool import MAX_AGE_LIMIT_S, WarmPools, WarmSandbox
from sandbox_runner import EngineUnavailable, Mount, SandboxBackend, SandboxError, SandboxSpec
from sandbox_runner.profiles import DANGEROUS_LIMITS, SAFE_LIMITS
from tests.factories import tool as make_tool
from tests.unit.fakes import FakeBackend, FakePrepared

pytestmark = pytest.mark.unit

JOIN_S = 1.0  # seconds: the longest anything here is waited for
QUIET_S = 0.05  # seconds a test watches for something that must not happen
MEMORY_MB = SAFE_LIMITS.memory_mb  # what each warm sandbox of a safe tool reserves

ECHO = make_tool(warm_pool=2)
CALL_INPUT = b'{"message":"hi"}'


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def warm(name: str, size: int, **overrides: object) -> ToolDefinition:
    return make_tool(name=name, warm_pool=size, **overrides)


class Env:
    """A backend, an admission budget, a planner and the pools under test."""

    def __init__(
        self,
        *,
        max_running: int = 8,
        policy: SandboxPolicy | None = None,
        backend: FakeBackend | None = None,
        default_size: int = 0,
        max_total: int = warm_pool.DEFAULT_MAX_WARM,
        max_age_s: float = warm_pool.DEFAULT_MAX_AGE_S,
    ) -> None:
        self.backend = backend if backend is not None else FakeBackend()
        self.admission = Admission(max_running, max_waiting=4, memory_budget_mb=4096)
        self.planner = SandboxPlanner(self.backend, policy or SandboxPolicy())
        self.pools = WarmPools(
            self.backend,
            self.planner.warm_spec,
            self.admission,
            default_size=default_size,
            max_total=max_total,
            max_age_s=max_age_s,
        )

    def call_spec(self, tool: ToolDefinition, runtime: str = "runc") -> SandboxSpec:
        """The spec a call of ``tool`` would run with (its input set)."""
        return self.planner.spec(tool, CALL_INPUT, runtime)

    def fill(self, tool: ToolDefinition) -> list[FakePrepared]:
        """Track ``tool`` and wait until its pool is full; its sandboxes, oldest first."""
        before = {p.container_id for p in self.backend.prepared}
        self.pools.track(tool)
        wait_until(lambda: self.pools.stats().warm.get(tool.name) == tool.warm_pool, "full")
        return [p for p in self.backend.prepared if p.container_id not in before]

    def reservations(self) -> tuple[int, int, int]:
        return self.admission.reserved, self.admission.running, self.admission.memory_mb


@pytest.fixture
def make_env() -> Iterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**options: Any) -> Env:
        env = Env(**options)
        made.append(env)
        return env

    yield make
    for env in made:
        env.pools.close()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


# ---------------------------------------------------------------- filling


def test_the_fake_fits_the_backend_protocol() -> None:
    _: SandboxBackend = FakeBackend()


def test_max_age_must_be_positive_and_at_most_an_hour() -> None:
    for bad in (0.0, -1.0, MAX_AGE_LIMIT_S + 1):
        with pytest.raises(ValueError, match=r"max_age_s must be in \(0, 3600.0\] seconds"):
            WarmPools(FakeBackend(), lambda tool: None, Admission(1, 1), max_age_s=bad)


def test_tracking_a_tool_fills_its_pool(env: Env) -> None:
    tool = warm("echo", 3)
    made = env.fill(tool)
    assert len(made) == 3
    expected = dataclasses.replace(env.call_spec(tool), input=b"")
    assert [p.spec for p in made] == [expected] * 3
    assert env.backend.prepare_lifetimes == [warm_pool.DEFAULT_MAX_AGE_S] * 3
    assert all(p.execution_id.startswith("warm-") for p in made)
    assert len({p.execution_id for p in made}) == 3
    assert env.reservations() == (3, 0, 3 * MEMORY_MB)
    time.sleep(QUIET_S)
    assert len(env.backend.prepared) == 3  # full: no more
    assert env.pools.stats().warm == {"echo": 3}


def test_the_default_size_applies_to_tools_that_name_none(make_env: Callable[..., Env]) -> None:
    env = make_env(default_size=2)
    assert env.pools.size_for(warm("echo", 0)) == 2
    assert env.pools.size_for(warm("echo", 5)) == 5
    env.pools.track(warm("echo", 0))
    wait_until(lambda: env.pools.stats().warm == {"echo": 2}, "the default size is warm")


def test_a_tool_without_a_warm_pool_is_not_pooled(env: Env) -> None:
    env.pools.track(warm("echo", 0))
    time.sleep(QUIET_S)
    assert env.backend.prepared == []
    assert env.pools.stats().warm == {}
    assert env.pools.take(warm("echo", 0), env.call_spec(warm("echo", 0)), "exec-1") is None


def test_warm_sandboxes_across_tools_stay_within_max_total(
    make_env: Callable[..., Env],
) -> None:
    env = make_env(max_total=4)
    env.pools.track(warm("alpha", 3))
    env.pools.track(warm("beta", 3))
    wait_until(lambda: sum(env.pools.stats().warm.values()) == 4, "four are warm")
    time.sleep(QUIET_S)
    assert len(env.backend.prepared) == 4
    assert sorted(env.pools.stats().warm.values()) == [2, 2]  # the emptier pool goes first


def test_warm_sandboxes_stay_within_the_sandbox_budget(make_env: Callable[..., Env]) -> None:
    env = make_env(max_running=2)
    env.pools.track(warm("echo", 5))
    wait_until(lambda: env.pools.stats().warm == {"echo": 2}, "two are warm")
    time.sleep(QUIET_S)
    assert len(env.backend.prepared) == 2
    assert env.reservations() == (2, 0, 2 * MEMORY_MB)


# ---------------------------------------------------------------- taking


def test_take_hands_out_a_sandbox_made_from_the_same_tool_and_spec(env: Env) -> None:
    first, second = env.fill(ECHO)
    taken = env.pools.take(ECHO, env.call_spec(ECHO), "exec-1")
    assert isinstance(taken, WarmSandbox)
    assert taken.prepared is first  # oldest first
    assert taken.container_id == first.container_id
    stats = env.pools.stats()
    assert (stats.hits, stats.misses, stats.warm) == (1, 0, {"echo": 1})
    assert env.reservations() == (2, 0, 2 * MEMORY_MB)  # the taker holds its room
    with env.admission.claim(taken.reservation):
        assert env.reservations() == (1, 1, 2 * MEMORY_MB)
        taken.prepared.finish(CALL_INPUT)
    assert env.reservations() == (1, 0, MEMORY_MB)
    assert first.finished_input == CALL_INPUT
    assert (second.finished_input, second.discarded) == (None, False)
    env.pools.call_done()  # refills now
    wait_until(lambda: env.pools.stats().warm == {"echo": 2}, "the pool refilled")
    assert len(env.backend.prepared) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"runtime": "runsc"},
        {"limits": SAFE_LIMITS.replace(timeout_ms=1234)},
        {"env": (("EXTRA", "1"),)},
        {"mounts": (Mount("/srv", "/data"),)},
    ],
)
def test_take_returns_none_for_a_different_spec(env: Env, change: dict[str, object]) -> None:
    env.fill(ECHO)
    other = dataclasses.replace(env.call_spec(ECHO), **change)  # type: ignore[arg-type]
    assert env.pools.take(ECHO, other, "exec-1") is None
    stats = env.pools.stats()
    assert (stats.hits, stats.misses, stats.warm) == (0, 1, {"echo": 2})
    assert env.backend.discarded_ids == []


def test_take_returns_none_for_a_replaced_definition(env: Env) -> None:
    old = env.fill(ECHO)
    replaced = make_tool(warm_pool=2, description="Returns its arguments, newer.")
    assert replaced.digest != ECHO.digest
    assert env.call_spec(replaced) == env.call_spec(ECHO)  # only the digest tells them apart
    assert env.pools.take(replaced, env.call_spec(replaced), "exec-1") is None
    assert env.pools.stats().misses == 1
    assert env.pools.take(warm("other", 2), env.call_spec(ECHO), "exec-1") is None  # not tracked
    assert env.pools.stats().misses == 1

    new = env.fill(replaced)  # tracking the new definition drops the old sandboxes
    assert all(p.discarded for p in old)
    assert env.reservations() == (2, 0, 2 * MEMORY_MB)
    taken = env.pools.take(replaced, env.call_spec(replaced), "exec-1")
    assert taken is not None and taken.prepared is new[0]
    assert env.pools.take(ECHO, env.call_spec(ECHO), "exec-1") is None  # the old one never again
    env.admission.release(taken.reservation)


def test_a_dead_sandbox_is_discarded_not_handed_out(env: Env) -> None:
    first, second = env.fill(ECHO)
    env.backend.kill(first.container_id)
    taken = env.pools.take(ECHO, env.call_spec(ECHO), "exec-1")
    assert taken is not None and taken.prepared is second
    assert (first.discarded, first.finished_input) == (True, None)
    assert env.backend.discarded_ids == [first.container_id]
    stats = env.pools.stats()
    assert (stats.hits, stats.misses, stats.recycled) == (1, 0, 1)
    assert env.reservations() == (1, 0, MEMORY_MB)  # the dead one's room is back
    env.admission.release(taken.reservation)


def test_when_every_sandbox_is_dead_take_misses_and_the_pool_refills(env: Env) -> None:
    made = env.fill(ECHO)
    for prepared in made:
        env.backend.kill(prepared.container_id)
    assert env.pools.take(ECHO, env.call_spec(ECHO), "exec-1") is None
    assert all(p.discarded for p in made)
    stats = env.pools.stats()
    assert (stats.hits, stats.misses, stats.recycled) == (0, 1, 2)
    wait_until(lambda: env.pools.stats().warm == {"echo": 2}, "the pool refilled")
    assert len(env.backend.prepared) == 4


def test_a_too_old_sandbox_is_discarded_not_handed_out(env: Env) -> None:
    first, second = env.fill(ECHO)
    first.created = time.monotonic() - warm_pool.DEFAULT_MAX_AGE_S - 1
    taken = env.pools.take(ECHO, env.call_spec(ECHO), "exec-1")
    assert taken is not None and taken.prepared is second
    assert (first.discarded, second.discarded) == (True, False)
    env.admission.release(taken.reservation)


def test_with_a_short_max_age_a_waiting_sandbox_expires(make_env: Callable[..., Env]) -> None:
    env = make_env(max_age_s=0.05)
    [first] = env.fill(warm("echo", 1))
    assert env.backend.prepare_lifetimes == [0.05]
    time.sleep(0.06)
    assert env.pools.take(warm("echo", 1), env.call_spec(warm("echo", 1)), "exec-1") is None
    assert first.discarded is True
    assert env.pools.stats().misses == 1
    wait_until(lambda: len(env.backend.prepared) >= 2, "a fresh one is made")


def test_the_worker_recycles_sandboxes_that_waited_too_long(
    make_env: Callable[..., Env], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warm_pool, "WORKER_TICK_S", 0.01)
    env = make_env(max_age_s=0.05)
    [first] = env.fill(warm("echo", 1))
    wait_until(lambda: first.discarded, "the worker recycles it")
    wait_until(lambda: env.pools.stats().recycled >= 1, "it is counted")
    wait_until(lambda: any(p.alive() for p in env.backend.prepared), "a fresh one waits")
    assert first.finished_input is None


# ---------------------------------------------------------------- never pooled


def test_a_tool_whose_sandbox_gets_mounts_is_never_pooled(
    make_env: Callable[..., Env], tmp_path: Path
) -> None:
    policy = SandboxPolicy(workspace_dir=tmp_path, workspace_tools=frozenset({"wipe"}))
    env = make_env(policy=policy)
    wipe = warm("wipe", 2, safety_level="dangerous")
    other = warm("other", 1, safety_level="dangerous")
    assert env.call_spec(wipe).mounts == (
        Mount(str(tmp_path.resolve()), WORKSPACE_TARGET, read_only=False),
    )
    env.pools.track(wipe)
    env.fill(other)  # the same level without the workspace is pooled
    time.sleep(QUIET_S)
    assert [p.spec.mounts for p in env.backend.prepared] == [()]
    assert env.pools.stats().warm == {"other": 1}
    assert env.pools.take(wipe, env.call_spec(wipe), "exec-1") is None
    assert env.reservations() == (1, 0, DANGEROUS_LIMITS.memory_mb)


# ---------------------------------------------------------------- giving room back


def test_evict_one_gives_back_the_oldest_reservation(env: Env) -> None:
    [alpha] = env.fill(warm("alpha", 1))
    [beta] = env.fill(warm("beta", 1))
    now = time.monotonic()
    alpha.created, beta.created = now - 5, now - 10  # beta waited longest
    assert env.pools.evict_one() is True
    assert (beta.discarded, alpha.discarded) == (True, False)
    assert env.reservations() == (1, 0, MEMORY_MB)
    assert env.pools.stats().warm == {"alpha": 1, "beta": 0}
    assert env.pools.evict_one() is True
    assert alpha.discarded is True
    assert env.reservations() == (0, 0, 0)
    assert env.pools.evict_one() is False  # nothing warm left


def test_a_call_that_needs_room_takes_it_from_a_warm_sandbox(
    make_env: Callable[..., Env],
) -> None:
    env = make_env(max_running=2)
    made = env.fill(warm("echo", 2))
    inside: list[tuple[int, int]] = []

    def call() -> None:
        with env.admission.slot(memory_mb=MEMORY_MB):
            inside.append((env.admission.running, env.admission.reserved))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the call never got room"
    assert inside == [(1, 1)]
    assert [p.discarded for p in made] == [True, False]  # the oldest went


# ---------------------------------------------------------------- an engine that fails


def test_a_refill_failure_backs_off_and_calls_go_cold(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=warm_pool.__name__)
    env.backend.fail_prepare(SandboxError("no space left on device"), times=None)
    env.pools.track(ECHO)
    wait_until(lambda: env.pools.stats().refill_failures == 1, "the refill failed")
    assert env.reservations() == (0, 0, 0)  # the failed refill's room is back
    assert env.pools.take(ECHO, env.call_spec(ECHO), "exec-1") is None
    time.sleep(QUIET_S)
    assert env.backend.prepare_attempts == 1  # backing off, even when notified by take
    stats = env.pools.stats()
    assert (stats.hits, stats.misses, stats.refill_failures, stats.warm) == (0, 1, 1, {"echo": 0})
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "warm pool of echo cannot refill (calls run cold meanwhile): no space left on device"
        in messages
    )
    assert "warm pool of echo cannot refill; running cold" in messages  # engine_failing


def test_a_refill_that_fails_outside_the_engine_keeps_the_worker_and_gives_the_room_back(
    make_env: Callable[..., Env], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warm_pool, "REFILL_BACKOFF_S", 0.05)
    monkeypatch.setattr(warm_pool, "WORKER_TICK_S", 0.01)
    env = make_env()
    env.backend.fail_prepare(ValueError("a spec this backend cannot hold"), times=1)
    env.fill(ECHO)  # the worker lived on and refilled after its back-off
    assert env.pools.stats().refill_failures == 1
    assert env.backend.prepare_attempts == 1 + ECHO.warm_pool
    # one reservation per warm sandbox: the failed refill's room came back
    assert env.reservations()[0] == ECHO.warm_pool


def test_after_the_back_off_the_pool_refills_once_the_engine_is_back(
    make_env: Callable[..., Env], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(warm_pool, "REFILL_BACKOFF_S", 0.05)
    monkeypatch.setattr(warm_pool, "WORKER_TICK_S", 0.01)
    env = make_env()
    env.backend.fail_prepare(EngineUnavailable("docker.sock: connection refused"), times=2)
    env.fill(ECHO)
    assert env.pools.stats().refill_failures == 2
    assert env.backend.prepare_attempts == 4
    caplog.set_level(logging.INFO, logger=warm_pool.__name__)
    taken = env.pools.take(ECHO, env.call_spec(ECHO), "exec-1")
    assert taken is not None
    assert "running cold" not in caplog.text  # engine_failing was cleared
    env.admission.release(taken.reservation)


# ---------------------------------------------------------------- closing


def test_close_discards_every_warm_sandbox_and_releases_every_reservation(env: Env) -> None:
    made = env.fill(warm("alpha", 2)) + env.fill(warm("beta", 1))
    assert env.reservations() == (3, 0, 3 * MEMORY_MB)
    env.pools.close()
    assert all(p.discarded for p in made)
    assert sorted(env.backend.discarded_ids) == sorted(p.container_id for p in made)
    assert env.reservations() == (0, 0, 0)
    assert env.pools.stats().warm == {}
    assert env.pools.evict_one() is False
    assert env.pools.take(warm("alpha", 2), env.call_spec(warm("alpha", 2)), "exec-1") is None


def test_a_sandbox_made_while_closing_is_discarded(env: Env) -> None:
    entered, release = threading.Event(), threading.Event()

    def block(spec: SandboxSpec) -> None:
        entered.set()
        release.wait(JOIN_S)

    env.backend.on_prepare = block
    env.pools.track(warm("echo", 1))
    assert entered.wait(JOIN_S)
    closer = threading.Thread(target=env.pools.close, daemon=True)
    closer.start()
    wait_until(lambda: env.pools.stats().warm == {}, "close dropped the pools")
    release.set()
    closer.join(JOIN_S)
    assert not closer.is_alive()
    [late] = env.backend.prepared
    assert (late.discarded, late.finished_input) == (True, None)
    assert env.reservations() == (0, 0, 0)


def test_a_sandbox_made_for_a_replaced_definition_is_discarded(env: Env) -> None:
    entered, release = threading.Event(), threading.Event()

    def block_once(spec: SandboxSpec) -> None:
        env.backend.on_prepare = None
        entered.set()
        release.wait(JOIN_S)

    env.backend.on_prepare = block_once
    env.pools.track(warm("echo", 1))
    assert entered.wait(JOIN_S)
    newer = warm("echo", 1, description="Newer.")
    env.pools.track(newer)
    release.set()
    wait_until(lambda: env.pools.stats().warm == {"echo": 1}, "the new definition is warm")
    stale = env.backend.prepared[0]
    wait_until(lambda: stale.discarded, "the stale one is discarded")
    taken = env.pools.take(newer, env.call_spec(newer), "exec-1")
    assert taken is not None and taken.prepared is not stale
    env.admission.release(taken.reservation)
    assert env.reservations() == (0, 0, 0)

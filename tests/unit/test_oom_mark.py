"""A container that died of a SIGKILL toolreg did not send: its OOM mark is waited for,
briefly, since the engine may record it after the exit (sandbox_runner/docker_backend.py,
_final_state). Pure logic: a fake engine API."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sandbox_runner import docker_backend
from sandbox_runner.docker_backend import OOM_MARK_WAIT_S, _final_state


class FakeApi:
    """Answers inspect_container with each given state in turn, then the last forever."""

    def __init__(self, *states: dict[str, Any]) -> None:
        self.states = list(states)
        self.inspections = 0

    def inspect_container(self, _container_id: str) -> dict[str, Any]:
        self.inspections += 1
        state = self.states[min(self.inspections, len(self.states)) - 1]
        return {"State": state}


def pump(killed: bool = False) -> Any:
    return SimpleNamespace(exited=None, killed=killed, ended=True)


def exited(code: int, oom: bool) -> dict[str, Any]:
    return {"Running": False, "ExitCode": code, "OOMKilled": oom}


def test_an_oom_mark_recorded_after_the_exit_is_seen() -> None:
    api = FakeApi(exited(137, False), exited(137, False), exited(137, True))
    assert _final_state(api, "c", pump()) == (137, True)
    assert api.inspections == 3


def test_a_sigkill_without_oom_waits_only_its_bound(monkeypatch: Any) -> None:
    now = [0.0]
    monkeypatch.setattr(docker_backend.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(docker_backend.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    api = FakeApi(exited(137, False))
    assert _final_state(api, "c", pump()) == (137, False)
    assert now[0] <= OOM_MARK_WAIT_S + 0.1


def test_no_wait_when_toolreg_killed_it_or_it_exited_otherwise() -> None:
    killed = FakeApi(exited(137, False), exited(137, True))
    assert _final_state(killed, "c", pump(killed=True)) == (137, False)
    assert killed.inspections == 1  # a timeout's or a cancel's kill: no OOM to wait for
    failed = FakeApi(exited(1, False), exited(1, True))
    assert _final_state(failed, "c", pump()) == (1, False)
    assert failed.inspections == 1

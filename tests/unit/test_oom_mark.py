"""Telling a memory-limit kill from any other end (sandbox_runner/docker_backend.py,
_final_state): the engine's OOMKilled mark, or, under gVisor, a whole sandbox SIGKILLed
that toolreg did not kill, since the engine does not always mark that. Pure logic: a
fake engine API and pump."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sandbox_runner.docker_backend import _final_state
from sandbox_runner.profiles import GVISOR


class FakeApi:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def inspect_container(self, _container_id: str) -> dict[str, Any]:
        return {"State": self.state}


def pump(runtime: str = GVISOR, killed: bool = False, exited: Any = None) -> Any:
    return SimpleNamespace(
        exited=exited, killed=killed, ended=True, spec=SimpleNamespace(runtime=runtime)
    )


def state(code: int, oom: bool = False) -> dict[str, Any]:
    return {"Running": False, "ExitCode": code, "OOMKilled": oom}


@pytest.mark.parametrize("runtime", [GVISOR, "runc"])
def test_the_engines_mark_counts_under_every_runtime(runtime: str) -> None:
    assert _final_state(FakeApi(state(137, oom=True)), "c", pump(runtime)) == (137, True)


def test_a_gvisor_sandbox_killed_whole_and_unmarked_met_its_memory_limit() -> None:
    assert _final_state(FakeApi(state(137)), "c", pump()) == (137, True)


def test_not_a_memory_kill() -> None:
    api = FakeApi(state(137))
    assert _final_state(api, "c", pump("runc")) == (137, False)  # runc's OOMs are marked
    assert _final_state(api, "c", pump(killed=True)) == (137, False)  # toolreg's own kill
    init_saw_it = SimpleNamespace(exit_code=137, signal=9)  # the tool died, its init lived
    assert _final_state(api, "c", pump(exited=init_saw_it)) == (137, False)
    assert _final_state(FakeApi(state(1)), "c", pump()) == (1, False)

"""What a failed container start says about its cause (docker_backend): at a
small memory limit, dockerd's "cannot start a stopped process" means the
runtime's own init was OOM-killed (moby/moby#41167), which the error names."""

from __future__ import annotations

import pytest

from sandbox_runner.docker_backend import SMALL_MEMORY_MB, STOPPED_AT_START, _small_memory_hint
from sandbox_runner.spec import SandboxError

ENGINE = (
    "container start failed: 500 Server Error: Internal Server Error"
    f' ("{STOPPED_AT_START}: unknown")'
)


def test_a_start_killed_at_a_small_memory_limit_names_the_limit() -> None:
    too_small = r"memory limit, 8 MiB, is likely too small"
    with pytest.raises(SandboxError, match=too_small) as info, _small_memory_hint(8):
        raise SandboxError(ENGINE)
    assert STOPPED_AT_START in str(info.value)  # the engine's own words stay


@pytest.mark.parametrize(
    ("memory_mb", "error"),
    [(SMALL_MEMORY_MB, ENGINE), (8, "container start failed: no such image")],
)
def test_other_failures_are_left_as_they_are(memory_mb: int, error: str) -> None:
    with pytest.raises(SandboxError) as info, _small_memory_hint(memory_mb):
        raise SandboxError(error)
    assert str(info.value) == error

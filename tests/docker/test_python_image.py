"""toolreg/python is python3 and what it loads, nothing else (no apt, dpkg or perl):
the example tools and the standard library still work in it, under runc and gVisor."""

from __future__ import annotations

import json
from collections.abc import Callable

import docker
import pytest

from sandbox_runner import SAFE_LIMITS, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend

PYTHON_IMAGE = "toolreg/python"
MAX_IMAGE_MB = 60  # it was 116 MB with debootstrap's whole minbase
Eid = Callable[[], str]


def run(runner: DockerBackend, eid: Eid, command: tuple[str, ...], payload: object,
        runtime: str = "runc") -> tuple[int | None, str, str]:  # fmt: skip
    spec = SandboxSpec(
        image=PYTHON_IMAGE, command=command, env=(), limits=SAFE_LIMITS.replace(memory_mb=256),
        runtime=runtime, input=json.dumps(payload).encode(),
    )  # fmt: skip
    res = runner.run(spec, execution_id=eid())
    return res.exit_code, res.stdout.decode(), res.stderr.decode()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_the_example_tools_run_in_the_python_image(
    runner: DockerBackend, eid: Eid, runtime: str
) -> None:
    code = (
        "import json, re, sqlite3, subprocess, zoneinfo, decimal, hashlib, csv\n"
        "db = sqlite3.connect(':memory:'); db.execute('create table t (x)')\n"
        "print(subprocess.run(['sh', '-c', 'echo shell'], capture_output=True, text=True)"
        ".stdout.strip(), hashlib.sha256(b'x').hexdigest()[:8], decimal.Decimal('1.10') * 2)"
    )
    ran = run(runner, eid, ("python3", "/opt/toolreg/tools/run_python.py"), {"code": code},
              runtime)  # fmt: skip
    assert ran[0] == 0, ran
    assert ran[1].strip() == "shell 2d711642 2.20"
    counted = run(runner, eid, ("python3", "/opt/toolreg/tools/word_count.py"),
                  {"text": "one two\nthree"}, runtime)  # fmt: skip
    assert counted[0] == 0 and json.loads(counted[1]) == {"words": 3, "lines": 2, "chars": 13}


def test_the_python_image_holds_no_package_manager_and_stays_small(
    docker_client: docker.DockerClient, runner: DockerBackend, eid: Eid
) -> None:
    probe = (
        "import shutil; print([c for c in ('apt', 'apt-get', 'dpkg', 'perl') if shutil.which(c)])"
    )
    ran = run(runner, eid, ("python3", "-c", probe), {})
    assert ran[:2] == (0, "[]\n"), ran
    size_mb = docker_client.images.get(PYTHON_IMAGE).attrs["Size"] / 1e6
    assert size_mb < MAX_IMAGE_MB, f"{PYTHON_IMAGE} is {size_mb:.0f} MB"

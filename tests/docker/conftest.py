"""Real-engine fixtures: one DockerBackend per test session, scoped by a run label.

Every container a test creates carries `io.toolreg.test-run=<run id>`; after each test
none may be left, and the session removes (and reports) anything that still is. Nothing
without our run label is ever touched: other people use the same engine.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator

import docker
import docker.errors
import pytest

from sandbox_runner import SAFE_LIMITS, Limits, Mount, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.spec import INIT_BINARY

RUN_LABEL = "io.toolreg.test-run"
# The sandbox image the suite runs against; TOOLREG_TEST_IMAGE overrides it (any image
# with a static busybox as /bin/busybox and /bin/sh works).
IMAGE = os.environ.get("TOOLREG_TEST_IMAGE", "toolreg/base")

SpecFactory = Callable[..., SandboxSpec]


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(version="auto")
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(f"the docker tests need a running Docker engine: {e}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def image(docker_client: docker.DockerClient) -> str:
    try:
        docker_client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"sandbox image {IMAGE!r} is missing: build it with `make images`")
    return IMAGE


def _ours(client: docker.DockerClient, run_id: str) -> list[str]:
    found = client.api.containers(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
    return [c["Id"] for c in found]


def _remove(client: docker.DockerClient, ids: list[str]) -> None:
    for cid in ids:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(cid, force=True, v=True)


@pytest.fixture(scope="session")
def init_path() -> str:
    """The built sandbox init: the suite runs the real configuration, init included."""
    if not INIT_BINARY.is_file():
        pytest.fail(f"the sandbox init {INIT_BINARY} is not built: run `make init`")
    return str(INIT_BINARY)


@pytest.fixture(scope="session")
def runner(
    run_id: str, docker_client: docker.DockerClient, init_path: str
) -> Iterator[DockerBackend]:
    r = DockerBackend(
        instance_id=f"test-{run_id}",
        extra_labels={RUN_LABEL: run_id},
        max_pool_size=32,
        init_path=init_path,
    )
    yield r
    r.close()
    left = _ours(docker_client, run_id)
    _remove(docker_client, left)
    assert not left, f"containers left behind by the test session: {left}"


@pytest.fixture(autouse=True)
def no_container_left(docker_client: docker.DockerClient, run_id: str) -> Iterator[None]:
    yield
    left = _ours(docker_client, run_id)
    _remove(docker_client, left)
    assert not left, f"containers left behind by this test: {left}"


@pytest.fixture
def make_spec(image: str) -> SpecFactory:
    """make_spec("script", input=b"", runtime="runc", env=(), mounts=(), workdir=None,
    **limit overrides) -> a spec running `sh -c script` in the test image."""

    def factory(
        script: str,
        *,
        input: bytes = b"",
        runtime: str = "runc",
        env: tuple[tuple[str, str], ...] = (),
        mounts: tuple[Mount, ...] = (),
        workdir: str | None = None,
        limits: Limits = SAFE_LIMITS,
        **overrides: int,
    ) -> SandboxSpec:
        return SandboxSpec(
            image=image,
            command=("sh", "-c", script),
            env=env,
            limits=limits.replace(**overrides) if overrides else limits,
            runtime=runtime,
            input=input,
            mounts=mounts,
            workdir=workdir,
        )

    return factory


@pytest.fixture
def eid() -> Callable[[], str]:
    """Fresh execution ids (they name containers, so must be unique per run)."""
    return lambda: f"t-{uuid.uuid4().hex[:16]}"

"""Round trips through a real container: stdin, stdout, stderr, exit codes, engine errors."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from sandbox_runner import EngineUnavailable, Mount, SandboxError, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.ownership import LABEL_EXECUTION_ID

Eid = Callable[[], str]
SpecFactory = Callable[..., SandboxSpec]
CREATED_WITHIN_S = 30.0  # seconds for a run's container to be created on a busy machine


def test_cat_round_trip_delivers_stdin_and_eof(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    payload = b'{"text": "hello", "n": 1}'
    # `cat` only exits after EOF on stdin: returning at all proves stdin was closed.
    res = runner.run(make_spec("cat", input=payload, timeout_ms=10_000), execution_id=eid())
    assert res.exit_code == 0
    assert res.stdout == payload
    assert res.stderr == b""
    assert not (res.timed_out or res.oom_killed or res.output_truncated or res.cancelled)
    assert res.duration_ms < 5_000
    assert len(res.container_id) == 64


def test_empty_input_is_immediate_eof(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("wc -c"), execution_id=eid())
    assert (res.exit_code, res.stdout.strip()) == (0, b"0")


def test_input_larger_than_pipe_buffers_is_interleaved_with_output(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    payload = os.urandom(3 * 1024 * 1024)
    spec = make_spec("cat", input=payload, output_bytes=4 * 1024 * 1024)
    res = runner.run(spec, execution_id=eid())
    assert res.exit_code == 0
    assert res.stdout == payload
    assert not res.output_truncated


def test_tool_that_never_reads_stdin_still_finishes(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("echo done", input=b"x" * (2 * 1024 * 1024)), execution_id=eid())
    assert (res.exit_code, res.stdout, res.timed_out) == (0, b"done\n", False)


def test_nonzero_exit_reports_stderr(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    res = runner.run(make_spec("echo partial; echo boom >&2; exit 3"), execution_id=eid())
    assert res.exit_code == 3
    assert res.stdout == b"partial\n"
    assert res.stderr == b"boom\n"
    assert not (res.timed_out or res.oom_killed)


def test_env_and_workdir(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    spec = make_spec('echo "$GREETING"; pwd', env=(("GREETING", "hi there"),), workdir="/tmp")
    res = runner.run(spec, execution_id=eid())
    assert res.stdout == b"hi there\n/tmp\n"


def test_output_streams_as_it_is_produced(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    seen: list[tuple[float, str, bytes]] = []

    def sink(stream: str, chunk: bytes) -> None:
        seen.append((time.monotonic(), stream, chunk))

    spec = make_spec("echo first; echo warn >&2; sleep 1; echo second")
    res = runner.run(spec, execution_id=eid(), on_output=sink)
    done = time.monotonic()
    assert res.exit_code == 0
    assert b"".join(c for _, s, c in seen if s == "stdout") == res.stdout == b"first\nsecond\n"
    assert b"".join(c for _, s, c in seen if s == "stderr") == res.stderr == b"warn\n"
    # stdout and stderr are separate pipes: their relative order is not guaranteed.
    first_out = next((t, c) for t, s, c in seen if s == "stdout")
    assert first_out[1] == b"first\n"
    assert done - first_out[0] > 0.7, "the first chunk should arrive before the tool ends"


def test_sink_exception_propagates_and_container_is_removed(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    def sink(stream: str, chunk: bytes) -> None:
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        runner.run(make_spec("echo x; sleep 30"), execution_id=eid(), on_output=sink)
    # no_container_left checks the removal


def test_missing_image_is_a_clear_sandbox_error(runner: DockerBackend, eid: Eid) -> None:
    from sandbox_runner import SAFE_LIMITS

    spec = SandboxSpec(
        image="toolreg/does-not-exist:never", command=("true",), env=(), limits=SAFE_LIMITS
    )
    with pytest.raises(SandboxError, match=r"image 'toolreg/does-not-exist:never' not found"):
        runner.run(spec, execution_id=eid())


def test_unknown_runtime_is_a_sandbox_error(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    with pytest.raises(SandboxError, match="create failed") as info:
        runner.run(make_spec("true", runtime="no-such-runtime"), execution_id=eid())
    assert not isinstance(info.value, EngineUnavailable)


def test_reused_execution_id_fails_without_touching_the_running_one(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, docker_client: docker.DockerClient
) -> None:
    same = eid()
    results: list[object] = []
    first = threading.Thread(
        target=lambda: results.append(runner.run(make_spec("sleep 2; echo ok"), execution_id=same))
    )
    first.start()
    # The first run's container exists once its thread has created it, later
    # on a busy machine: only then can the second one clash with it.
    deadline = time.monotonic() + CREATED_WITHIN_S
    while not docker_client.api.containers(
        all=True, filters={"label": f"{LABEL_EXECUTION_ID}={same}"}
    ):
        assert time.monotonic() < deadline, "the first run's container was never created"
        time.sleep(0.05)
    with pytest.raises(SandboxError, match="create failed"):
        runner.run(make_spec("echo second"), execution_id=same)
    first.join(10)
    assert len(results) == 1
    assert getattr(results[0], "stdout", None) == b"ok\n"


def test_no_engine_is_engine_unavailable(make_spec: SpecFactory, eid: Eid) -> None:
    r = DockerBackend(instance_id="nowhere", base_url="unix:///nonexistent/docker.sock")
    assert r.ping() is False
    with pytest.raises(EngineUnavailable):
        r.run(make_spec("true"), execution_id=eid())
    with pytest.raises(EngineUnavailable):
        r.reap()


def test_concurrent_runs_do_not_mix_outputs(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    n = 12
    outputs: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            payload = f"payload-{i}-".encode() * 1000
            res = runner.run(make_spec("cat", input=payload), execution_id=eid())
            outputs[i] = res.stdout if res.stdout == payload else b"MISMATCH"
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(outputs) == list(range(n))
    assert all(v != b"MISMATCH" for v in outputs.values())


def test_bind_mounts_exactly_as_given(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, tmp_path: Path
) -> None:
    rw = tmp_path / "rw"
    ro = tmp_path / "ro"
    for d in (rw, ro):
        d.mkdir()
        d.chmod(0o777)  # the tool runs as uid 65534
    (ro / "given.txt").write_text("from host")
    spec = make_spec(
        "echo written > /work/out.txt && cat /in/given.txt && ! echo x > /in/new.txt",
        mounts=(Mount(str(rw), "/work", read_only=False), Mount(str(ro), "/in")),
    )
    res = runner.run(spec, execution_id=eid())
    assert res.exit_code == 0, res.stderr
    assert res.stdout == b"from host"
    assert (rw / "out.txt").read_text() == "written\n"
    assert not (ro / "new.txt").exists()


def test_ping_and_runtimes(runner: DockerBackend, docker_client: docker.DockerClient) -> None:
    assert runner.ping() is True
    assert "runc" in runner.runtimes()


def test_missing_bind_source_is_a_sandbox_error(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, tmp_path: Path
) -> None:
    spec = make_spec("true", mounts=(Mount(str(tmp_path / "absent"), "/work"),))
    with pytest.raises(SandboxError, match="create failed"):
        runner.run(spec, execution_id=eid())

"""The sandbox init: nothing of a tool runs before its call is released, and images that
would slip out of the sandbox (VOLUME) are refused."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import docker.errors
import docker.types
import pytest

from sandbox_runner import Mount, SandboxError, SandboxResult, SandboxSpec, after_call
from sandbox_runner.docker_backend import (
    GO_BYTE,
    INIT_NOT_RELEASED_EXIT,
    INIT_PROTOCOL,
    INIT_TARGET,
    SIZED_GO_BYTE,
    DockerBackend,
    _ImageFacts,
    _ImageFactsCache,
)
from sandbox_runner.framing import INIT_EXIT, INIT_HELLO, STDERR, STDOUT, InitDecoder, InitExit

RUN_LABEL = "io.toolreg.test-run"  # conftest's: every container and image we make has it

Eid = Callable[[], str]
SpecFactory = Callable[..., SandboxSpec]

RUNTIMES = ["runc", "runsc"]  # this engine has both: no skipping (see test_runner_runsc.py)
HOLD_S = 2.0  # seconds a prepared container is left alone before we look for side effects
# Runs at once when started, whether or not it reads stdin; `cat` then echoes the input.
MARK_THEN_CAT = "touch /w/ran; cat"
HELLO = b"H\x00\x00\x00\x01" + bytes([INIT_PROTOCOL])  # the init's first frame
# A tool's attempt to write the init's own 'exit 0' frame into the stream the server reads.
FORGE_EXIT_0 = r"printf 'X\000\000\000\005\000\000\000\000\000' > /proc/1/fd/1"


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    d = tmp_path / "w"
    d.mkdir()
    d.chmod(0o777)  # the tool runs as uid 65534
    return d


def marking_spec(make_spec: SpecFactory, shared: Path, runtime: str) -> SandboxSpec:
    return make_spec(
        MARK_THEN_CAT, runtime=runtime, mounts=(Mount(str(shared), "/w", read_only=False),)
    )


def with_command(spec: SandboxSpec, *command: str) -> SandboxSpec:
    return dataclasses.replace(spec, command=command)


def warm_run(runner: DockerBackend, spec: SandboxSpec) -> SandboxResult:
    """A call handed to a container prepared ahead of it, as a warm pool's are."""
    prepared = runner.prepare(spec, execution_id=f"t-{uuid.uuid4().hex[:16]}", lifetime_s=30)
    try:
        time.sleep(HOLD_S / 4)
        return prepared.finish(b"")
    finally:
        prepared.discard()  # no-op after finish


# -- held until finish ---------------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_prepared_container_runs_nothing_until_finish(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, shared_dir: Path, runtime: str
) -> None:
    prepared = runner.prepare(
        marking_spec(make_spec, shared_dir, runtime), execution_id=eid(), lifetime_s=30
    )
    try:
        time.sleep(HOLD_S)
        assert prepared.alive()
        assert not (shared_dir / "ran").exists(), "the tool ran before its call"
        res = prepared.finish(b"{}")
    finally:
        prepared.discard()  # no-op after finish
    assert (res.exit_code, res.stdout, res.stderr) == (0, b"{}", b"")
    assert (shared_dir / "ran").exists()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_discarded_container_never_runs_the_tool(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, shared_dir: Path, runtime: str
) -> None:
    prepared = runner.prepare(
        marking_spec(make_spec, shared_dir, runtime), execution_id=eid(), lifetime_s=30
    )
    time.sleep(HOLD_S / 2)
    prepared.discard()  # closes stdin (EOF to the init) and removes the container
    time.sleep(HOLD_S / 2)
    assert not (shared_dir / "ran").exists(), "discard ran the tool"


def test_without_init_prepare_starts_the_tool_at_once(
    run_id: str, make_spec: SpecFactory, eid: Eid, shared_dir: Path
) -> None:
    # The hazard the init closes, shown with a runner that has none (as a reaper has).
    bare = DockerBackend(instance_id=f"bare-{run_id}", extra_labels={RUN_LABEL: run_id})
    try:
        prepared = bare.prepare(marking_spec(make_spec, shared_dir, "runc"), execution_id=eid())
        try:
            deadline = time.monotonic() + HOLD_S * 5
            while not (shared_dir / "ran").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (shared_dir / "ran").exists()
        finally:
            prepared.discard()
    finally:
        bare.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_warm_container_given_eof_exits_125_having_run_nothing(
    runner: DockerBackend,
    docker_client: docker.DockerClient,
    make_spec: SpecFactory,
    eid: Eid,
    shared_dir: Path,
    runtime: str,
) -> None:
    """The tool's process is forked while the call is awaited: it is still the init's
    code, and without the go byte it exits without exec (the container's code 125)."""
    prepared = runner.prepare(
        marking_spec(make_spec, shared_dir, runtime), execution_id=eid(), lifetime_s=30
    )
    try:
        time.sleep(HOLD_S / 2)
        prepared._sock.shutdown(socket.SHUT_WR)  # EOF on the init's stdin, as discard gives
        status = docker_client.api.wait(prepared.container_id, timeout=30)["StatusCode"]
    finally:
        prepared.discard()
    assert status == INIT_NOT_RELEASED_EXIT
    assert not (shared_dir / "ran").exists(), "the held process ran the tool"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_tool_is_the_inits_only_child_as_before(
    runner: DockerBackend, make_spec: SpecFactory, runtime: str
) -> None:
    """Forked ahead of its call or not, the tool is the init's child, and sees only
    the init besides itself and what it started."""
    res = warm_run(runner, make_spec("echo $PPID; ls /proc | grep -c '^[0-9]'", runtime=runtime))
    parent, count = res.stdout.decode().splitlines()
    assert parent == "1"
    assert int(count) <= 4  # init, sh, ls and grep (ls may be gone already)


def test_a_warm_tool_that_forks_many_processes_meets_the_pids_limit(
    runner: DockerBackend, make_spec: SpecFactory
) -> None:
    """The held process counts against the pids limit from the start, as the tool it
    becomes: a fork storm gets no more processes than a cold run's."""
    res = warm_run(runner, make_spec("for i in $(seq 40); do sleep 5 & done; echo x", pids=16))
    # The shell gives up at its first failed fork, well before its 40th sleep.
    assert (res.exit_code, res.stdout) == (2, b""), res.stderr
    assert b"can't fork" in res.stderr


def test_cold_run_holds_too(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, shared_dir: Path
) -> None:
    # run() is prepare + finish: the same go byte, then the input, on one stream.
    spec = dataclasses.replace(marking_spec(make_spec, shared_dir, "runc"), input=b"")
    res = runner.run(spec, execution_id=eid())
    assert (res.exit_code, res.stdout) == (0, b"")
    assert (shared_dir / "ran").exists()


# -- the init's own outcomes, in a container -------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_missing_program_is_127_with_a_message(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, runtime: str
) -> None:
    spec = with_command(make_spec("", runtime=runtime), "no-such-program", "--flag")
    res = runner.run(spec, execution_id=eid())
    assert res.exit_code == 127
    assert res.stderr == b"toolreg-init: cannot run no-such-program: No such file or directory\n"
    assert res.stdout == b""


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_program_that_is_not_executable_is_126(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, runtime: str
) -> None:
    res = runner.run(
        with_command(make_spec("", runtime=runtime), "/etc/passwd"), execution_id=eid()
    )
    assert res.exit_code == 126
    assert res.stderr == b"toolreg-init: cannot run /etc/passwd: Permission denied\n"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_init_given_eof_exits_125_and_runs_nothing(
    docker_client: docker.DockerClient,
    runner: DockerBackend,
    image: str,
    run_id: str,
    eid: Eid,
    shared_dir: Path,
    runtime: str,
) -> None:
    # Built by hand: stdin not open is /dev/null, i.e. EOF before any go byte.
    api = docker_client.api
    assert runner.init_path is not None
    host_config = api.create_host_config(
        network_mode="none",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        runtime=runtime,
        mounts=[
            docker.types.Mount(INIT_TARGET, str(runner.init_path), type="bind", read_only=True),
            docker.types.Mount("/w", str(shared_dir), type="bind", read_only=False),
        ],
    )
    created = api.create_container(
        image,
        entrypoint=[INIT_TARGET],
        command=["sh", "-c", "touch /w/ran"],
        user="65534:65534",
        stdin_open=False,
        labels={RUN_LABEL: run_id},
        name=f"toolreg-{eid()}",
        host_config=host_config,
    )
    try:
        api.start(created["Id"])
        status = api.wait(created["Id"], timeout=30)["StatusCode"]
        logs = api.logs(created["Id"])
    finally:
        api.remove_container(created["Id"], force=True)
    assert status == INIT_NOT_RELEASED_EXIT
    assert logs == HELLO  # only the hello: EOF is the normal discard, silent
    assert not (shared_dir / "ran").exists()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_init_is_read_only_inside(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, runtime: str
) -> None:
    assert runner.init_path is not None
    before = hashlib.sha256(runner.init_path.read_bytes()).hexdigest()
    spec = make_spec(
        f"grep ' {INIT_TARGET} ' /proc/mounts; echo x > {INIT_TARGET} || echo refused",
        runtime=runtime,
    )
    res = runner.run(spec, execution_id=eid())
    mount_line, refused = res.stdout.decode().splitlines()
    assert "ro" in mount_line.split()[3].split(",")
    assert refused == "refused"
    assert hashlib.sha256(runner.init_path.read_bytes()).hexdigest() == before


# -- the protocol, on the host (the same static binary) --------------------------------------


def run_init(init_path: str, stdin: bytes, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([init_path, *argv], input=stdin, capture_output=True, timeout=10)


def frames(stdout: bytes) -> list[tuple[str, object]]:
    decoder = InitDecoder()
    events = decoder.feed(stdout)
    assert not decoder.mid_frame
    return events


def test_go_byte_runs_the_program_with_the_rest_of_stdin_and_frames_its_output(
    init_path: str,
) -> None:
    done = run_init(init_path, GO_BYTE + b'{"a": 1}', "sh", "-c", "cat; echo oops >&2; exit 3")
    assert (done.returncode, done.stderr) == (3, b"")
    assert frames(done.stdout) == [
        (INIT_HELLO, INIT_PROTOCOL),
        (STDOUT, b'{"a": 1}'),
        (STDERR, b"oops\n"),
        (INIT_EXIT, InitExit(signal=0, status=3)),
    ]


def test_a_killed_program_is_reported_with_its_signal(init_path: str) -> None:
    done = run_init(init_path, GO_BYTE, "sh", "-c", "kill -TERM $$")
    assert done.returncode == 128 + 15
    assert frames(done.stdout)[-1] == (INIT_EXIT, InitExit(signal=15, status=0))


def test_the_tool_cannot_forge_a_frame(init_path: str) -> None:
    """Whatever a tool writes travels inside frames: an exit frame in its output is
    output, and the real exit comes last."""
    forged = b"X\x00\x00\x00\x05\x00\x00\x00\x00\x00"  # 'exit 0', as the init writes it
    done = run_init(init_path, GO_BYTE + forged, "sh", "-c", "cat; exit 7")
    events = frames(done.stdout)
    assert events[-1] == (INIT_EXIT, InitExit(signal=0, status=7))
    assert b"".join(v for k, v in events if k == STDOUT) == forged  # type: ignore[misc]


def test_the_exit_is_reported_while_a_grandchild_still_holds_the_output(init_path: str) -> None:
    started = time.monotonic()
    done = run_init(init_path, GO_BYTE, "sh", "-c", "(sleep 3; echo late) & echo now")
    assert time.monotonic() - started < 2
    assert frames(done.stdout)[-2:] == [(STDOUT, b"now\n"), (INIT_EXIT, InitExit(0, 0))]


@pytest.mark.parametrize("stdin", [b"", b"X{}", b"g{}"], ids=["eof", "other", "lowercase"])
def test_anything_but_the_go_byte_runs_nothing(
    init_path: str, tmp_path: Path, stdin: bytes
) -> None:
    marker = tmp_path / "ran"
    done = run_init(init_path, stdin, "sh", "-c", f"touch {marker}")
    assert done.returncode == INIT_NOT_RELEASED_EXIT
    assert done.stdout == HELLO
    assert not marker.exists()
    if stdin:
        assert b"expected the go byte" in done.stderr


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, comm) of the processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append((int(entry), comm))
    return found


@pytest.mark.parametrize("stdin", [b"", b"X{}", GO_BYTE + b"{}"], ids=["eof", "other", "go"])
def test_the_held_process_is_the_init_until_the_go_byte(
    init_path: str, tmp_path: Path, stdin: bytes
) -> None:
    marker = tmp_path / "ran"
    proc = subprocess.Popen(
        [init_path, "sh", "-c", f"touch {marker}; cat"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.read(len(HELLO)) == HELLO
        deadline = time.monotonic() + 5
        while not (held := _children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Forked while waiting, and still the init: it has not exec'd anything.
        assert [comm for _, comm in held] == [Path(init_path).name[:15]]
        time.sleep(0.3)
        assert not marker.exists()
        out, _ = proc.communicate(stdin, timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert not _children(proc.pid)
    if stdin.startswith(GO_BYTE):
        assert (proc.returncode, marker.exists()) == (0, True)
        assert frames(out)[-2:] == [(STDOUT, b"{}"), (INIT_EXIT, InitExit(0, 0))]
    else:
        assert (proc.returncode, marker.exists(), out) == (INIT_NOT_RELEASED_EXIT, False, b"")


def sized(data: bytes) -> bytes:
    """The release finish sends: the sized go byte, the input's length, the input."""
    return SIZED_GO_BYTE + struct.pack(">I", len(data)) + data


def test_a_sized_release_ends_the_tools_input_without_waiting_for_eof(init_path: str) -> None:
    """After the sized go byte the tool reads exactly its input, then EOF, while the
    init's own stdin stays open (the engine closes it later)."""
    proc = subprocess.Popen(
        [init_path, "sh", "-c", "cat; echo done >&2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(sized(b'{"a": 1}') + b"not the input")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0  # stdin still open: the tool had its EOF
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    assert frames(out) == [
        (INIT_HELLO, INIT_PROTOCOL),
        (STDOUT, b'{"a": 1}'),
        (STDERR, b"done\n"),
        (INIT_EXIT, InitExit(signal=0, status=0)),
    ]


def test_a_sized_input_larger_than_a_pipe_arrives_whole(init_path: str) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: the init writes it as the tool reads
    done = run_init(init_path, sized(data), "sh", "-c", "sleep 0.2; sha256sum")
    assert done.returncode == 0
    out = b"".join(v for k, v in frames(done.stdout) if k == STDOUT)  # type: ignore[misc]
    assert out.split()[0].decode() == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("script", ["echo hi; exit 3", "head -c 10 >/dev/null; echo hi; exit 3"])
def test_input_the_tool_leaves_unread_is_dropped(init_path: str, script: str) -> None:
    """Closed or never read, the tool's stdin costs the init nothing (no SIGPIPE)."""
    done = run_init(init_path, sized(b"x" * (1 << 20)), "sh", "-c", script)
    assert done.returncode == 3
    assert frames(done.stdout)[-2:] == [(STDOUT, b"hi\n"), (INIT_EXIT, InitExit(0, 3))]


@pytest.mark.parametrize("stream", [b"", b"\0\0", b"\0\0\1\0abc"], ids=["none", "cut", "short"])
def test_a_sized_input_cut_short_is_what_came(init_path: str, stream: bytes) -> None:
    done = run_init(init_path, SIZED_GO_BYTE + stream, "cat")
    assert done.returncode == 0
    assert frames(done.stdout)[1:] == ([(STDOUT, b"abc")] if stream.endswith(b"abc") else []) + [
        (INIT_EXIT, InitExit(0, 0))
    ]


# Execs argv[1:] with every signal it can name ignored and blocked, glibc's own 32 and 33
# (which its sigaction refuses) through the system call: what CI's runner left ignored.
_IGNORE_ALL_THEN_EXEC = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
ignore = (ctypes.c_ulong * 4)(1)  # a kernel sigaction: SIG_IGN, no flags
for sig in range(1, 65):
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        assert libc.syscall(13, sig, ignore, None, 8) == 0, sig  # rt_sigaction, x86_64
signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.parametrize("parent", ["plain", "ignores-and-blocks-all"])
def test_the_tool_gets_no_blocked_or_ignored_signal(init_path: str, parent: str) -> None:
    """The init blocks SIGCHLD and SIGPIPE for itself; the tool starts with neither, and
    with no signal its parent left ignored or blocked (both survive exec)."""
    assert os.uname().machine == "x86_64", "the raw rt_sigaction number below is x86_64's"
    argv = [init_path, "grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]
    if parent != "plain":
        argv = [sys.executable, "-c", _IGNORE_ALL_THEN_EXEC, *argv]
    done = subprocess.run(argv, input=sized(b""), capture_output=True, timeout=10)
    assert done.returncode == 0, done.stderr
    out = b"".join(v for k, v in frames(done.stdout) if k == STDOUT)  # type: ignore[misc]
    assert out.decode().split() == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16]


def test_no_program_runs_nothing(init_path: str) -> None:
    done = run_init(init_path, GO_BYTE)
    assert done.returncode == INIT_NOT_RELEASED_EXIT
    assert b"usage" in done.stderr


# -- construction and specs the init cannot hold ----------------------------------------------


def test_init_path_is_checked_at_construction(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"\x7fELF")
    plain.chmod(0o744)  # owner only: uid 65534 could not run it
    for bad in (tmp_path / "missing", tmp_path, plain):
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            DockerBackend(instance_id="x", init_path=bad)


def test_an_init_needs_a_command(runner: DockerBackend, make_spec: SpecFactory, eid: Eid) -> None:
    with pytest.raises(ValueError, match=r"non-empty SandboxSpec\.command"):
        runner.prepare(with_command(make_spec("")), execution_id=eid())


@pytest.mark.parametrize("target", ["/.toolreg", "/.toolreg/init", "/.toolreg/x", "//.toolreg"])
def test_no_mount_may_cover_the_init(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, tmp_path: Path, target: str
) -> None:
    spec = make_spec("true", mounts=(Mount(str(tmp_path), target),))
    with pytest.raises(ValueError, match="overlap the init"):
        runner.run(spec, execution_id=eid())


# -- images: VOLUME refused, ENTRYPOINT kept behind the init ----------------------------------


def build_image(client: docker.DockerClient, tag: str, dockerfile: str, run_id: str) -> None:
    """The classic builder, no network; raises with the builder's own message."""
    stream = client.api.build(
        fileobj=io.BytesIO(dockerfile.encode()),
        tag=tag,
        network_mode="none",
        rm=True,
        forcerm=True,
        labels={RUN_LABEL: run_id},
        decode=True,
    )
    for chunk in stream:
        if "error" in chunk:
            raise RuntimeError(f"docker build of {tag} failed: {chunk['error']}")


@pytest.fixture(scope="module")
def derived_images(
    docker_client: docker.DockerClient, image: str, run_id: str
) -> Iterator[dict[str, str]]:
    tags = {
        "volume": f"toolreg-test/volume-{run_id}:latest",
        "entrypoint": f"toolreg-test/entrypoint-{run_id}:latest",
    }
    entrypoint = json.dumps(["/bin/sh", "-c", 'touch /w/entry; exec "$0" "$@"'])
    try:
        build_image(docker_client, tags["volume"], f"FROM {image}\nVOLUME /data\n", run_id)
        build_image(
            docker_client, tags["entrypoint"], f"FROM {image}\nENTRYPOINT {entrypoint}\n", run_id
        )
        yield tags
    finally:
        for tag in tags.values():
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(tag, force=True)


def test_image_volumes(
    runner: DockerBackend, image: str, derived_images: dict[str, str], run_id: str
) -> None:
    assert runner.image_volumes(image) == ()
    assert runner.image_volumes(derived_images["volume"]) == ("/data",)
    assert runner.image_volumes(f"toolreg-test/never-built-{run_id}:latest") is None


def test_image_with_a_volume_is_refused(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid, derived_images: dict[str, str]
) -> None:
    spec = dataclasses.replace(make_spec("true"), image=derived_images["volume"])
    pattern = re.escape(f"image '{derived_images['volume']}' declares VOLUME /data")
    with pytest.raises(SandboxError, match=pattern):
        runner.prepare(spec, execution_id=eid())
    with pytest.raises(SandboxError, match=pattern):
        runner.run(spec, execution_id=eid())


def test_image_entrypoint_runs_only_after_the_go_byte(
    runner: DockerBackend,
    make_spec: SpecFactory,
    eid: Eid,
    shared_dir: Path,
    derived_images: dict[str, str],
) -> None:
    spec = dataclasses.replace(
        marking_spec(make_spec, shared_dir, "runc"), image=derived_images["entrypoint"]
    )
    prepared = runner.prepare(spec, execution_id=eid(), lifetime_s=30)
    try:
        time.sleep(HOLD_S)
        assert not (shared_dir / "entry").exists(), "the image's ENTRYPOINT ran early"
        res = prepared.finish(b"in")
    finally:
        prepared.discard()
    # Entrypoint + Cmd, as Docker runs them without an init.
    assert (res.exit_code, res.stdout) == (0, b"in")
    assert (shared_dir / "entry").exists() and (shared_dir / "ran").exists()


def test_image_facts_cache_expires_and_stays_bounded() -> None:
    facts = _ImageFacts(volumes=(), entrypoint=())
    cache = _ImageFactsCache(ttl_s=0.2, max_entries=2)
    cache.put("a", facts)
    cache.put("b", facts)
    cache.put("c", facts)  # full: the oldest ("a") goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, facts, facts)
    time.sleep(0.25)
    assert cache.get("b") is None


def test_under_runc_a_tool_cannot_write_frames_into_the_inits_stream(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    """Same uid as the init, but the init is not dumpable: /proc/1/fd/1 (its stdout,
    the stream the server reads) stays closed to the tool."""
    spec = make_spec(f"({FORGE_EXIT_0}) 2>/dev/null && echo forged || echo blocked; exit 7")
    res = runner.run(spec, execution_id=eid())
    assert (res.exit_code, res.stdout) == (7, b"blocked\n")


def test_under_gvisor_a_forged_exit_frame_gains_nothing(
    runner: DockerBackend, make_spec: SpecFactory, eid: Eid
) -> None:
    """gVisor does not honour non-dumpable for /proc/1/fd: there a tool can write into
    the init's stream. What it writes claims nothing it could not do itself: a forged
    'exit 0' ends the call as an exit 0 would, and bytes landing inside one of the
    init's frames make its own call fail as a sandbox error. Either way the call ends
    at once and the sandbox goes with it, however long the tool meant to run and write."""
    spec = make_spec(f"echo before; {FORGE_EXIT_0}; while :; do echo after; done", runtime="runsc")
    started = time.monotonic()
    try:
        res = runner.run(spec, execution_id=eid())
    except SandboxError as exc:
        assert "the sandbox init broke its protocol" in str(exc)
    else:
        # (what the init relayed of "before" may come after the forged frame)
        assert res.exit_code == 0 and res.stdout in (b"", b"before\n")
        assert not res.timed_out and not res.output_truncated
    assert time.monotonic() - started < spec.limits.timeout_ms / 1000


def test_an_init_of_another_protocol_is_refused_before_any_call(
    tmp_path: Path, make_spec: SpecFactory, eid: Eid, docker_client: docker.DockerClient
) -> None:
    stale = tmp_path / "stale-init"
    stale.write_text('#!/bin/sh\nexec "$@"\n')  # no hello: speaks no framed protocol
    stale.chmod(0o755)
    backend = DockerBackend(instance_id=f"stale-{eid()}", init_path=stale)
    try:
        with pytest.raises(SandboxError, match=r"rebuild it \(make init\)|did not start"):
            backend.prepare(make_spec("cat"), execution_id=eid())
    finally:
        backend.close()


def test_on_the_host_the_init_signals_nothing_but_its_tool(init_path: str) -> None:
    """Only a container's PID 1 ends the tool's other processes (kill(-1)): run as
    any other process, the init must not reach a bystander of its user."""
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        done = run_init(init_path, GO_BYTE, "sh", "-c", "(sleep 5) & exit 0")
        assert frames(done.stdout)[-1] == (INIT_EXIT, InitExit(0, 0))
        time.sleep(0.2)
        assert bystander.poll() is None  # still running
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_after_its_exit_frame_the_container_waits_for_its_removal_with_the_tool_gone(
    runner: DockerBackend, make_spec: SpecFactory, docker_client: docker.DockerClient,
    runtime: str, eid: Eid,
) -> None:  # fmt: skip
    """The container outlives the answer until the server removes it (its end would
    land on the call's audit fsync), and nothing of the tool runs in it by then: a
    process the tool left behind was killed before the exit frame."""
    spec = make_spec("(sleep 300 &); echo started", runtime=runtime)
    prepared = runner.prepare(spec, execution_id=eid(), lifetime_s=30)
    cid = prepared.container_id
    with after_call.deferred():  # as the executor does: removal after the answer
        result = prepared.finish(b"")
        assert (result.exit_code, result.stdout) == (0, b"started\n")
        state = docker_client.api.inspect_container(cid)["State"]
        assert state["Running"] is True
        if runtime == "runc":  # gVisor's processes are not the host's to list
            deadline = time.monotonic() + 2  # killed before the frame, reaped just after
            while True:
                processes = docker_client.api.top(cid)["Processes"]
                if [p[-1].split()[0] for p in processes] == [INIT_TARGET]:
                    break  # the init alone
                assert time.monotonic() < deadline, processes
                time.sleep(0.05)
    runner.flush()
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(cid)

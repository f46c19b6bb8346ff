"""A warm interpreter's run ends as python3's own would (issue 37): the stub
(sandbox_runner/warm_interpreter.py) skips the interpreter's teardown with
os._exit, after doing what CPython's exit does first. Each case runs the same
`python3 -c CODE` twice in real containers of toolreg/python under the cautious
limits: cold (the interpreter started at release: CPython itself is the
reference) and warm (``prestart: python``: the stub ends the run). Exit code,
stdout and stderr must match byte for byte. stdout is a block-buffered pipe
here (PYTHONUNBUFFERED unset), the case where an exit that forgot to flush
would lose output."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from sandbox_runner import CAUTIOUS_LIMITS, Mount, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend

PYTHON_IMAGE = "toolreg/python"
LIMITS = CAUTIOUS_LIMITS.replace(output_bytes=1 << 20)  # room for the large output case
BUFFERED = (("PYTHONUNBUFFERED", ""),)  # the image sets it; empty means unset to python
Eid = Callable[[], str]
ADDRESS = re.compile(r"0x[0-9a-f]+")

CASES: dict[str, tuple[str, int]] = {
    # name: (code, the exit code python3 gives, checked too so a case cannot pass vacuously)
    "no_trailing_newline": ("import sys; sys.stdout.write('partial'); sys.stderr.write('err')", 0),
    "large_buffered_output": ("for i in range(40000): print(i, end=' ')", 0),
    "atexit_order_and_a_failing_handler": (
        "import atexit, sys\n"
        "atexit.register(print, 'first registered, last run', end='')\n"
        "def boom(): raise ValueError('in a handler')\n"
        "atexit.register(boom)\n"
        "atexit.register(print, 'last registered, first run')\n"
        "atexit.register(sys.exit, 7)  # ignored: a handler cannot change the code\n"
        "print('main')",
        0,
    ),
    "output_written_in_atexit": (
        "import atexit, sys\n"
        "atexit.register(sys.stdout.write, 'bye, no newline')\n"
        "atexit.register(sys.stderr.write, 'err from atexit')\n"
        "sys.stdout.write('x' * 5000)",
        0,
    ),
    "exit_code": ("print('out'); raise SystemExit(3)", 3),
    "exit_code_wraps": ("import sys; sys.exit(300)", 44),
    "exit_code_negative": ("import sys; sys.exit(-1)", 255),
    "exit_code_beyond_c_long": ("import sys; sys.exit(2 ** 70)", 255),
    "exit_true": ("import sys; sys.exit(True)", 1),
    "sys_exit_no_argument": ("import sys; print('done', end=''); sys.exit()", 0),
    "sys_exit_none": ("raise SystemExit(None)", 0),
    "sys_exit_message": ("import sys; print('before'); sys.exit('fatal: no input')", 1),
    "sys_exit_tuple": ("raise SystemExit('a', 2)", 1),
    "sys_exit_in_a_function": ("import sys\ndef f():\n    sys.exit(5)\nf()", 5),
    "uncaught_exception_traceback": (
        "import atexit\n"
        "atexit.register(print, 'atexit after the traceback')\n"
        "def inner():\n    return {}['missing']\n"
        "def outer():\n    inner()\n"
        "print('before', end='')\n"
        "outer()",
        1,
    ),
    "chained_exception": (
        "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    raise RuntimeError('wrapped') from e",
        1,
    ),
    "keyboard_interrupt": (
        "import atexit\natexit.register(print, 'atexit runs')\nraise KeyboardInterrupt",
        130,  # killed by SIGINT after the exit steps, as CPython does (128 + 2)
    ),
    "keyboard_interrupt_subclass": ("class K(KeyboardInterrupt): pass\nraise K('x')", 1),
    "non_daemon_thread_joined_before_atexit": (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit, after the thread')\n"
        "def work():\n    time.sleep(0.3)\n    print('thread done')\n"
        "threading.Thread(target=work).start()\n"
        "print('main done')",
        0,
    ),
    "daemon_thread_not_waited_for": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('main done')",
        0,
    ),
    "stdout_closed_by_the_tool": ("import sys; print('x'); sys.stdout.close()", 0),
    "stdout_flush_fails_at_exit": ("import os; print('lost'); os.close(1)", 120),
    "excepthook_replaced": (
        "import sys\n"
        "sys.excepthook = lambda t, v, tb: print('hooked', t.__name__, v, file=sys.stderr)\n"
        "raise OSError('x')",
        1,
    ),
    "main_namespace": (
        "import sys\n"
        "print(sys.argv, __name__, sorted(globals()), sys.path[0], globals().get('__file__'))",
        0,
    ),
    "streams_swapped": (
        "import io, sys\nsys.__stdout__.write('to the real stdout')\nsys.stdout = io.StringIO()\n"
        "print('into the StringIO')",
        0,
    ),
}


@pytest.fixture(scope="module")
def image() -> str:
    client = docker.from_env()
    try:
        client.images.get(PYTHON_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{PYTHON_IMAGE} is missing: bash sandbox_runner/images/build.sh")
    finally:
        client.close()
    return PYTHON_IMAGE


def spec(
    image: str, code: str, prestart: str, env: tuple[tuple[str, str], ...],
    command: tuple[str, ...] = (), mounts: tuple[Mount, ...] = (),
) -> SandboxSpec:  # fmt: skip
    return SandboxSpec(
        image=image, command=command or ("python3", "-c", code), env=env, limits=LIMITS,
        input=b"", prestart=prestart, mounts=mounts,
    )  # fmt: skip


def outcome(runner: DockerBackend, eid: Eid, s: SandboxSpec) -> tuple[int | None, str, str]:
    """Exit code, stdout, stderr; objects' addresses (reprs) differ between runs."""
    res = runner.run(s, execution_id=eid())
    assert not res.killed, res
    err = ADDRESS.sub("0x?", res.stderr.decode())
    return res.exit_code, res.stdout.decode(), err


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_warm_run_ends_as_python3_does(
    runner: DockerBackend, eid: Eid, image: str, name: str
) -> None:
    code, expected_exit = CASES[name]
    cold = outcome(runner, eid, spec(image, code, "", BUFFERED))
    warm = outcome(runner, eid, spec(image, code, "python", BUFFERED))
    assert cold[0] == expected_exit, cold  # the reference is what the case says it is
    assert warm == cold


def test_the_semantics_hold_with_the_image_default_unbuffered_streams(
    runner: DockerBackend, eid: Eid, image: str
) -> None:
    code, _ = CASES["output_written_in_atexit"]
    cold = outcome(runner, eid, spec(image, code, "", ()))
    warm = outcome(runner, eid, spec(image, code, "python", ()))
    assert warm == cold == (0, "x" * 5000 + "bye, no newline", "err from atexit")


def test_output_order_of_thread_and_atexit(runner: DockerBackend, eid: Eid, image: str) -> None:
    """Spelled out, beside the comparison: the non-daemon thread is joined first."""
    code, _ = CASES["non_daemon_thread_joined_before_atexit"]
    warm = outcome(runner, eid, spec(image, code, "python", BUFFERED))
    assert warm == (0, "main done\nthread done\natexit, after the thread\n", "")
    code, _ = CASES["atexit_order_and_a_failing_handler"]
    exit_code, out, err = outcome(runner, eid, spec(image, code, "python", BUFFERED))
    assert exit_code == 0
    assert out == "main\nlast registered, first run\nfirst registered, last run"
    assert "ValueError: in a handler" in err and "Exception ignored in atexit callback" in err


@pytest.mark.parametrize("mode", ["script", "module"])
@pytest.mark.parametrize(
    "name",
    ["keyboard_interrupt", "sys_exit_message", "uncaught_exception_traceback",
     "output_written_in_atexit", "non_daemon_thread_joined_before_atexit", "main_namespace"],
)  # fmt: skip
def test_a_warm_script_or_module_ends_as_python3_does(
    runner: DockerBackend, eid: Eid, image: str, tmp_path: Path, mode: str, name: str
) -> None:
    """The same ending for `python3 SCRIPT` and `python3 -m MODULE` (runpy's frames
    included in a traceback, as python3 -m shows them)."""
    code, expected_exit = CASES[name]
    (tmp_path / "case.py").write_text(code)
    tmp_path.chmod(0o755)  # the sandbox's uid reads it
    (tmp_path / "case.py").chmod(0o644)
    mounts = (Mount(str(tmp_path), "/case"),)
    command = ("python3", "/case/case.py") if mode == "script" else ("python3", "-m", "case")
    env = (*BUFFERED, ("PYTHONPATH", "/case"))
    cold = outcome(runner, eid, spec(image, "", "", env, command, mounts))
    warm = outcome(runner, eid, spec(image, "", "python", env, command, mounts))
    assert cold[0] == expected_exit, cold
    assert warm == cold


def test_a_warm_missing_module_fails_as_python3_m_does(
    runner: DockerBackend, eid: Eid, image: str
) -> None:
    command = ("python3", "-m", "no_such_module_here")
    cold = outcome(runner, eid, spec(image, "", "", BUFFERED, command))
    warm = outcome(runner, eid, spec(image, "", "python", BUFFERED, command))
    assert cold == (1, "", "/usr/bin/python3: No module named no_such_module_here\n")
    assert warm == cold

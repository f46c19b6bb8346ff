"""Warm interpreters (``prestart: python``) against the real engine and a real
server: the interpreter is started and has its preloads before the call, reads
nothing and runs nothing of the tool until released, serves one call only;
run_python (the example, as shipped) answers warm as it does cold; a failing
preload says which module; a dangerous tool is never pre-started."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.integration.conftest import Running, start_running
from tests.security.conftest import containers_of, execute, wait_until_gone

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
WAIT_FOR_POOL_S = 30.0  # seconds a pool may take to fill on this machine
HELD_S = 1.0  # seconds a warm container is left waiting before its call

# The tool's code: what it finds when released. /proc/self/stat's field 22 is
# the process' start in clock ticks after boot: its age tells that the
# interpreter was started before the call, not at release.
PROBE = r"""
import os, sys
ticks = os.sysconf('SC_CLK_TCK')
start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / ticks
age = float(open('/proc/uptime').read().split()[0]) - start
import builtins
print(json.dumps({
    'preloaded': 'json' in sys.modules and 'decimal' in sys.modules,
    'age_s': age,
    'seen_before': os.path.exists('/tmp/marker') or hasattr(builtins, 'marker'),
    'input': sys.stdin.read(),
    'argv': sys.argv,
    'name': __name__,
}))
open('/tmp/marker', 'w').close()
builtins.marker = True
"""


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="module")
def running(
    tmp_path_factory: pytest.TempPathFactory, engine: docker.DockerClient
) -> Iterator[Running]:
    server = start_running(tmp_path_factory.mktemp("warm-interp"), max_warm=8, warm_max_age_s=120)
    yield server
    server.stop()
    assert wait_until_gone(engine, server) == [], "containers left behind"


def register(running: Running, manifest: dict[str, Any]) -> None:
    tool = convert.tool_to_pb(parse_definition(manifest))
    running.stub.RegisterTool(pb.RegisterToolRequest(tool=tool, replace=True))


def python_tool(name: str, code: str, pool: int, preload: list[str], **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"test {name}",
        "parameters": {"type": "object"},
        "safety_level": more.pop("level", "cautious"),
        "warm_pool": pool,
        "sandbox": {
            "image": "toolreg/python",
            "command": ["python3", "-c", code, "first", "second"],
            "prestart": "python",
            "preload": preload,
            **more,
        },
    }


def warm_count(running: Running, name: str) -> int:
    assert running.app.pools is not None
    return running.app.pools.stats().warm.get(name, 0)


def wait_warm(running: Running, name: str, count: int = 1) -> None:
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while warm_count(running, name) < count:
        assert time.monotonic() < deadline, f"pool of {name} never reached {count}"
        time.sleep(0.05)


def held_container(engine: docker.DockerClient, running: Running, marker: str) -> str:
    """The one warm container whose command carries ``marker`` (the tool's code)."""
    found = [
        cid
        for cid in containers_of(engine, running)
        if any(marker in arg for arg in engine.api.inspect_container(cid)["Config"]["Cmd"] or [])
    ]
    assert len(found) == 1, found
    return found[0]


def processes_and_tmp(engine: docker.DockerClient, container_id: str) -> dict[str, Any]:
    """What runs in the container (each process' argv) and what is in its /tmp,
    seen from a process the engine adds (the tool's own sees nothing of it)."""
    look = (
        "import json, os\n"
        "procs = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n"
        "            procs[p] = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[:-1]\n"
        "        except OSError:\n"
        "            pass\n"
        "print(json.dumps({'procs': {k: [a.decode() for a in v] for k, v in procs.items()},"
        " 'tmp': os.listdir('/tmp')}))\n"
    )
    exec_id = engine.api.exec_create(container_id, ["python3", "-c", look])["Id"]
    seen: dict[str, Any] = json.loads(engine.api.exec_start(exec_id))
    return seen


def test_held_interpreter_preloaded_reads_nothing_and_serves_one_call(
    running: Running, engine: docker.DockerClient
) -> None:
    code = "import json\n" + PROBE
    register(running, python_tool("warm_probe", code, 1, ["json", "decimal"]))
    assert running.app.pools is not None
    hits = running.app.pools.stats().hits
    used = []
    for i in range(2):
        wait_warm(running, "warm_probe")
        time.sleep(HELD_S)
        held = held_container(engine, running, "builtins.marker")
        if i == 0:
            seen = processes_and_tmp(engine, held)
            # Held: PID 1 is the init, its only child the interpreter running
            # toolreg's stub, not yet the tool's code (which would leave a marker).
            assert seen["procs"]["1"][:2] == ["/.toolreg/init", "--prestart"]
            children = [argv for pid, argv in seen["procs"].items() if pid != "1"]
            assert len(children) == 1 and children[0][:2] == ["python3", "-c"], children
            assert children[0][3:6] == ["json,decimal", "code", code]
            assert seen["tmp"] == []
        result = execute(running, "warm_probe", json.dumps({"i": i}))
        assert result.success, result.error
        answer = json.loads(result.content)
        assert answer["preloaded"] is True
        assert answer["age_s"] >= HELD_S * 0.8, answer  # started before its call
        assert answer["input"] == json.dumps({"i": i}, separators=(",", ":"))  # all of it
        assert answer["argv"] == ["-c", "first", "second"] and answer["name"] == "__main__"
        assert answer["seen_before"] is False  # nothing of another call reached it
        assert _gone_soon(engine, running, held), "the used container was not removed"
        used.append(held)
    assert used[0] != used[1]
    assert running.app.pools.stats().hits - hits == 2  # both calls were warm


def _gone_soon(engine: docker.DockerClient, running: Running, container_id: str) -> bool:
    deadline = time.monotonic() + 15
    while container_id in containers_of(engine, running):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_missing_preload_fails_with_its_module_named(running: Running) -> None:
    register(running, python_tool("warm_nope", "print(1)", 1, ["json", "nope_not_here"]))
    cold = python_tool("cold_nope", "print(1)", 0, ["nope_not_here"])
    register(running, cold)
    for name in ("warm_nope", "cold_nope"):
        result = execute(running, name)
        assert result.status == pb.EXECUTION_STATUS_SANDBOX_ERROR, result
        assert "prestart: preload 'nope_not_here' failed: No module named 'nope_not_here'" in (
            result.error
        )
    pools = running.app.pools
    assert pools is not None
    # The pool's worker tries in the background (after calls, which go first):
    # its failure may be counted after the calls above have answered. The count is
    # every pool's (the module's other pools refill beside it): wait for this pool's.
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while not pools._pools["warm_nope"].last_failure:
        assert time.monotonic() < deadline, "the failing pool never counted a failure"
        time.sleep(0.05)
    assert "nope_not_here" in pools._pools["warm_nope"].last_failure
    assert pools.stats().refill_failures >= 1
    assert warm_count(running, "warm_nope") == 0  # its pool fails, never a held container


def test_a_dangerous_tool_cannot_be_prestarted(running: Running) -> None:
    # Built as a cautious tool, sent as a dangerous one: the server must refuse it.
    tool = convert.tool_to_pb(parse_definition(python_tool("risky_warm", "print(1)", 1, [])))
    tool.safety_level = pb.SAFETY_LEVEL_DANGEROUS
    with pytest.raises(grpc.RpcError) as caught:
        running.stub.RegisterTool(pb.RegisterToolRequest(tool=tool))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not for dangerous tools" in (caught.value.details() or "")


def run_python(pool: int, output_bytes: int = 0) -> dict[str, Any]:
    manifest = yaml.safe_load((EXAMPLES / "run_python.yaml").read_text())
    manifest = copy.deepcopy(manifest)
    manifest["name"] = f"run_python_{'warm' if pool else 'cold'}"
    manifest["warm_pool"] = pool
    if output_bytes:
        manifest["sandbox"]["limits"] = {"output_bytes": output_bytes}
    return manifest


CASES: list[tuple[dict[str, Any], int, str, str]] = [
    # (arguments, exit code, in stdout, in stderr)
    ({"code": "import sys; print(sys.stdin.read()[::-1], sys.argv, __name__)", "stdin": "abc"},
     0, "cba ['-c'] __main__", ""),
    ({"code": "import sys; print('no stdin', repr(sys.stdin.read()))"}, 0, "no stdin ''", ""),
    ({"code": "print('partial'); raise SystemExit(3)"}, 3, "partial", ""),
    ({"code": "import sys; sys.exit('bye')"}, 1, "", "bye"),
    ({"code": "def f():\n    raise ValueError('boom')\nf()"}, 1, "",
     'File "<code>", line 2, in f\nValueError: boom'),
    ({"code": "x = ("}, 1, "", "SyntaxError"),
    ({"code": "import os; print(globals().keys() - {'os'} == {'__name__', '__doc__',"
     " '__package__', '__loader__', '__spec__', '__builtins__'}, os.getcwd())"}, 0, "True /tmp", ""),
]  # fmt: skip


def test_run_python_cold_and_warm_answer_alike(running: Running) -> None:
    register(running, run_python(0))
    register(running, run_python(1, output_bytes=4096))
    for args, code, out, err in CASES:
        for name in ("run_python_cold", "run_python_warm"):
            if name.endswith("warm"):
                wait_warm(running, name)
            result = execute(running, name, json.dumps(args))
            assert result.exit_code == code, (name, args, result)
            assert result.success == (code == 0), (name, result.error)
            assert out in result.content and err in result.stderr, (name, args, result)
            assert "run_python.py" not in result.stderr  # no frames of the tool's own
    # Output past the cap: stopped and cut, warm as cold.
    wait_warm(running, "run_python_warm")
    result = execute(running, "run_python_warm", json.dumps({"code": "print('x' * 100000)"}))
    assert result.status == pb.EXECUTION_STATUS_RESOURCE_EXHAUSTED and result.output_truncated
    assert len(result.content) <= 4096

"""Warm interpreters (issue 30, item 1; issue 37, item 3): the `run_python`
example as shipped (``prestart: python``, cautious) against two `cat` tools,
warm and cold, interleaved in one run on one server (runc: safe and cautious
tools run nowhere else): a SAFE `cat` on toolreg/base, the fair baseline (the
cheapest tool a registry runs: no interpreter, no tight limits), and a cautious
`cat` on toolreg/python (the same image and limits as run_python: what the
interpreter itself costs). Then the same pair under gVisor (runsc) through the
runner in process, since the server never gives runsc to a tool that may
prestart (a dangerous tool is never pre-started): warm = the released call of a
container prepared ahead, cold = prepare and call.

Runs alone: ``python -m bench --only interpreter [--runs N]``."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import yaml

from bench.common import RPC_TIMEOUT_S, Server, server, summary
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from sandbox_runner import SandboxSpec
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.profiles import GVISOR, profile_for
from sandbox_runner.spec import INIT_BINARY

IMAGE = "toolreg/python"
SAFE_IMAGE = "toolreg/base"  # the safe cat's: the fair baseline (issue 37)
TARGET = 1.5  # run_python warm p50 / cat warm p50, against each baseline (issues 30, 37)
WARM_POOL = 2  # warm containers per warm tool
SETTLE_TIMEOUT_S = 10.0  # seconds for a pool to refill between rounds
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tools" / "run_python.yaml"
CODE_ARGS = {"code": 'print(\'{"message":"hello"}\')'}  # prints what cat echoes
CAT_ARGS = {"message": "hello"}
EXPECTED = '{"message":"hello"}'

SAFE_CAT_WARM = f"safe cat on {SAFE_IMAGE} warm_pool={WARM_POOL}"
CAT_WARM = f"cat warm_pool={WARM_POOL}"
PY_WARM = f"run_python warm_pool={WARM_POOL}"
CAT_COLD = "cat cold"
PY_COLD = "run_python cold"
GV_CAT_WARM = "runsc runner: cat warm"
# The target's two ratios (bench/report.py reads them by these names).
RATIO_SAFE = f"run_python warm / safe cat warm on {SAFE_IMAGE}"
RATIO_SAME_IMAGE = f"run_python warm / cautious cat warm on {IMAGE}"
GV_PY_WARM = "runsc runner: run_python warm"
GV_CAT_COLD = "runsc runner: cat cold"
GV_PY_COLD = "runsc runner: run_python cold"


def _manifest(name: str, warm_pool: int, python: bool, safe: bool = False) -> pb.Tool:
    if python:
        raw = yaml.safe_load(EXAMPLE.read_text())
    else:
        raw = {
            "name": name, "description": "cat",
            "parameters": {"type": "object"},
            "safety_level": "safe" if safe else "cautious",
            "sandbox": {"image": SAFE_IMAGE if safe else IMAGE, "command": ["cat"]},
        }  # fmt: skip
    raw.update(name=name, warm_pool=warm_pool)
    return convert.tool_to_pb(parse_definition(raw))


def _server_calls(srv: Server) -> dict[str, tuple[Callable[[], str], Callable[[], None]]]:
    tools = {
        SAFE_CAT_WARM: ("bench_safe_cat_warm", False, WARM_POOL, CAT_ARGS, True),
        CAT_WARM: ("bench_cat_warm", False, WARM_POOL, CAT_ARGS, False),
        PY_WARM: ("bench_run_python_warm", True, WARM_POOL, CODE_ARGS, False),
        CAT_COLD: ("bench_cat_cold", False, 0, CAT_ARGS, False),
        PY_COLD: ("bench_run_python_cold", True, 0, CODE_ARGS, False),
    }
    calls: dict[str, tuple[Callable[[], str], Callable[[], None]]] = {}
    for row, (name, python, pool, args, safe) in tools.items():
        srv.register(_manifest(name, pool, python, safe))
        request = pb.ExecuteToolRequest(name=name, arguments_json=json.dumps(args))

        def call(request: pb.ExecuteToolRequest = request) -> str:
            result = srv.stub.ExecuteTool(request, timeout=RPC_TIMEOUT_S)
            if not result.success:
                raise RuntimeError(f"{request.name}: {result.error}")
            return str(result.content)

        calls[row] = (call, lambda: None)
    return calls


def _runsc_calls(runner: DockerBackend) -> dict[str, tuple[Callable[[], str], Callable[[], None]]]:
    """Under gVisor, in process: the warm rows time only the released call (the
    container was prepared before, untimed), the cold rows prepare and call."""
    limits = profile_for("cautious")
    py = parse_definition(yaml.safe_load(EXAMPLE.read_text())).sandbox
    specs = {
        "cat": SandboxSpec(IMAGE, ("cat",), (), limits, runtime=GVISOR),
        "py": SandboxSpec(IMAGE, py.command, (), limits, runtime=GVISOR,
                          prestart=py.prestart, preload=py.preload),
    }  # fmt: skip
    inputs = {"cat": EXPECTED.encode(), "py": json.dumps(CODE_ARGS).encode()}
    held: dict[str, Any] = {}

    def prepare(kind: str) -> Any:
        # The last call's container goes first, untimed: the server's rows wait for
        # their pool's refill and removal alike (settle_after_call).
        runner.flush()
        return runner.prepare(specs[kind], execution_id=uuid.uuid4().hex)

    def warm(kind: str) -> tuple[Callable[[], str], Callable[[], None]]:
        def before() -> None:
            held[kind] = prepare(kind)

        def call() -> str:
            return str(held.pop(kind).finish(inputs[kind]).stdout.decode())

        return call, before

    def cold(kind: str) -> tuple[Callable[[], str], Callable[[], None]]:
        return (lambda: str(prepare(kind).finish(inputs[kind]).stdout.decode())), runner.flush

    return {
        GV_CAT_WARM: warm("cat"), GV_PY_WARM: warm("py"),
        GV_CAT_COLD: cold("cat"), GV_PY_COLD: cold("py"),
    }  # fmt: skip


def run(runs: int, engine: docker.DockerClient) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    unavailable: dict[str, str] = {}
    with server(engine) as srv:
        calls = _server_calls(srv)
        steady = srv.steady_count()
        # Removal in the background, after the answer, as in the server (in process and
        # outside a call, finish() would remove the container inside the timed call).
        runner = DockerBackend(instance_id=f"bench-interp-{uuid.uuid4().hex[:8]}",
                               init_path=INIT_BINARY, remove_in_background=True)  # fmt: skip
        if GVISOR in runner.runtimes():
            calls.update(_runsc_calls(runner))
        else:
            unavailable["runsc rows"] = "the engine has no runsc runtime"
        try:
            for name, (call, before) in calls.items():  # warm-up proves the answer
                before()
                out = call()
                if out.strip() != EXPECTED:
                    raise RuntimeError(f"{name} returned {out[:200]!r}")
            srv.settle_after_call(steady, SETTLE_TIMEOUT_S)
            for i in range(runs):  # interleaved: noise hits every row alike
                for name, (call, before) in calls.items():
                    before()
                    t0 = time.perf_counter()
                    call()
                    samples.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
                    srv.settle_after_call(steady, SETTLE_TIMEOUT_S)  # refills land nowhere
                if i % 10 == 9:
                    print(f"interpreter: {i + 1}/{runs} rounds", flush=True)
        finally:
            runner.close()
    rows = [{"method": name, "runs": len(v), **summary(v)} for name, v in samples.items()]

    def ratio(a: str, b: str) -> float | None:
        if a in samples and b in samples:
            return round(statistics.median(samples[a]) / statistics.median(samples[b]), 3)
        return None

    return {
        "runs": runs,
        "image": IMAGE,
        "rows": rows,
        "ratios_p50": {
            RATIO_SAFE: ratio(PY_WARM, SAFE_CAT_WARM),
            RATIO_SAME_IMAGE: ratio(PY_WARM, CAT_WARM),
            "run_python cold / cat cold": ratio(PY_COLD, CAT_COLD),
            "runsc: run_python warm / cat warm": ratio(GV_PY_WARM, GV_CAT_WARM),
            "runsc: run_python cold / cat cold": ratio(GV_PY_COLD, GV_CAT_COLD),
        },
        "target": f"run_python warm / each warm cat <= {TARGET} (issues 30, 37)",
        "unavailable": unavailable,
    }


def report_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Warm interpreters: run_python (the example, prestart, cautious) beside a safe cat"
        f" on {SAFE_IMAGE} and a cautious cat on {sec['image']}"
        f" ({sec['runs']} interleaved calls per row)",
        "",
        "| row | p50 ms | p95 ms | min ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['method']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['min_ms']:.1f}"
            f" | {r['max_ms']:.1f} |"
        )
    lines += ["", "| ratio of p50s | value |", "|---|---:|"]
    for name, value in sec["ratios_p50"].items():
        lines.append(f"| {name} | {'—' if value is None else f'{value:.2f}'} |")
    lines += [f"- {k}: {v}" for k, v in sec.get("unavailable", {}).items()]
    return lines

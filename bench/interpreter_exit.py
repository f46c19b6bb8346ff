"""How a warm run_python call ends, phase by phase (issue 37): from the tool's
last write to the server reading the exit frame, through DockerBackend (no
server), under the cautious limits on runc, with the timing build of the init
(bench/handoff.py's).

Four rows, interleaved round by round: the `run_python` example warm as shipped
(the stub leaves with os._exit after python3's exit steps); the same stub with
its exit handler left out, so the interpreter's whole shutdown runs (what warm
calls did before issue 37); a cautious `cat` on toolreg/python and a safe `cat`
on toolreg/base. The tool's code prints time.time_ns() as its only, last
write; the stub variant used here also stamps when SystemExit reached it and
when it is about to call os._exit (on stderr). Phases are medians of the times
from the go byte's send, in ms; for cat the last write is its first output
frame.

Runs alone: ``python -m bench.interpreter_exit [--runs N] [--json PATH]``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import sandbox_runner.warm_interpreter as wi
from bench.common import BENCH_LABEL, Unavailable, standalone
from bench.handoff import TIMING_LINE, timing_init
from registry_server.domain.models import parse_definition
from sandbox_runner import SandboxSpec
from sandbox_runner.docker_backend import EXIT_FRAME, GO_SENT, DockerBackend
from sandbox_runner.profiles import profile_for

RUNS = 30  # calls per row
SETTLE_S = 0.3  # seconds a prepared container sits before its call (its start settles)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tools" / "run_python.yaml"
CODE = {"code": "import time\nprint(time.time_ns() // 1000, end='')"}
CAT_INPUT = b'{"message":"hello"}'
HANDLER = "atexit.register(_end)\n"
EXIT_CALL = "    _os_exit(status)\n"
CAUGHT = "    _status = _exit_status(_e)\n"
STAMP = "    os.write(2, b'%s=%%d\\n' %% (time.time_ns() // 1000))\n"
STAMPS = re.compile(rb"(systemexit|pre_exit)=(\d+)")

PY = "run_python warm (os._exit after the exit steps)"
PY_FULL = "run_python warm, full interpreter shutdown (before)"
CAT = "cat warm, cautious, toolreg/python"
SAFE_CAT = "cat warm, safe, toolreg/base"
# (name, where it comes from), in the order they happen.
PHASES = (
    ("go_read", "go"),
    ("last_write", "last_write"),
    ("systemexit_in_stub", "systemexit"),
    ("exit_steps_done", "pre_exit"),
    ("pipes_eof", "eof"),
    ("reaped", "reaped"),
    ("exit_frame_sent", "exit"),
    ("exit_frame_read", EXIT_FRAME),
)


def _stub(full_shutdown: bool) -> str:
    """The shipped stub with stamps, or without its exit handler."""
    src = wi.STUB_SOURCE
    for marker in (HANDLER, EXIT_CALL, CAUGHT):
        if marker not in src:
            raise RuntimeError(f"the stub changed: {marker.strip()!r} not found")
    if full_shutdown:
        return src.replace(HANDLER, "")
    src = src.replace(EXIT_CALL, STAMP % "pre_exit" + EXIT_CALL)
    return src.replace(CAUGHT, CAUGHT + STAMP % "systemexit")


def _specs() -> dict[str, tuple[SandboxSpec, bytes, str | None]]:
    py = parse_definition(yaml.safe_load(EXAMPLE.read_text())).sandbox
    cautious = profile_for("cautious")
    run_python = SandboxSpec("toolreg/python", py.command, (), cautious,
                             prestart=py.prestart, preload=py.preload)  # fmt: skip
    code = json.dumps(CODE).encode()
    return {
        PY: (run_python, code, _stub(False)),
        PY_FULL: (run_python, code, _stub(True)),
        CAT: (SandboxSpec("toolreg/python", ("cat",), (), cautious), CAT_INPUT, None),
        SAFE_CAT: (SandboxSpec("toolreg/base", ("cat",), (), profile_for("safe")), CAT_INPUT, None),
    }


def _one(
    backend: DockerBackend, spec: SandboxSpec, payload: bytes, stub: str | None
) -> dict[str, float]:
    shipped = wi.STUB_SOURCE
    try:
        if stub is not None:  # stub_command reads it when the container is created
            setattr(wi, "STUB_SOURCE", stub)  # noqa: B010 (a Final, replaced for this bench)
        prepared = backend.prepare(spec, execution_id=uuid.uuid4().hex)
    finally:
        setattr(wi, "STUB_SOURCE", shipped)  # noqa: B010
    time.sleep(SETTLE_S)
    offset = time.time() - time.monotonic()
    res = prepared.finish(payload)
    backend.flush()  # its removal is not the next call's noise
    if res.exit_code != 0:
        raise RuntimeError(f"exit {res.exit_code}: {res.stdout[:200]!r} {res.stderr[:500]!r}")
    found = TIMING_LINE.search(res.stderr)
    if found is None:
        raise RuntimeError("no timing line: is the init the timing build?")
    stamps = {k.decode(): int(v) / 1e6 - offset
              for k, v in re.findall(rb"(\w+)=(\d+)", found.group(1)) if int(v)}  # fmt: skip
    stamps.update((k.decode(), int(v) / 1e6 - offset) for k, v in STAMPS.findall(res.stderr))
    stamps["last_write"] = int(res.stdout) / 1e6 - offset if stub is not None else stamps["out1"]
    stamps.setdefault("eof", stamps["reaped"])  # SIGCHLD seen first: EOF came with it
    stamps[EXIT_FRAME] = prepared.marks[EXIT_FRAME]
    sent = prepared.marks[GO_SENT]
    return {name: (stamps[src] - sent) * 1000 for name, src in PHASES if src in stamps}


def run(runs: int = RUNS) -> dict[str, Any]:
    specs = _specs()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in specs}
    with timing_init() as init:
        if init is None:
            raise Unavailable("the timing build of the init needs gcc with a static libc")
        instance = f"interp-exit-{uuid.uuid4().hex[:8]}"
        backend = DockerBackend(instance_id=instance, init_path=init, remove_in_background=True,
                                extra_labels={BENCH_LABEL: instance})  # fmt: skip
        try:
            for i in range(runs + 1):  # the first round warms up, unmeasured
                for name, (spec, payload, stub) in specs.items():
                    phases = _one(backend, spec, payload, stub)
                    if i:
                        rows[name].append(phases)
        finally:
            backend.close()
    return {"runs": runs, "rows": {name: _medians(r) for name, r in rows.items()}}


def _medians(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {}
    for name, _ in PHASES:
        values = [r[name] for r in rows if name in r]
        if values:
            out[name] = round(statistics.median(values), 2)
    tail = [r["exit_frame_read"] - r["last_write"] for r in rows]
    out["last_write_to_exit_frame_read"] = round(statistics.median(tail), 2)
    return out


def report_md(sec: Mapping[str, Any]) -> list[str]:
    names = list(sec["rows"])
    lines = [
        "",
        "## How a warm run_python call ends, phase by phase (DockerBackend, runc, no server)",
        "",
        f"{sec['runs']} interleaved calls per row; ms from the go byte's send, medians.",
        "",
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for phase in [p for p, _ in PHASES] + ["last_write_to_exit_frame_read"]:
        cells = [sec["rows"][n].get(phase) for n in names]
        if any(c is not None for c in cells):
            shown = ["" if c is None else f"{c:.2f}" for c in cells]
            lines.append(f"| {phase} | " + " | ".join(shown) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    standalone(
        "python -m bench.interpreter_exit",
        __doc__,
        run,
        report_md,
        runs=RUNS,
        runs_help="calls per row",
        argv=argv,
    )


if __name__ == "__main__":
    main()

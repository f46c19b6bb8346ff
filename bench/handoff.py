"""The warm hand-off, phase by phase, under runc and runsc: a container started
ahead of its call (the init holding the tool) is handed its call through
DockerBackend directly, no server: ``Prepared.finish`` sends the go byte, the
input's length and the input; the init execs the tool (its process was forked
while it waited), writes the input into the tool's stdin pipe and closes it,
relays the tool's output as frames and sends the exit frame.

Each round prepares, for each runtime, one container with the production init
(its ``finish`` is timed whole: the p50) and one with a timing build of the
same source (``-DTOOLREG_INIT_TIMING``: it sends the times of its steps as a
stderr frame before the exit frame), then hands them their calls one at a
time, with nothing else of the bench running; rounds alternate the runtimes so
machine noise hits both alike. Each phase is the median over the timing runs
of its time from the go byte's send:

- ``go_read``: the held process read the go byte (the input's way in);
- ``input_closed``: the init wrote the whole input and closed the tool's stdin;
- ``exec``: its execve succeeded (the init sees its report pipe close);
- ``first_output_sent``: the init wrote the tool's first output frame;
- ``first_output``: the server read that frame;
- ``reaped``: the init reaped the tool (its exit and SIGCHLD);
- ``exit_frame``: the server read the exit frame, the call's answer.

In-container times are CLOCK_REALTIME (gVisor's monotonic clock starts at its
sandbox's start), so a runsc phase that crosses the sandbox's edge carries the
sentry's clock error (well under a millisecond here). The timing build needs
gcc with a static libc (as ``make init``); without it the in-container phases
are left out.

Runs alone: ``python -m bench.handoff [--runs N] [--json PATH]``.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import BENCH_LABEL, IMAGE, PAYLOAD, Unavailable, standalone, summary
from sandbox_runner import SAFE_LIMITS, SandboxSpec
from sandbox_runner.docker_backend import (
    EXIT_FRAME,
    FIRST_OUTPUT,
    GO_SENT,
    DockerBackend,
    Prepared,
)
from sandbox_runner.spec import INIT_BINARY

RUNS = 30  # hand-offs per runtime and init build
RUNTIMES = ("runc", "runsc")
COMMAND = ("cat",)  # the bench's workload (bench.common.COMMAND)
SETTLE_S = 0.2  # seconds prepared containers sit before their calls (their start settles)
INIT_SOURCE = INIT_BINARY.parent / "toolreg_init.c"
# The flags of `make init`, plus the timing build's macro.
TIMING_CFLAGS = ("-std=c11", "-Os", "-static", "-s", "-Wall", "-Wextra", "-Werror")
TIMING_LINE = re.compile(rb"toolreg-init-timing ([^\n]*)\n")
# Phases, in the order they happen: (name, where its time comes from).
PHASES = (
    ("go_read", "go"),
    ("input_closed", "fed"),
    ("exec", "exec"),
    ("first_output_sent", "out1"),
    ("first_output", FIRST_OUTPUT),
    ("reaped", "reaped"),
    ("exit_frame", EXIT_FRAME),
)


@contextmanager
def timing_init() -> Iterator[Path | None]:
    """The init built with -DTOOLREG_INIT_TIMING in a temporary directory (None
    without a compiler that links statically)."""
    cc = shutil.which("gcc")
    if cc is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="toolreg-init-timing-") as tmp:
        out = Path(tmp) / "toolreg-init-timing"
        built = subprocess.run(
            [cc, *TIMING_CFLAGS, "-DTOOLREG_INIT_TIMING", "-o", str(out), str(INIT_SOURCE)],
            capture_output=True,
        )
        if built.returncode != 0:
            yield None
            return
        Path(tmp).chmod(0o755)
        out.chmod(0o755)  # containers run it as uid 65534
        yield out


def _spec(runtime: str) -> SandboxSpec:
    return SandboxSpec(
        image=IMAGE, command=COMMAND, env=(), limits=SAFE_LIMITS, runtime=runtime, input=b""
    )


def _finish(prepared: Prepared) -> tuple[float, bytes, float]:
    """(ms of finish, the tool's stderr, time.time() - time.monotonic() at the send)."""
    offset = time.time() - time.monotonic()
    started = time.perf_counter()
    res = prepared.finish(PAYLOAD)
    ms = (time.perf_counter() - started) * 1000
    if (res.exit_code, res.stdout) != (0, PAYLOAD):
        raise RuntimeError(f"hand-off returned {res.exit_code}: {res.stdout!r} {res.stderr!r}")
    return ms, res.stderr, offset


def _phases(prepared: Prepared, stderr: bytes, offset: float) -> dict[str, float]:
    """ms from the go byte's send to each step of one timing run."""
    marks = prepared.marks
    sent = marks[GO_SENT]
    found = TIMING_LINE.search(stderr)
    stamps = {}
    if found is not None:  # CLOCK_REALTIME microseconds -> our monotonic seconds
        for key, value in re.findall(rb"(\w+)=(\d+)", found.group(1)):
            if int(value):
                stamps[key.decode()] = int(value) / 1e6 - offset
    out = {}
    for name, source in PHASES:
        at = marks.get(source, stamps.get(source))
        if at is not None:
            out[name] = (at - sent) * 1000
    return out


def run(runs: int = RUNS, runtimes: Sequence[str] = RUNTIMES) -> dict[str, Any]:
    """{runtime: {"phases": {phase: p50 ms}, "p50_ms": ..., ...}, "ratio": runsc/runc}.
    Unavailable when the init is not built or the engine lacks one of the runtimes."""
    if not INIT_BINARY.is_file():
        raise Unavailable(f"the sandbox init {INIT_BINARY} is not built (make init)")
    instance = f"handoff-{uuid.uuid4().hex[:8]}"
    labels = {BENCH_LABEL: instance}
    totals: dict[str, list[float]] = {rt: [] for rt in runtimes}
    phases: dict[str, list[dict[str, float]]] = {rt: [] for rt in runtimes}
    with timing_init() as timed_init:
        inits = [INIT_BINARY, *([timed_init] if timed_init else [])]
        backends = [
            DockerBackend(
                instance_id=f"{instance}-{i}",
                init_path=path,
                remove_in_background=True,
                extra_labels=labels,
            )
            for i, path in enumerate(inits)
        ]
        try:
            missing = set(runtimes) - set(backends[0].runtimes())
            if missing:
                raise Unavailable(f"the engine has no {', '.join(sorted(missing))} runtime")
            for _ in range(runs):
                for rt in runtimes:
                    held = [b.prepare(_spec(rt), execution_id=uuid.uuid4().hex) for b in backends]
                    time.sleep(SETTLE_S)
                    for i, prepared in enumerate(held):
                        ms, stderr, offset = _finish(prepared)
                        for b in backends:
                            b.flush()  # its removal is not the next hand-off's noise
                        if i == 0:
                            totals[rt].append(ms)
                        else:
                            phases[rt].append(_phases(prepared, stderr, offset))
        finally:
            for b in backends:
                b.close()
    result: dict[str, Any] = {
        "runs": runs,
        "workload": {"image": IMAGE, "command": list(COMMAND), "input_bytes": len(PAYLOAD)},
        "timing_build": timed_init is not None,
    }
    for rt in runtimes:
        result[rt] = {
            "phases": _medians(phases[rt]),
            **summary(totals[rt]),
        }
    if "runc" in result and "runsc" in result:
        result["ratio"] = round(result["runsc"]["p50_ms"] / result["runc"]["p50_ms"], 2)
    return result


def _medians(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {}
    for name, _ in PHASES:
        values = [r[name] for r in rows if name in r]
        if values:
            out[name] = round(statistics.median(values), 2)
    return out


def report_md(sec: Mapping[str, Any]) -> list[str]:
    """The section as Markdown lines: one column per runtime, phases in ms from
    the go byte's send (medians), then the whole finish() p50."""
    runtimes = [rt for rt in RUNTIMES if rt in sec]
    lines = [
        "",
        "## Warm hand-off, phase by phase (DockerBackend, no server)",
        "",
        f"`{' '.join(COMMAND)}` in `{IMAGE}`, {sec['runs']} hand-offs per runtime;"
        " phases: ms from the go byte's send (medians of the timing build's runs).",
        "",
        "| phase | " + " | ".join(runtimes) + " |",
        "|---|" + "---:|" * len(runtimes),
    ]
    for name, _ in PHASES:
        cells = [sec[rt]["phases"].get(name) for rt in runtimes]
        if any(c is not None for c in cells):
            shown = ["" if c is None else f"{c:.2f}" for c in cells]
            lines.append(f"| {name} | " + " | ".join(shown) + " |")
    totals = [f"**{sec[rt]['p50_ms']:.2f}**" for rt in runtimes]
    lines.append("| **finish() p50** | " + " | ".join(totals) + " |")
    if "ratio" in sec:
        lines += ["", f"runsc / runc (p50 of finish): **{sec['ratio']:.2f}x**"]
    if not sec.get("timing_build"):
        lines += ["", "(no in-container phases: the timing build needs gcc with a static libc)"]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    standalone(
        "python -m bench.handoff",
        __doc__,
        run,
        report_md,
        runs=RUNS,
        runs_help="hand-offs per runtime",
        argv=argv,
    )


if __name__ == "__main__":
    main()

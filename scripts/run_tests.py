"""`make test`'s pytest: the parallel part, then the serial part, then one summary.

1. Every test not marked ``serial`` runs in parallel with pytest-xdist: each worker
   takes whole test files (tests/conftest.py groups them), the slowest tiers first,
   and has its own session fixtures, base temp dir, container run label, ports
   and databases.
2. The ``serial`` tests run alone after it: they stop what every test shares (the
   Docker engine, the tests' PostgreSQL) or measure time under load.

Then it prints what both parts ran (so a lost test shows as a smaller count), the 25
slowest tests of the whole run (so the next slow test is seen), and each part's
wall time. Arguments are passed to both parts (paths, -k, -x; not -m or -n).
Exit status: non-zero when either part failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

WORKERS_DEFAULT = "4"  # workers for the parallel part (TEST_WORKERS); most tests wait on containers
SLOWEST = 25  # tests listed at the end of a run
NO_TESTS = 5  # pytest's exit status when nothing was selected


@dataclass
class Part:
    name: str
    argv: list[str]
    report: Path
    status: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    times: list[tuple[float, str]] = field(default_factory=list)

    def run(self) -> None:
        print(f"\n=== {self.name}: {' '.join(self.argv[1:])}", flush=True)
        began = time.monotonic()
        self.status = subprocess.call([*self.argv, f"--junitxml={self.report}"])
        self.seconds = time.monotonic() - began
        if self.status == NO_TESTS:
            self.status = 0
        if self.report.is_file():
            self._read()

    def _read(self) -> None:
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        for case in ET.parse(self.report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            counts[{"failure": "failed"}.get(outcome, outcome)] += 1
            name = f"{case.get('classname')}::{case.get('name')}"
            self.times.append((float(case.get("time") or 0.0), name))
        self.counts = counts


def _summary(parts: list[Part]) -> str:
    def counted(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "no tests"

    total: dict[str, int] = {}
    for part in parts:
        for kind, n in part.counts.items():
            total[kind] = total.get(kind, 0) + n
    lines = ["", f"=== {SLOWEST} slowest tests (set-up + call + tear-down, seconds)"]
    times = sorted((t for part in parts for t in part.times), reverse=True)[:SLOWEST]
    lines += [f"{seconds:8.1f}  {name}" for seconds, name in times]
    lines.append("=== tests run")
    for part in parts:
        lines.append(f"  {part.name}: {counted(part.counts)} in {part.seconds:.0f} s")
    lines.append(f"  in all: {counted(total)} in {sum(p.seconds for p in parts):.0f} s")
    return "\n".join(lines)


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    workers = os.environ.get("TEST_WORKERS", WORKERS_DEFAULT)
    with tempfile.TemporaryDirectory(prefix="toolreg-test-run-") as tmp:
        parts = [
            Part(
                f"parallel part ({workers} workers)",
                [*pytest, "-n", workers, "--dist", "loadscope", "--no-loadscope-reorder",
                 "-m", "not serial", *args],
                Path(tmp) / "parallel.xml",
            ),
            Part("serial part", [*pytest, "-m", "serial", *args], Path(tmp) / "serial.xml"),
        ]  # fmt: skip
        for part in parts:
            part.run()
        print(_summary(parts), flush=True)
    return next((part.status for part in parts if part.status), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

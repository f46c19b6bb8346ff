"""toolreg benchmarks: latency against the baselines users would pick,
throughput, registry operations with 1,000 tools, memory, what gVisor
costs a call with egress, what the policy's conditions cost a call's
decision (in process), and what audit checkpoints and SIEM export cost a
warm call (with the export's throughput), all in one run on the same image
and command.

Writes bench/results/<timestamp>.{md,json,png} and prints the tables.
`--quick` is a smoke test (few runs, short cells); `--only` picks sections.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import uuid
from datetime import UTC, datetime
from typing import Any

from bench import (
    cluster,
    conditions_cost,
    cpu_share,
    egress_cost,
    export_cost,
    fairness,
    handoff,
    latency,
    memory,
    phases,
    registry_ops,
    report,
    throughput,
    tracing_cost,
    warm_interpreter,
    webhooks,
)
from bench.common import (
    COMMAND,
    IMAGE,
    PAYLOAD,
    RESULTS,
    SERVER_SOURCES,
    Interference,
    engine_client,
    machine,
    package_versions,
    remove_leftovers,
    require_image,
    server,
    source_version,
)

SECTIONS = (
    "latency",
    "phases",
    "handoff",
    "throughput",
    "registry",
    "memory",
    "cluster",
    "tracing",
    "webhooks",
    "fairness",
    "cpu_share",
    "egress",
    "conditions",
    "export",
    "interpreter",
)
PACKAGES = ("epicbox", "llm-sandbox", "docker", "grpcio", "matplotlib")
FULL = {"runs": 50, "warmup": 3, "cell_seconds": 10.0, "read_runs": 200}
QUICK = {"runs": 5, "warmup": 1, "cell_seconds": 2.0, "read_runs": 20}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="few runs, short cells: a smoke test")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only these sections (repeat or comma-separate): {', '.join(SECTIONS)}",
    )
    parser.add_argument("--runs", type=int, help="measured calls per method (latency)")
    parser.add_argument("--warmup", type=int, help="unmeasured calls per method first")
    parser.add_argument("--cell-seconds", type=float, help="seconds per throughput cell")
    parser.add_argument("--read-runs", type=int, help="calls per registry read RPC")
    args = parser.parse_args()
    chosen = [s.strip() for item in args.only or [] for s in item.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen] if chosen else list(SECTIONS)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    run_id = uuid.uuid4().hex[:8]
    when = datetime.now(UTC)
    engine = engine_client(pool=8)
    require_image(engine)
    res: dict[str, Any] = {
        "when": when.isoformat(),
        "machine": machine(),
        "packages": package_versions(PACKAGES),
        "toolreg": source_version(),
        "image": IMAGE,
        "command": " ".join(COMMAND),
        "payload": PAYLOAD.decode(),
        "mode": (
            f"{'quick' if args.quick else 'full'} (runs={args.runs}, warmup={args.warmup},"
            f" cell={args.cell_seconds:g} s, registry reads={args.read_runs})"
        ),
        "sections": args.sections,
        "errors": {},
    }
    started = time.monotonic()

    def section(name: str, fn: Any) -> None:
        print(f"== {name} ({time.monotonic() - started:.0f} s in)", flush=True)
        watch.section = name
        try:
            res[name] = fn()
        except Exception as exc:
            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {exc}"

    res["load_avg_start"] = os.getloadavg()
    watch = Interference(run_id)
    watch.start()
    try:
        if "latency" in args.sections:
            section("latency", lambda: latency.run(args.runs, args.warmup, run_id, engine))
        if "phases" in args.sections:
            section("phases", lambda: phases.run(max(10, args.runs // 2), engine))
        if "handoff" in args.sections:
            section("handoff", lambda: handoff.run(max(10, args.runs // 2)))
        if "throughput" in args.sections:
            section("throughput", lambda: throughput.run(args.cell_seconds, run_id, engine))
        if "registry" in args.sections or "memory" in args.sections:
            _registry_and_memory(args, res, run_id, engine, section)
        if "cluster" in args.sections:
            section("cluster", lambda: cluster.run(args.cell_seconds, args.read_runs))
        if "tracing" in args.sections:
            section("tracing", lambda: tracing_cost.run(args.runs, args.read_runs, engine))
        if "webhooks" in args.sections:
            section("webhooks", webhooks.run)
        if "fairness" in args.sections:
            section("fairness", lambda: fairness.run(max(5, args.runs // 3)))
        if "cpu_share" in args.sections:
            section("cpu_share", lambda: cpu_share.run(2 if args.quick else 5))
        if "egress" in args.sections:
            runs = min(args.runs, egress_cost.RUNS)
            section("egress", lambda: egress_cost.run(runs, run_id, engine))
        if "conditions" in args.sections:
            section("conditions", lambda: conditions_cost.run(args.read_runs))
        if "export" in args.sections:
            records = export_cost.QUICK_RECORDS if args.quick else export_cost.RECORDS
            section("export", lambda: export_cost.run(args.runs, engine, records=records))
        if "interpreter" in args.sections:
            section("interpreter", lambda: warm_interpreter.run(args.runs, engine))
    finally:
        watch.stop()
        res["interference"] = watch.summary()
        res["leftover_bench_containers"] = remove_leftovers(engine, run_id)
        engine.close()
    res["elapsed_s"] = round(time.monotonic() - started, 1)
    sources = list(dict.fromkeys(SERVER_SOURCES)) or [res["toolreg"]]
    res["toolreg"] = (
        sources[0] if len(sources) == 1 else ("CHANGED DURING THE RUN: " + " -> ".join(sources))
    )
    res["targets"] = report.targets(res)

    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{when:%Y%m%dT%H%M%S}{'-quick' if args.quick else ''}"
    md = report.markdown(res)
    md += f"\nWhole run: {res['elapsed_s']:.0f} s.\n"
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    drew = False
    try:
        drew = report.chart(res, stem.with_suffix(".png"))
    except Exception:
        traceback.print_exc()
    print("\n" + md)
    written = [f"{stem}.md", f"{stem}.json"] + ([f"{stem}.png"] if drew else [])
    print("written: " + ", ".join(written))


def _registry_and_memory(
    args: argparse.Namespace, res: dict[str, Any], run_id: str, engine: Any, section: Any
) -> None:
    """One server for both: 1,000 tools are registered once (that is the
    RegisterTool measurement), then read, then given a warm pool."""
    with server(engine) as srv:
        time.sleep(0.5)  # let start-up allocations finish before the empty RSS
        rss_empty = srv.rss_kib()
        print(f"== registering {registry_ops.N_TOOLS} tools", flush=True)
        registered = registry_ops.register_many(srv, registry_ops.N_TOOLS)
        if "registry" in args.sections:
            section(
                "registry",
                lambda: {
                    "register": registered,
                    "reads": registry_ops.reads(srv, registry_ops.N_TOOLS, args.read_runs),
                },
            )
        if "memory" in args.sections:

            def mem() -> dict[str, Any]:
                out = memory.run(srv, rss_empty, run_id, engine)
                out["tools"] = registry_ops.N_TOOLS
                return out

            section("memory", mem)
    if "memory" in res:
        res["memory"]["leftover_server_containers"] = srv.leftovers


if __name__ == "__main__":
    main()

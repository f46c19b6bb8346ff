"""The report: one Markdown table per section, the issue's targets computed
from this run (never hard-coded), and a PNG of the latency distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import (
    conditions_calibration,
    conditions_cost,
    cpu_share,
    egress_cost,
    export_cost,
    fairness,
    handoff,
    latency,
    phases,
    registry_ops,
    throughput,
    warm_interpreter,
)

MS_LIST_TARGET = 5.0  # ms: ListTools / GetToolSchemas p50 with 1,000 tools


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f} MiB"


def header(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    libs = ", ".join(f"{k} {v}" for k, v in res["packages"].items())
    return [
        f"# toolreg benchmark, {res['when'][:16].replace('T', ' ')} UTC",
        "",
        f"- machine: {m['cores']} cores, {m['memory_gib']} GiB, {m['kernel']},"
        f" Python {m['python']}",
        f"- engine: Docker {m.get('engine')} (API {m.get('engine_api', '?')}),"
        f" runtimes {', '.join(m.get('runtimes', []))}, cgroup {m.get('cgroup', '?')}",
        f"- workload: image `{res['image']}`, command `{res['command']}`,"
        f" stdin `{res['payload']}`; every call a fresh container unless a row says otherwise",
        f"- toolreg: {res.get('toolreg', '?')}; libraries: {libs}",
        f"- mode: {res['mode']}; sections: {', '.join(res['sections'])}",
        *_interference(res),
    ]


def _interference(res: dict[str, Any]) -> list[str]:
    watch = res.get("interference")
    if not watch:
        return []
    start = " ".join(f"{v:.2f}" for v in res.get("load_avg_start", ()))
    end = " ".join(f"{v:.2f}" for v in watch["load_avg_end"])
    busy = {k: v for k, v in watch["per_section"].items() if v["with_foreign"]}
    if busy:
        seen = "; ".join(
            f"{k}: in {v['with_foreign']} of {v['samples']} samples, up to {v['max_foreign']}"
            for k, v in busy.items()
        )
        verdict = (
            f"**other users' containers were running** ({seen}): treat those sections as noisy"
        )
    else:
        verdict = "no other containers seen"
    return [
        f"- shared machine: load average {start} at start, {end} at end; containers not"
        f" this run's, sampled every {watch['every_s']:g} s: {verdict}"
    ]


def latency_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Latency of one call ({sec['runs']} interleaved runs each, after {sec['warmup']}"
        " warm-up calls)",
        "",
        "| method | p50 ms | p95 ms | min ms | p50 / SDK cycle | p50 / SDK, toolreg config"
        " | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['method']} | {_f(r['p50_ms'])} | {_f(r['p95_ms'])} | {_f(r['min_ms'])}"
            f" | {_f(r['vs_sdk'], 2)}x | {_f(r['vs_sdk_toolreg'], 2)}x | {r['note']} |"
        )
    lines += [
        "",
        f"The server held {sec['warm_containers_idle']} warm containers while idle"
        f" (tools registered with warm_pool={latency.WARM_POOL}); after each warm call the"
        " harness waits for the pool to refill, untimed. Rows are named by what was"
        " registered: with no pool in the server, a warm row measures the cold path.",
        "The runsc rows mint one Ed25519 approval token per call (untimed: an approver's"
        " work); the server's verification and jti bookkeeping are timed.",
    ]
    lines += _unavailable(sec)
    burst = sec.get("burst") or {}
    if burst.get("calls"):
        lines += [
            "",
            f"Burst: {burst['bursts']} times {burst['size']} warm calls at once from a full"
            f" pool: p50 {_f(burst['p50_ms'])} ms, p95 {_f(burst['p95_ms'])} ms.",
        ]
    return lines


def _unavailable(sec: dict[str, Any]) -> list[str]:
    if not sec.get("unavailable"):
        return []
    lines = ["", "Not measured, and why:", ""]
    lines += [f"- **{name}**: {why}" for name, why in sec["unavailable"].items()]
    return lines


def throughput_md(sec: dict[str, Any]) -> list[str]:
    levels = throughput.CONCURRENCY
    methods = list(dict.fromkeys(c["method"] for c in sec["cells"]))
    lines = [
        "",
        f"## Throughput, calls per second ({sec['seconds_per_cell']:.0f} s per cell; server"
        f" max_sandboxes={sec['server']['max_sandboxes']}, max_queued="
        f"{sec['server']['max_queued']})",
        "",
        "| method | "
        + " | ".join(f"c={c} calls/s" for c in levels)
        + " | "
        + " | ".join(f"c={c} p50 ms" for c in levels)
        + " | errors |",
        "|---|" + "---:|" * (2 * len(levels)) + "---:|",
    ]
    for m in methods:
        cells = {c["concurrency"]: c for c in sec["cells"] if c["method"] == m}
        rates = " | ".join(_f(cells[c]["calls_per_s"]) if c in cells else "n/a" for c in levels)
        p50s = " | ".join(_f(cells[c]["p50_ms"]) if c in cells else "n/a" for c in levels)
        errors = sum(c["errors"] for c in cells.values())
        first = next((c["first_error"] for c in cells.values() if c["first_error"]), "")
        lines.append(f"| {m} | {rates} | {p50s} | {errors}{' (' + first + ')' if first else ''} |")
    sdk = throughput.SDK_TOOLREG
    top = max(levels)
    warm, churn = throughput.rate(sec, throughput.WARM, top), throughput.rate(sec, sdk, top)
    lines += [
        "",
        f"Warm tool: warm_pool={sec['warm_pool']}, {sec['warm_containers_idle']} containers"
        " held idle. A warm call skips create+start on its critical path, but every call"
        " still consumes one container that the engine must create, start and remove, so"
        " sustained warm throughput is bounded by the engine's container churn (the SDK churn"
        " rows); the pool only absorbs bursts of up to warm_pool calls."
        + (
            f" Here: warm {warm:.1f} calls/s at c={top} = {warm / churn:.2f}x the SDK churn"
            f" with toolreg's config ({churn:.1f}/s)."
            if warm and churn
            else ""
        ),
    ]
    return lines


def registry_md(sec: dict[str, Any]) -> list[str]:
    reg = sec["register"]
    lines = [
        "",
        f"## Registry operations with {reg['tools']:,} tools (loopback, one client)",
        "",
        f"RegisterTool: {reg['tools']:,} tools in {reg['seconds']} s ="
        f" **{reg['tools_per_s']} tools/s** (p50 {_f(reg['p50_ms'], 2)} ms,"
        f" p95 {_f(reg['p95_ms'], 2)} ms per call, sequential).",
    ]
    if "reads" in sec:
        lines += [
            "",
            "| RPC | runs | response bytes | p50 ms | p95 ms | min ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in sec["reads"]["rows"]:
            lines.append(
                f"| {r['rpc']} | {r['runs']} | {r['response_bytes']:,} | {_f(r['p50_ms'], 2)}"
                f" | {_f(r['p95_ms'], 2)} | {_f(r['min_ms'], 2)} |"
            )
    return lines


def cluster_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Several servers on PostgreSQL, through HAProxy",
        "",
        f"Reads: GetTool at concurrency {sec['read_concurrency']}. Approved calls: a dangerous"
        f" tool with a fresh token each, at concurrency {sec['call_concurrency']}. Store cost:"
        " p50 straight to one server of an audited refusal (one audit write, no sandbox) and of"
        f" a safe call. All servers, HAProxy and PostgreSQL share {sec['cores']} cores here.",
        "",
        "| setup | reads/s | x | approved calls/s | x | errors | refusal p50 ms |"
        " safe call p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        reads, calls, cost = r["reads"], r["approved_calls"], r["store_cost"]
        lines.append(
            f"| {r['setup']} | {_f(reads['calls_per_s'])} | {_f(reads.get('ratio'), 2)}"
            f" | {_f(calls['calls_per_s'])} | {_f(calls.get('ratio'), 2)}"
            f" | {reads['errors'] + calls['errors']}"
            f" | {_f(cost['audited_refusal']['p50_ms'], 2)}"
            f" | {_f(cost['safe_call']['p50_ms'], 1)} |"
        )
    return lines


def memory_md(sec: dict[str, Any]) -> list[str]:
    tools = sec.get("tools", 1000)
    lines = [
        "",
        "## Memory",
        "",
        "| server process (VmRSS) | RSS |",
        "|---|---:|",
        f"| no tools | {_mib(sec['rss_empty_kib'])} |",
        f"| {tools:,} tools | {_mib(sec['rss_tools_kib'])} |",
        f"| {tools:,} tools + a tool with warm_pool={sec['warm_pool_registered']}"
        f" ({sec['warm_containers_running']} warm containers running)"
        f" | {_mib(sec['rss_tools_pool_kib'])} |",
        "",
        "| idle container | cgroup usage_in_bytes | cgroup rss | docker stats"
        " | host processes outside its cgroup |",
        "|---|---:|---:|---:|---|",
    ]
    for key, label in (
        ("warm_container", "a toolreg warm container"),
        ("stand_in_container", "stand-in: SDK-made, toolreg config, `cat` blocked on stdin"),
    ):
        c = sec.get(key)
        if not c:
            continue
        procs = ", ".join(c.get("host_processes", [])) or "none found"
        lines.append(
            f"| {label} | {_mib(c.get('cgroup_usage_kib'))} | {_mib(c.get('cgroup_rss_kib'))}"
            f" | {_mib(c.get('docker_stats_kib'))}"
            f" | {_mib(c.get('host_processes_rss_kib'))} ({procs}) |"
        )
    lines += [
        "",
        "docker stats = usage - inactive file, as the CLI shows it on cgroup v1. The engine"
        " keeps one shim process per container outside the container's cgroup: for a"
        " container that only waits, that shim is most of its cost to the host.",
    ]
    if sec.get("warm_container_missing"):
        lines += ["", sec["warm_container_missing"]]
    return lines


def tracing_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## What tracing costs ({sec['runs']} interleaved calls, {sec['read_runs']} reads)",
        "",
        "| what | p50 ms, off | p50 ms, on | p95 ms, off | p95 ms, on | p50 on / off |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['what']} | {_f(r['off']['p50_ms'])} | {_f(r['on']['p50_ms'])}"
            f" | {_f(r['off']['p95_ms'])} | {_f(r['on']['p95_ms'])} | {_f(r['ratio'], 3)}x |"
        )
    lines += [
        "",
        "Off: a server with no OTEL_* variables (the default). On: the same server"
        " exporting every span over OTLP/gRPC to a collector in the bench process."
        f" {sec['spans_exported']} spans arrived. The last row is the client's side, on the"
        " untraced server: the Python client's channel (trace-context interceptor, no SDK)"
        " as 'on' against a bare channel as 'off'.",
    ]
    return lines


def webhooks_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## How soon approvers are told: webhooks ({sec['requests']} requests, one at a time)",
        "",
        "| from -> to | p50 ms | p95 ms | min ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['what']} | {_f(r['p50_ms'])} | {_f(r['p95_ms'])} | {_f(r['min_ms'])}"
            f" | {_f(r['max_ms'])} |"
        )
    lines += [
        "",
        "One server (SQLite) with a policy naming one webhook endpoint: a receiver on"
        " loopback in the bench process that verifies every signature"
        f" ({sec['deliveries']} deliveries, {sec['forged']} failed verification). Each"
        " delivery is queued in the event's transaction and sent by the server's dispatcher,"
        " woken by the commit.",
    ]
    return lines


# --------------------------------------------------------------------- targets


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed targets (issues 13, 23 and 28), as ratios of medians measured
    in this one run (and what conditions add, against a baseline of the run)."""
    lat = {r["method"]: r["p50_ms"] for r in res.get("latency", {}).get("rows", [])}
    out: list[dict[str, Any]] = []

    def add(target: str, measured: str, threshold: str, met: bool | None) -> None:
        out.append({"target": target, "measured": measured, "threshold": threshold, "met": met})

    def ratio(target: str, num: float | None, den: float | None, limit: float,
              at_most: bool = True) -> None:  # fmt: skip
        if num is None or not den:
            add(target, "not measured", "", None)
            return
        value = num / den
        add(
            target,
            f"{num:.1f} / {den:.1f} = {value:.3f}",
            f"{'<=' if at_most else '>='} {limit}",
            value <= limit if at_most else value >= limit,
        )

    warm, cold = lat.get(latency.WARM), lat.get(latency.COLD)
    ratio("warm p50 / docker run --rm p50", warm, lat.get("docker run --rm"), 0.03)
    ratio("warm p50 / llm-sandbox pooled with reuse p50", warm, lat.get(latency.LLM_POOLED), 0.15)
    ratio("cold p50 / plain SDK cycle p50", cold, lat.get(latency.SDK_DEFAULT), 0.40)
    ratio("warm gVisor p50 / warm runc p50", lat.get(latency.RUNSC_WARM), warm, 1.5)
    tp = res.get("throughput", {})
    top = max(throughput.CONCURRENCY)
    ratio(
        f"sustained throughput at c={top} / engine churn (toolreg's config)",
        throughput.rate(tp, throughput.COLD, top),
        throughput.rate(tp, throughput.SDK_TOOLREG, top),
        0.95,
        at_most=False,
    )
    burst = res.get("latency", {}).get("burst") or {}
    ratio("burst of pool-size calls, p95 / warm p50", burst.get("p95_ms"), warm, 3.0)
    eg = res.get("egress", {}).get("targets") or {}
    for prefix, where in (("", "runc"), ("gvisor_", "gVisor")):
        if prefix and not any(k.startswith(prefix) for k in eg):
            continue
        ratio(
            f"cold call with egress / without ({where}), p50",
            eg.get(f"{prefix}cold_egress_p50_ms"),
            eg.get(f"{prefix}cold_plain_p50_ms"),
            1.3,
        )
        ratio(
            f"warm call with egress / without ({where}), p50",
            eg.get(f"{prefix}warm_egress_p50_ms"),
            eg.get(f"{prefix}warm_plain_p50_ms"),
            2.0,
        )
    reg = res.get("registry", {})
    for rpc in ("ListTools", "GetToolSchemas (OpenAI)"):
        v = registry_ops.p50(reg, rpc)
        name = f"{rpc} p50 with 1,000 tools < {MS_LIST_TARGET:g} ms"
        if v is not None:
            add(name, f"{v:.2f} ms", f"< {MS_LIST_TARGET:g} ms", v < MS_LIST_TARGET)
        else:
            add(name, "not measured", "", None)
    cond = res.get("conditions") or {}
    base = conditions_cost.row(cond, conditions_cost.NONE)
    for case, label in ((conditions_cost.TYPICAL, "3 of them match the tool"),
                        (conditions_cost.WORST, "all match and hold: worst case")):  # fmt: skip
        name = f"what 50 conditional rules add to a call's decision, p50 ({label})"
        got = conditions_cost.row(cond, case)
        if base is None or got is None:
            add(name, "not measured", "", None)
            continue
        limit = conditions_cost.TARGET_US
        add(
            name,
            f"{got['p50_us']:.1f} - {base['p50_us']:.1f} = {got['delta_us']:.1f} µs",
            f"< {limit:g} µs",
            got["delta_us"] < limit,
        )
    model = cond.get("model") or {}
    ok, cases = conditions_calibration.sound(model)
    add("conditions' cost estimate >= measured CPU time, every calibrated case on 1 MiB (issue 37)",
        f"{ok} of {cases}" if cases else "not measured", "all",
        (ok == cases) if cases else None)  # fmt: skip
    for r in model.get("worst_guards", ()):
        add(f"worst guard set under the cap on 1 MiB ({r['what']}): CPU p50 <= estimate",
            f"{r['measured_p50_ms']:.1f} ms <= {r['estimate_ms']:.1f} ms (wall"
            f" {r['wall_p50_ms']:.1f} ms)", f"<= {r['estimate_ms']:.1f} ms",
            r["measured_p50_ms"] <= r["estimate_ms"])  # fmt: skip
    proj = model.get("projection")
    if proj:
        ratio("a one-field guard over 1 MiB of other arguments, p50: only the fields read / all",
              proj["projected_p50_ms"], proj["whole_p50_ms"], 0.1)  # fmt: skip
    cpu = res.get("cpu_share") or {}
    for key, label, limit in (
        ("one_over_idle", "one-guard load / idle", cpu_share.IDLE_TARGET),
        ("sixteen_over_one", "sixteen guards' load / one guard's", cpu_share.GUARDS_TARGET),
    ):
        got = cpu.get(key)
        add(f"a quiet client's cheap call p50 while six send 1 MiB arguments, {label} (issue 37)",
            "not measured" if got is None else f"{got:.2f}", f"<= {limit:g}",
            None if got is None else got <= limit)  # fmt: skip
    ex = res.get("export") or {}
    both, neither = export_cost.p50(ex, export_cost.BOTH), export_cost.p50(ex, export_cost.OFF)
    ratio("warm p50 with audit checkpoints and SIEM export / without", both, neither, 1.05)
    ratios = (res.get("interpreter") or {}).get("ratios_p50") or {}
    limit = warm_interpreter.TARGET
    for key, label in (
        (warm_interpreter.RATIO_SAFE, "safe cat, toolreg/base: the fair baseline (issue 37)"),
        (warm_interpreter.RATIO_SAME_IMAGE, "cautious cat, toolreg/python (issue 30)"),
    ):
        got = ratios.get(key)
        add(f"warm run_python (prestart) p50 / warm cat p50, {label}",
            "not measured" if got is None else f"{got:.2f}", f"<= {limit}",
            None if got is None else got <= limit)  # fmt: skip
    return out


def targets_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Targets (issues 13, 23, 28, 29, 30 and 37), ratios of medians from this run",
        "",
        "| target | measured | threshold | result |",
        "|---|---|---|---|",
    ]
    for t in rows:
        result = {True: "met", False: "**NOT met**", None: "—"}[t["met"]]
        if t["met"] is None and t["measured"] == "not measured":
            result = "not measured"
        lines.append(f"| {t['target']} | {t['measured']} | {t['threshold']} | {result} |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    lines = header(res)
    if "latency" in res:
        lines += latency_md(res["latency"])
    if "phases" in res:
        lines += phases.markdown(res["phases"])
    if "handoff" in res:
        lines += handoff.report_md(res["handoff"])
    if "throughput" in res:
        lines += throughput_md(res["throughput"])
    if "registry" in res:
        lines += registry_md(res["registry"])
    if "memory" in res:
        lines += memory_md(res["memory"])
    if "cluster" in res:
        lines += cluster_md(res["cluster"])
    if "tracing" in res:
        lines += tracing_md(res["tracing"])
    if "webhooks" in res:
        lines += webhooks_md(res["webhooks"])
    if "fairness" in res:
        lines += fairness.report_md(res["fairness"])
    if "cpu_share" in res:
        lines += cpu_share.report_md(res["cpu_share"])
    if "egress" in res:
        lines += egress_cost.report_md(res["egress"])
    if "conditions" in res:
        lines += conditions_cost.report_md(res["conditions"])
    if "export" in res:
        lines += export_cost.report_md(res["export"])
    if "interpreter" in res:
        lines += warm_interpreter.report_md(res["interpreter"])
    lines += targets_md(res["targets"])
    if res.get("errors"):
        lines += ["", "## Sections that failed", ""]
        lines += [f"- **{k}**: {v}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- chart


def _minor_label(value: float, _pos: int) -> str:
    # Label 2x and 5x between the decades of a log axis, and nothing else.
    lead = value / 10 ** int(f"{value:e}".split("e")[1])
    return f"{value:g}" if round(lead) in (2, 5) else ""


def chart(res: dict[str, Any], path: Path) -> bool:
    """Latency distributions (box per method, log scale) and, when measured,
    throughput per concurrency. False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    lat = res.get("latency")
    tp = res.get("throughput")
    panels = [p for p in (lat, tp) if p]
    if not panels:
        return False
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(8 * len(panels), 6.5),
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 2][: len(panels)]},
    )
    ax_iter = iter(axes[0])
    colours = {"baseline": "#9aa5b1", "toolreg": "#2f7ed8"}
    if lat:
        ax = next(ax_iter)
        rows = sorted(lat["rows"], key=lambda r: r["p50_ms"], reverse=True)
        data = [lat["samples_ms"][r["method"]] for r in rows]
        box = ax.boxplot(data, vert=False, patch_artist=True, showfliers=True, widths=0.6)
        for patch, r in zip(box["boxes"], rows, strict=True):
            patch.set_facecolor(colours.get(r["group"], "#cccccc"))
        ax.set_yticks(range(1, len(rows) + 1), [r["method"] for r in rows], fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(_minor_label))
        ax.set_xlabel("ms per call (log scale)")
        ax.set_title(f"Latency of one call, {lat['runs']} interleaved runs (blue: toolreg)")
        ax.grid(axis="x", which="both", alpha=0.3)
    if tp:
        ax = next(ax_iter)
        methods = list(dict.fromkeys(c["method"] for c in tp["cells"]))
        levels = throughput.CONCURRENCY
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            rates = [throughput.rate(tp, m, c) or 0.0 for c in levels]
            xs = [j + i * width for j in range(len(levels))]
            ax.bar(xs, rates, width, label=m)
        ax.set_xticks(
            [j + width * (len(methods) - 1) / 2 for j in range(len(levels))],
            [f"concurrency {c}" for c in levels],
        )
        ax.set_ylabel("calls per second")
        ax.set_title(f"Throughput ({tp['seconds_per_cell']:.0f} s per cell)")
        top = max((c["calls_per_s"] for c in tp["cells"]), default=1.0)
        ax.set_ylim(0, top * 1.45)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    m = res["machine"]
    fig.suptitle(
        f"toolreg bench {res['when'][:16]} UTC · {m['cores']} cores, {m['memory_gib']} GiB ·"
        f" Docker {m.get('engine')} · {res['image']} `{res['command']}`",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

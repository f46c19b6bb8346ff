"""What the audit log's signed checkpoints and its SIEM export cost a warm
call, and how fast the export goes (issue 29, docs/how-to/audit.md).

Warm calls, interleaved (the order rotating each round; after each call
its server's used container is removed and its pool refilled before the
next timed call, to whichever server) against four `toolreg serve`
processes of this run: neither; checkpoints (a log key, a checkpoint every
10 records: a hundred times the default rate); the export (a JSON Lines
file and a real rsyslogd over TLS, tests/rsyslog_receiver.py); both; and a
second server with neither, whose ratio to the first is the noise of the
comparison on this machine at this time. Both
work on threads of their own that read the committed log: the target is
nothing measurable on the call's path, under 5% at p50.

The same question closer up, in process, with less noise: the audit write
every call makes (store/group_commit.py's AuditAppender on a SQLite store),
rotating between four stores on one disk: one nobody follows, one a
checkpointer follows (every 10 records), one exporters to the file and
rsyslogd follow, one both: what those threads cost a call is what they take
from its audit write (the store's lock, the disk, the GIL).

Then the export's throughput, in process: 20,000 execution records in a
SQLite store, exported by one exporter (batches of 500, each confirmed
before the cursor moves) to a JSON Lines file, and to rsyslogd over TLS
(confirmed = acknowledged by its TCP; then until rsyslogd has written them
all); and the mapping alone (record -> OCSF event -> JSON), for scale.

Runs alone: ``python -m bench.export_cost [--runs N] [--records N]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import docker

from bench.common import Server, definition, engine_client, server, summary
from registry_server.domain import merkle
from registry_server.notify.siem import ocsf
from registry_server.notify.siem.exporter import DEFAULT_BATCH, Exporter
from registry_server.notify.siem.sinks import JsonlSink, Sink, SyslogTls, SyslogTlsSink
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.notes import Signer
from registry_server.store import audit_chain, audit_tree
from registry_server.store.group_commit import AuditAppender
from registry_server.store.sqlite import SqliteStore
from tests.rsyslog_receiver import Rsyslog

WARM_POOL = 2
SETTLE_TIMEOUT_S = 10.0
TOOL = "bench_export_warm"
OFF, CHECKPOINTS, EXPORT, BOTH = "neither", "checkpoints", "export", "checkpoints + export"
CONTROL = "neither, a second server"  # A/A: how far two identical servers differ here
CHECKPOINT_EVERY = 10  # records per checkpoint here (the default is 1,000)
RECORDS = 20_000  # records exported in the throughput part
QUICK_RECORDS = 2_000
LOG_NAME = "toolreg/bench-export"
DRAIN_TIMEOUT_S = 120.0  # seconds the throughput part may take per destination
# An execution record as the server writes one (execution/audit_record.py), egress-free.
RECORD: dict[str, Any] = {
    "execution_id": "", "caller": "bench-agent", "tool": "bench_echo", "tool_digest": "d" * 64,
    "level": "cautious", "args_digest": "a" * 64, "decision": "allowed", "approvers": [],
    "jtis": [], "approval_request_id": None, "status": "OK", "exit_code": 0, "duration_ms": 31,
    "runtime": "runc", "container_id": "0123456789ab", "warm": True,
    "limits": {"memory_mb": 256, "cpu_millis": 1000, "pids": 64, "timeout_ms": 30000,
               "output_bytes": 1048576},
}  # fmt: skip


def run(runs: int, engine: docker.DockerClient, *, records: int = RECORDS) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="toolreg-bench-export-"))
    receiver = Rsyslog(base / "rsyslog").start()
    try:
        calls = _warm_calls(runs, engine, receiver, base)
        writes = _audit_writes(max(200, runs * 10), receiver, base)
        throughput = _throughput(records, receiver, base)
    finally:
        receiver.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {"runs": runs, **calls, "audit_writes": writes, **throughput}


# ---------------------------------------------------------------- warm calls


def _settings(receiver: Rsyslog, base: Path) -> dict[str, dict[str, str]]:
    key, _public = generate_keypair()
    key_file = base / "log.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    checkpoints = {
        "TOOLREG_LOG_KEY_FILE": str(key_file),
        "TOOLREG_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY),
        "TOOLREG_LOG_ORIGIN": LOG_NAME,
    }

    def export(name: str) -> dict[str, str]:
        return {
            "TOOLREG_LOG_ORIGIN": LOG_NAME,
            "TOOLREG_EXPORT_JSONL": str(base / name / "audit.jsonl"),
            "TOOLREG_EXPORT_SYSLOG": receiver.address,
            "TOOLREG_EXPORT_SYSLOG_CA": str(receiver.ca_file),
            "TOOLREG_EXPORT_SYSLOG_CERT": str(receiver.client_cert),
            "TOOLREG_EXPORT_SYSLOG_KEY": str(receiver.client_key),
        }

    return {OFF: {}, CHECKPOINTS: checkpoints, EXPORT: export("export"),
            BOTH: {**checkpoints, **export("both")}, CONTROL: {}}  # fmt: skip


def _warm_calls(
    runs: int, engine: docker.DockerClient, receiver: Rsyslog, base: Path
) -> dict[str, Any]:
    settings = _settings(receiver, base)
    with ExitStack() as stack:
        servers = {name: stack.enter_context(server(engine, **env))
                   for name, env in settings.items()}  # fmt: skip
        for srv in servers.values():
            srv.register(definition(TOOL, warm_pool=WARM_POOL))
        names = list(servers)
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(-1, runs):  # one unmeasured round first
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                elapsed = _timed(servers[name])
                if i >= 0:
                    times[name].append(elapsed)
                # The used container's removal and the pool's refill (engine work) end
                # before the next timed call, whichever server it goes to.
                servers[name].settle_after_call(WARM_POOL, SETTLE_TIMEOUT_S)
        exported = _exported(base, receiver, runs)
    base_p50 = statistics.median(times[OFF])
    rows = [
        {"what": name, **summary(values),
         "ratio": round(statistics.median(values) / base_p50, 3) if base_p50 else None}
        for name, values in times.items()
    ]  # fmt: skip
    return {"rows": rows, "exported": exported}


def _timed(srv: Server) -> float:
    t0 = time.perf_counter()
    srv.run(TOOL)
    return (time.perf_counter() - t0) * 1000


def _exported(base: Path, receiver: Rsyslog, runs: int) -> dict[str, int]:
    """Events in each exporting server's file, and at rsyslog, once caught up:
    each server's log holds its registration and runs + 1 calls."""
    expected = runs + 2
    deadline = time.monotonic() + 10
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = {name: _lines(base / name / "audit.jsonl") for name in ("export", "both")}
        counts["rsyslog"] = len(receiver.messages(LOG_NAME))
        if counts == {"export": expected, "both": expected, "rsyslog": 2 * expected}:
            break
        time.sleep(0.2)
    return counts


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------- the audit write


def _audit_writes(writes: int, receiver: Rsyslog, base: Path) -> dict[str, Any]:
    """p50 of one audit write, rotating between four SQLite stores: one nobody
    follows, one a checkpointer follows, one two exporters follow, one both."""
    key, _public = generate_keypair()
    signer = Signer(LOG_NAME, load_private_key(key))
    target = SyslogTls("127.0.0.1", receiver.port, receiver.ca_file, receiver.client_cert,
                       receiver.client_key)  # fmt: skip
    stores: dict[str, SqliteStore] = {}
    followers: list[Exporter | audit_tree.Checkpointer] = []
    for name in (OFF, CHECKPOINTS, EXPORT, BOTH):
        folder = base / f"writes-{len(stores)}"
        store = stores[name] = SqliteStore(folder / "toolreg.db")
        if name in (CHECKPOINTS, BOTH):
            followers.append(audit_tree.Checkpointer(
                store, signer, merkle.CompactRange(), audit_chain.GENESIS_HASH,
                every=CHECKPOINT_EVERY,
            ))  # fmt: skip
        if name in (EXPORT, BOTH):
            source = ocsf.Source(f"{LOG_NAME}-writes-{len(stores)}")
            followers += [Exporter(store, JsonlSink(folder / "audit.jsonl"), source),
                          Exporter(store, SyslogTlsSink(target), source)]  # fmt: skip
    appenders = {name: AuditAppender(store) for name, store in stores.items()}
    names = list(appenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for follower in followers:
        follower.start()
    try:
        for n in range(writes):
            for name in names[n % len(names) :] + names[: n % len(names)]:
                t0 = time.perf_counter()
                appenders[name].append("execution", {**RECORD, "execution_id": f"w{n:08d}"})
                times[name].append((time.perf_counter() - t0) * 1000)
                time.sleep(0.002)  # calls come apart, not back to back
    finally:
        for follower in followers:
            follower.close()
        for store in stores.values():
            store.close()
    exported = min((f.exported for f in followers if isinstance(f, Exporter)), default=0)
    signed = [f.last.size for f in followers
              if isinstance(f, audit_tree.Checkpointer) and f.last]  # fmt: skip
    rows = [{"what": name, **summary(values)} for name, values in times.items()]
    return {"writes": writes, "rows": rows, "exported": exported,
            "checkpoints": min(signed, default=0)}  # fmt: skip


# ---------------------------------------------------------------- throughput


@contextmanager
def _log(records: int, base: Path) -> Iterator[SqliteStore]:
    store = SqliteStore(base / "throughput" / "toolreg.db")
    try:
        for first in range(0, records, 1_000):
            with store.unit_of_work() as uow:
                for n in range(first, min(first + 1_000, records)):
                    audit_chain.append(uow, "execution", {**RECORD, "execution_id": f"x{n:08d}"})
        yield store
    finally:
        store.close()


def _throughput(records: int, receiver: Rsyslog, base: Path) -> dict[str, Any]:
    source = ocsf.Source(LOG_NAME + "-throughput")
    out: dict[str, Any] = {"records": records, "batch": DEFAULT_BATCH}
    with _log(records, base) as store:
        with store.reading() as reads:
            entries = reads.audit_entries()
        t0 = time.perf_counter()
        size = sum(len(ocsf.dumps(ocsf.event(e, source))) + 1 for e in entries)
        out["mapping_per_s"] = round(records / (time.perf_counter() - t0))
        out["event_bytes"] = round(size / records)
        out["jsonl_per_s"] = _drain(store, JsonlSink(base / "throughput" / "audit.jsonl"), source)
        target = SyslogTls("127.0.0.1", receiver.port, receiver.ca_file, receiver.client_cert,
                           receiver.client_key)  # fmt: skip
        t0 = time.perf_counter()
        out["syslog_per_s"] = _drain(store, SyslogTlsSink(target), source)
        written = _until(lambda: len(receiver.messages(source.log_name)) >= records)
        out["syslog_written_per_s"] = round(records / (written - t0)) if written else None
    return out


def _drain(store: SqliteStore, sink: Sink, source: ocsf.Source) -> int:
    """Records per second until the destination confirmed the whole log."""
    exporter = Exporter(store, sink, source)
    t0 = time.perf_counter()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while exporter.pump() and time.monotonic() < deadline:
        pass
    elapsed = time.perf_counter() - t0
    exported = exporter.exported
    exporter.close(drain_s=0)
    return round(exported / elapsed)


def _until(done: Callable[[], bool]) -> float | None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if done():
            return time.perf_counter()
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------- report


def p50(sec: dict[str, Any], what: str) -> float | None:
    for row in sec.get("rows", []):
        if row["what"] == what:
            return float(row["p50_ms"])
    return None


def report_md(sec: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## What audit checkpoints and SIEM export cost a warm call ({sec['runs']}"
        " interleaved calls per server)",
        "",
        "| server | p50 ms | p95 ms | min ms | max ms | p50 / neither |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['what']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['min_ms']:.1f}"
            f" | {r['max_ms']:.1f} | {r['ratio']:.3f}x |"
        )
    ex = sec.get("exported", {})
    lines += [
        "",
        f"Checkpoints: a log key, one signed every {CHECKPOINT_EVERY} records (the default is"
        " 1,000). Export: a JSON Lines file and rsyslogd over TLS with a client certificate,"
        " on loopback. After each call, its pool is refilled before the next timed call. Events"
        f" exported: {ex.get('export', '?')} and {ex.get('both', '?')} to the two servers'"
        f" files, {ex.get('rsyslog', '?')} at rsyslogd. The last row is a second server"
        " with neither: its ratio to the first is how far two identical servers differ here,"
        " the comparison's noise.",
    ]
    aw = sec.get("audit_writes")
    if aw:
        lines += [
            "",
            f"### The audit write, in process ({aw['writes']} writes per store, rotating)",
            "",
            "| store | p50 ms | p95 ms | min ms | max ms |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [f"| {r['what']} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {r['min_ms']:.2f}"
                  f" | {r['max_ms']:.2f} |" for r in aw["rows"]]  # fmt: skip
        base = aw["rows"][0]["p50_ms"]
        lines += ["", "p50 over nothing: " + ", ".join(
            f"{r['what']} {r['p50_ms'] - base:+.3f} ms" for r in aw["rows"][1:])]  # fmt: skip
        lines += [
            "",
            "Four SQLite stores on one disk, followed as they grow by nothing, a checkpointer"
            f" (every {CHECKPOINT_EVERY} records), two exporters (the file, rsyslogd), or"
            f" both. The exporters delivered {aw['exported']} records each; the last"
            f" checkpoints covered {aw['checkpoints']}.",
        ]
    lines += [
        "",
        f"### The export's throughput ({sec['records']:,} execution records, batches of"
        f" {sec['batch']})",
        "",
        "| destination | records/s |",
        "|---|---:|",
        f"| mapping alone (record -> OCSF event -> JSON, {sec['event_bytes']} bytes each)"
        f" | {sec['mapping_per_s']:,} |",
        f"| JSON Lines file (written, fsync'ed, cursor stored) | {sec['jsonl_per_s']:,} |",
        f"| rsyslogd over TLS (acknowledged, cursor stored) | {sec['syslog_per_s']:,} |",
        f"| rsyslogd over TLS (until rsyslogd wrote them all) |"
        f" {sec['syslog_written_per_s'] or 0:,} |",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.export_cost", description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = engine_client(pool=8)
    try:
        sec = run(args.runs, engine, records=args.records)
    finally:
        engine.close()
    print("\n".join(report_md(sec)))
    if args.json:
        args.json.write_text(json.dumps(sec, indent=2) + "\n")


if __name__ == "__main__":
    main()

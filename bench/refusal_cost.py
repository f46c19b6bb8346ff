"""What recording refusals costs a refused call (docs/how-to/audit.md,
"Refused requests"): wrong bearer tokens against servers of this run, in
this process, with a policy and a SQLite file each, interleaved in batches
so noise hits them alike:

* recorded: a server as every server is (refusals recorded, folded);
* unrecorded: its interceptor gets no refusal log (the baseline); a second
  one is the A/A control (what noise alone makes of a ratio);
* unfolded: refusals recorded with no folding to speak of (table and
  per-source share of 10^9 groups): every refusal naming a new tool is a
  record written before its answer, what folding saves.

Rows: a flood (every refusal the same group: the first is written, the rest
counted in memory); a new tool name on every call (one source: its first 32
groups are written at once, the rest fold into its overflow group); and the
unfolded server with a new tool name on every call.

Run: ``.venv/bin/python -m bench.refusal_cost [--batches 15] [--calls 60]``.
Prints medians of the per-batch mean latency (ms per refused call), each
row's ratio against the unrecorded server, and the control's ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import grpc
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import build_app
from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server
from registry_server.execution.refusal_log import RefusalLog

BATCHES = 15  # interleaved batches per server and mode
CALLS = 60  # refused calls per batch
AGENT_TOKEN_SHA256 = "0" * 64  # a client no token of this bench matches
UNFOLDED = 10**9  # groups: a table that never fills


@contextmanager
def _server(root: Path, refusals: str) -> Iterator[pb_grpc.ToolRegistryStub]:
    """``refusals``: "recorded" (as served), "unrecorded" or "unfolded"."""
    root.mkdir(parents=True)
    policy = root / "policy.yaml"
    clients = [{"id": "agent", "token_sha256": AGENT_TOKEN_SHA256, "roles": ["execute"]}]
    policy.write_text(yaml.safe_dump({"audience": "bench-refusals", "clients": clients}))
    config = ServerConfig(
        host="127.0.0.1", port=0, data_dir=root / "data", policy_file=policy, max_warm=0
    )
    app = build_app(config)
    if refusals != "recorded":
        assert app.refusals is not None
        app.refusals.close()
        app.refusals = None  # the interceptor below records nothing
    if refusals == "unfolded":
        app.refusals = RefusalLog(app.store, max_keys=UNFOLDED, max_per_source=UNFOLDED)
        app.refusals.start()
        app.closers.insert(0, app.refusals.close)
    server, port, app = create_server(config, app)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ToolRegistryStub(channel)
    finally:
        channel.close()
        server.stop(None).wait()
        app.close()


def _batch(stub: pb_grpc.ToolRegistryStub, calls: int, distinct: bool, start: int) -> float:
    """Mean milliseconds per refused call over ``calls`` calls."""
    metadata = (("authorization", "Bearer bench-wrong-token"),)
    t0 = time.perf_counter()
    for i in range(calls):
        name = f"t{start + i}" if distinct else "bench_echo"
        with suppress(grpc.RpcError):
            stub.ExecuteTool(pb.ExecuteToolRequest(name=name), metadata=metadata, timeout=30)
    return (time.perf_counter() - t0) * 1000 / calls


def _compare(
    stubs: dict[str, pb_grpc.ToolRegistryStub], batches: int, calls: int, distinct: bool
) -> dict[str, Any]:
    """Median batch means of each server, batches interleaved (order reversed
    every other round)."""
    for stub in stubs.values():
        _batch(stub, calls, distinct, 10**8)  # warm-up, untimed
    times: dict[str, list[float]] = {name: [] for name in stubs}
    names = list(stubs)
    for n in range(batches):
        for name in names if n % 2 == 0 else names[::-1]:
            times[name].append(_batch(stubs[name], calls, distinct, n * calls))
    medians = {name: statistics.median(t) for name, t in times.items()}
    baseline = medians["unrecorded"]
    return {
        **{f"{name}_ms": round(ms, 4) for name, ms in medians.items()},
        "ratio": round(medians["recorded"] / baseline, 3),
        # an unrecorded server against the other: what noise alone makes of a ratio
        "control_ratio": round(medians["control"] / baseline, 3),
    }


def run(batches: int = BATCHES, calls: int = CALLS) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="toolreg-bench-refusals-") as tmp,
        _server(Path(tmp) / "on", "recorded") as on,
        _server(Path(tmp) / "off", "unrecorded") as off,
        _server(Path(tmp) / "control", "unrecorded") as control,
        _server(Path(tmp) / "unfolded", "unfolded") as unfolded,
    ):
        base = {"unrecorded": off, "control": control}
        rows = {
            "flood, one group": _compare({"recorded": on, **base}, batches, calls, False),
            "a new tool each call": _compare({"recorded": on, **base}, batches, calls, True),
            "unfolded, a new tool each call": _compare(
                {"recorded": unfolded, **base}, batches, calls, True
            ),
        }
    return {"batches": batches, "calls_per_batch": calls, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=BATCHES)
    parser.add_argument("--calls", type=int, default=CALLS)
    args = parser.parse_args()
    print(json.dumps(run(args.batches, args.calls), indent=2))


if __name__ == "__main__":
    main()

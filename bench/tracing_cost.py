"""What tracing costs: the same calls against two servers in this run, one with
tracing off (the default) and one exporting every span over OTLP/gRPC to a
collector in this process, interleaved so noise hits both alike. Also the
client's side: GetTool through the Python client's channel (trace-context
interceptor, no SDK) against a bare channel, on the untraced server."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import docker

from bench.common import RPC_TIMEOUT_S, Server, TraceCollector, definition, server, summary
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel

WARM_POOL = 2
SETTLE_TIMEOUT_S = 5.0
COLD, WARM, READ, CLIENT = "cold call", "warm call", "GetTool", "client GetTool"


def run(runs: int, read_runs: int, engine: docker.DockerClient) -> dict[str, Any]:
    collector = TraceCollector()
    traced_env = collector.env
    try:
        with server(engine) as off, server(engine, **traced_env) as on:
            for srv in (off, on):
                srv.register(definition("bench_echo"))
                srv.register(definition("bench_echo_warm", warm_pool=WARM_POOL))
            pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
                COLD: (lambda: off.run("bench_echo"), lambda: on.run("bench_echo")),
                WARM: (_warm(off), _warm(on)),
                READ: (_get(off), _get(on)),
            }
            rows = [_pair(name, *fns, read_runs if name == READ else runs)
                    for name, fns in pairs.items()]  # fmt: skip
            bare = pb_grpc.ToolRegistryStub(off.channel)
            with open_channel(off.proc.address) as channel:
                client = pb_grpc.ToolRegistryStub(channel)
                rows.append(_pair(CLIENT, _get_via(bare), _get_via(client), read_runs))
            time.sleep(1)  # the batch processor's last export
    finally:
        lines = collector.finish()
    exported = int(lines[-1])
    return {"runs": runs, "read_runs": read_runs, "rows": rows, "spans_exported": exported}


def _warm(srv: Server) -> Callable[[], object]:
    def call() -> object:
        srv.settle_after_call(WARM_POOL, SETTLE_TIMEOUT_S)  # untimed: from a full pool
        t0 = time.perf_counter()
        srv.run("bench_echo_warm")
        return (time.perf_counter() - t0) * 1000

    return call


def _get(srv: Server) -> Callable[[], object]:
    return _get_via(srv.stub)


def _get_via(stub: pb_grpc.ToolRegistryStub) -> Callable[[], object]:
    return lambda: stub.GetTool(pb.GetToolRequest(name="bench_echo"), timeout=RPC_TIMEOUT_S)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    elapsed = (time.perf_counter() - t0) * 1000
    return out if isinstance(out, float) else elapsed  # a warm call times itself


def _pair(
    name: str, off: Callable[[], object], on: Callable[[], object], runs: int
) -> dict[str, Any]:
    """Medians of ``off`` and ``on``, interleaved (order alternating), one warm-up each."""
    off(), on()
    got: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(runs):
        order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
        for which, fn in order:
            got[which].append(_timed(fn))
    p50_off, p50_on = statistics.median(got["off"]), statistics.median(got["on"])
    return {
        "what": name,
        "off": summary(got["off"]),
        "on": summary(got["on"]),
        "ratio": round(p50_on / p50_off, 3) if p50_off else None,
    }

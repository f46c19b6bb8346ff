"""Calls per second at concurrency 1, 4 and 16: toolreg ExecuteTool cold and
warm against the raw SDK churn rate (threads each doing SDK cycles) at the
same concurrency. Each cell is bounded in time: threads stop starting calls
at the deadline and the in-flight ones finish; rate = completed / elapsed."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import docker

from bench.baselines import sdk_cycle
from bench.common import (
    PAYLOAD,
    SERVER_MAX_QUEUED,
    SERVER_MAX_SANDBOXES,
    TOOLREG_EXTRAS,
    definition,
    pct,
    server,
)

CONCURRENCY = (1, 4, 16)
WARM_POOL = 4  # warm_pool of the warm tool: the pool absorbs bursts, refill bounds the rest
SDK_DEFAULT = "docker SDK churn"
SDK_TOOLREG = "docker SDK churn, toolreg's container config"
COLD = "toolreg ExecuteTool cold"
WARM = f"toolreg ExecuteTool warm_pool={WARM_POOL}"


def cell(fn: Callable[[], bytes], concurrency: int, seconds: float) -> dict[str, Any]:
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                out = fn()
                ok = out.strip() == PAYLOAD
                err = "" if ok else f"wrong output {out[:80]!r}"
            except Exception as exc:
                ok, err = False, f"{type(exc).__name__}: {str(exc)[:200]}"
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                if ok:
                    latencies.append(ms)
                else:
                    errors.append(err)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "calls": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "calls_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "p95_ms": round(pct(latencies, 0.95), 1) if latencies else None,
    }


def run(seconds: float, run_id: str, engine: docker.DockerClient) -> dict[str, Any]:
    client = docker.from_env(max_pool_size=2 * max(CONCURRENCY))
    cells: list[dict[str, Any]] = []
    with server(engine) as srv:
        srv.register(definition("bench_echo"))
        srv.register(definition("bench_echo_warm", warm_pool=WARM_POOL))
        steady = srv.steady_count()
        print(f"throughput: server holds {steady} idle warm containers", flush=True)
        methods: list[tuple[str, Callable[[], bytes], bool]] = [
            (SDK_DEFAULT, sdk_cycle(client, {}, run_id), False),
            (SDK_TOOLREG, sdk_cycle(client, TOOLREG_EXTRAS, run_id), False),
            (COLD, functools.partial(srv.run, "bench_echo"), False),
            (WARM, functools.partial(srv.run, "bench_echo_warm"), True),
        ]
        for concurrency in CONCURRENCY:  # methods interleaved within each level
            for name, fn, warm in methods:
                refilled = srv.settle(steady, timeout_s=30) if warm else None
                result = cell(fn, concurrency, seconds)
                result["method"] = name
                if warm:
                    result["pool_full_at_start"] = refilled == steady
                cells.append(result)
                print(
                    f"throughput: {name} x{concurrency}: {result['calls_per_s']} calls/s"
                    f" ({result['calls']} ok, {result['errors']} errors)",
                    flush=True,
                )
    client.close()
    return {
        "seconds_per_cell": seconds,
        "server": {"max_sandboxes": SERVER_MAX_SANDBOXES, "max_queued": SERVER_MAX_QUEUED},
        "warm_pool": WARM_POOL,
        "warm_containers_idle": steady,
        "cells": cells,
        "leftover_server_containers": srv.leftovers,
    }


def rate(section: dict[str, Any], method: str, concurrency: int) -> float | None:
    for c in section.get("cells", []):
        if c["method"] == method and c["concurrency"] == concurrency:
            return float(c["calls_per_s"])
    return None

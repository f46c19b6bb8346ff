"""Latency of one call, every method side by side: the baselines users would
pick, and toolreg's ExecuteTool cold, warm and under runsc. Runs are
interleaved (one call of each method per round) so machine noise hits every
method alike; a server's warm pool is given time to refill after its call so
the refill lands in no other method's measurement."""

from __future__ import annotations

import functools
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import docker

from bench import baselines
from bench.baselines import Method
from bench.common import (
    COMMAND,
    IMAGE,
    PAYLOAD,
    TOOLREG_EXTRAS,
    Server,
    Unavailable,
    definition,
    server,
    summary,
)
from sandbox_runner import SAFE_LIMITS, SandboxSpec
from sandbox_runner.docker_backend import DockerBackend
from sandbox_runner.spec import INIT_BINARY

WARM_POOL = 4  # warm_pool registered for the warm rows
LLM_POOL = 4  # llm-sandbox pool size, the same
SETTLE_TIMEOUT_S = 5.0  # seconds to wait for a pool to refill between rounds
BURST_PAUSE_S = 2.0  # seconds between bursts: the last one's removals and refills finish

SDK_DEFAULT = "docker SDK cycle"
SDK_TOOLREG = "docker SDK cycle, toolreg's container config"
RUNNER = "sandbox_runner.run in-process (no gRPC)"
COLD = "toolreg ExecuteTool cold"
WARM = f"toolreg ExecuteTool warm_pool={WARM_POOL}"
RUNSC = "toolreg ExecuteTool runsc + approval token"
RUNSC_WARM = f"toolreg ExecuteTool runsc + approval token, warm_pool={WARM_POOL}"
EPICBOX = "epicbox run"
LLM_SESSION = "llm-sandbox session per call"
LLM_POOLED = f"llm-sandbox pooled ({LLM_POOL})"
LLM_POOLED_SINGLE = f"llm-sandbox pooled ({LLM_POOL}), single-use"


def runner_call(runner: DockerBackend) -> Callable[[], bytes]:
    spec = SandboxSpec(
        image=IMAGE, command=tuple(COMMAND), env=(), limits=SAFE_LIMITS, input=PAYLOAD
    )

    def run() -> bytes:
        return runner.run(spec, execution_id=uuid.uuid4().hex).stdout

    return run


def toolreg_methods(srv: Server, expected_running: Callable[[], int]) -> list[Method]:
    srv.register(definition("bench_echo"))
    srv.register(definition("bench_echo_warm", warm_pool=WARM_POOL))
    srv.register(definition("bench_echo_runsc", level="dangerous"))
    srv.register(definition("bench_echo_runsc_warm", level="dangerous", warm_pool=WARM_POOL))

    def settle() -> None:
        srv.settle_after_call(expected_running(), SETTLE_TIMEOUT_S)

    def plain(name: str) -> Callable[[], bytes]:
        return functools.partial(srv.run, name)

    def approved(name: str) -> tuple[Callable[[], None], Callable[[], bytes]]:
        minter = srv.token_minter(name)
        token: list[str] = []

        def before() -> None:  # an approver's signature is not the server's time
            token[:] = [minter()]

        return before, functools.partial(srv.run, name, token)

    runsc_before, runsc_call = approved("bench_echo_runsc")
    runsc_warm_before, runsc_warm_call = approved("bench_echo_runsc_warm")
    gate = "dangerous: gVisor, 128 MiB/0.5 CPU; timed incl. token verification + jti write"
    return [
        Method(COLD, "toolreg", plain("bench_echo"), "gRPC over loopback, safe tool"),
        Method(WARM, "toolreg", plain("bench_echo_warm"), "registered warm_pool", after=settle),
        Method(RUNSC, "toolreg", runsc_call, gate, before=runsc_before),
        Method(
            RUNSC_WARM, "toolreg", runsc_warm_call, gate, before=runsc_warm_before, after=settle
        ),
    ]


def run(runs: int, warmup: int, run_id: str, engine: docker.DockerClient) -> dict[str, Any]:
    methods: list[Method] = []
    unavailable: dict[str, str] = {}

    def add(name: str, factory: Callable[[], Method]) -> None:
        try:
            methods.append(factory())
        except Unavailable as exc:
            unavailable[name] = str(exc)
        except Exception as exc:  # a library that breaks here is a finding, not a crash
            unavailable[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    client = docker.from_env(max_pool_size=4)
    # The real configuration: every container held by the init until its call (make init).
    runner = DockerBackend(instance_id=f"bench-{run_id}", init_path=INIT_BINARY)
    with server(engine) as srv:
        add("docker run --rm", lambda: baselines.docker_run(run_id))
        add(
            SDK_DEFAULT,
            lambda: Method(
                SDK_DEFAULT,
                "baseline",
                baselines.sdk_cycle(client, {}, run_id),
                "same isolation flags",
            ),
        )
        add(
            SDK_TOOLREG,
            lambda: Method(
                SDK_TOOLREG,
                "baseline",
                baselines.sdk_cycle(client, TOOLREG_EXTRAS, run_id),
                "+ NetworkDisabled, log none, ipc none, ulimits",
            ),
        )
        add(EPICBOX, baselines.epicbox_run)
        add(LLM_SESSION, lambda: baselines.llm_sandbox_session(engine, run_id))
        add(
            LLM_POOLED,
            lambda: baselines.llm_sandbox_pooled(engine, run_id, size=LLM_POOL, single_use=False),
        )
        add(
            LLM_POOLED_SINGLE,
            lambda: baselines.llm_sandbox_pooled(engine, run_id, size=LLM_POOL, single_use=True),
        )
        add(RUNNER, lambda: Method(RUNNER, "toolreg", runner_call(runner), "no server"))
        steady = [0]
        try:
            methods.extend(toolreg_methods(srv, lambda: steady[0]))
        except Exception as exc:
            unavailable["toolreg ExecuteTool"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        # What the server keeps running when idle: its warm containers.
        steady[0] = srv.steady_count()
        print(f"latency: server holds {steady[0]} idle warm containers", flush=True)
        try:
            samples = _measure(methods, runs, warmup, unavailable)
            burst = _burst(srv, steady[0], max(10, runs // 3)) if WARM in samples else {}
        finally:
            for m in methods:
                m.close()
            runner.close()
            client.close()
    warm_seen = steady[0]
    rows = _rows(methods, samples)
    return {
        "runs": runs,
        "warmup": warmup,
        "rows": rows,
        "unavailable": unavailable,
        "warm_containers_idle": warm_seen,
        "burst": burst,
        "leftover_server_containers": srv.leftovers,
        "samples_ms": {k: [round(v, 3) for v in vals] for k, vals in samples.items()},
    }


def _measure(
    methods: list[Method], runs: int, warmup: int, unavailable: dict[str, str]
) -> dict[str, list[float]]:
    live = list(methods)
    for m in list(live):  # warm-up also proves each method returns the payload
        try:
            for _ in range(warmup):
                out = _once(m)[1]
            if out.strip() != PAYLOAD:
                raise RuntimeError(f"returned {out[:200]!r}, expected {PAYLOAD!r}")
        except Exception as exc:
            unavailable[m.name] = f"failed in warm-up: {type(exc).__name__}: {exc}"
            live.remove(m)
    samples: dict[str, list[float]] = {m.name: [] for m in live}
    errors: dict[str, int] = {}
    started = time.monotonic()
    for i in range(runs):  # interleaved: noise hits every method alike
        for m in live:
            try:
                ms, _ = _once(m)
                samples[m.name].append(ms)
            except Exception as exc:
                errors[m.name] = errors.get(m.name, 0) + 1
                print(f"latency: {m.name}: {type(exc).__name__}: {exc}", flush=True)
        if i % 10 == 9:
            print(f"latency: {i + 1}/{runs} rounds, {time.monotonic() - started:.0f} s", flush=True)
    for name, count in errors.items():
        unavailable.setdefault(f"{name} (errors)", f"{count} of {runs} calls failed")
    return samples


def _burst(srv: Server, steady: int, bursts: int) -> dict[str, Any]:
    """``bursts`` times: WARM_POOL calls of the warm tool at once, from a full pool
    (the pool absorbs a burst of its size; refills then run in the background)."""
    latencies: list[float] = []
    for _ in range(bursts):
        # Running containers include used ones still being removed: give the removals
        # and refills of the last burst time, then wait for the pools to be full.
        time.sleep(BURST_PAUSE_S)
        srv.settle(steady, SETTLE_TIMEOUT_S)
        start = threading.Barrier(WARM_POOL)
        got: list[float] = []

        def call(start: threading.Barrier = start, got: list[float] = got) -> None:
            start.wait()
            t0 = time.perf_counter()
            srv.run("bench_echo_warm")
            got.append((time.perf_counter() - t0) * 1000)

        threads = [threading.Thread(target=call) for _ in range(WARM_POOL)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        latencies += got
    return {"bursts": bursts, "size": WARM_POOL, "calls": len(latencies), **summary(latencies)}


def _once(m: Method) -> tuple[float, bytes]:
    if m.before:
        m.before()
    t0 = time.perf_counter()
    out = m.call()
    ms = (time.perf_counter() - t0) * 1000
    if m.after:
        m.after()
    return ms, out


def _rows(methods: list[Method], samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    def p50(name: str) -> float | None:
        vals = samples.get(name)
        return statistics.median(vals) if vals else None

    sdk, sdk_t = p50(SDK_DEFAULT), p50(SDK_TOOLREG)
    rows = []
    for m in methods:
        vals = samples.get(m.name)
        if not vals:
            continue
        row: dict[str, Any] = {"method": m.name, "group": m.group, "runs": len(vals)}
        row.update(summary(vals))
        row["vs_sdk"] = round(row["p50_ms"] / sdk, 3) if sdk else None
        row["vs_sdk_toolreg"] = round(row["p50_ms"] / sdk_t, 3) if sdk_t else None
        row["note"] = m.note
        rows.append(row)
    return rows

"""A call's arguments checked away from the server's own threads when they are
large (docs/explanation/speed.md, "Large arguments share the CPU").

Parsing, JSON-Schema validation, canonical JSON and a tool's guards over a
megabyte of arguments are CPU work, and in Python much of it holds the
interpreter's lock for milliseconds at a stretch (one RE2 scan of a guard over
1 MiB: about 15 ms). Done on gRPC's threads, every other client's request
waits for that lock behind it, however fair the queueing. So a heavy call's
checks run in a worker process (a small pool, started on the first heavy
call), after the call got its turn from the fair gate (``heavy_gate.py``);
the server's process keeps only the handing over.

What a worker does, ``check_call``, is the same code a light call runs in
the server's process: the tool's schema and guards are the registrant's
(untrusted), and a worker has nothing else of the server's (no store, no
policy, no keys). The policy's own conditions (deny and approval rules)
still run in the server, within the caller's turn.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from registry_server.domain.arguments import ParsedArguments, parse_arguments, utf8_size_over
from registry_server.domain.errors import ErrorCode, InvalidArgument, ToolregError
from registry_server.domain.models import ToolDefinition
from registry_server.execution.heavy_gate import HeavyGate
from registry_server.policy.call_facts import guard_fields
from registry_server.policy.conditions import CallFacts, Scope, compile_condition, first_failing

log = logging.getLogger(__name__)

# Seconds one call's checks may take in a worker. The caps on arguments and
# on guards' cost keep a call's checks under a second; a worker still busy
# after this is stuck, and the pool is replaced (that call fails closed).
WORK_TIMEOUT_S = 60.0
GUARD_READS = frozenset({"args"})  # what a guard may read (Scope.GUARD)
DEFAULT_THRESHOLD_BYTES = 64 * 1024  # bytes of arguments JSON above which a call is heavy


class HeavyWorkFailed(ToolregError):
    """A worker died or hung checking a call: the call is refused (its checks
    never passed), and the next heavy call gets a new pool."""

    code = ErrorCode.UNAVAILABLE


@dataclass(frozen=True)
class Checked:
    """What the checks of one call's arguments found, in that order: the
    arguments unusable (``invalid``: the INVALID_ARGUMENTS text), a guard
    refusing (its message), or neither."""

    arguments: ParsedArguments | None
    invalid: str = ""
    guard_failed: str | None = None


def check_call(tool: ToolDefinition, arguments_json: str) -> Checked:
    """Parse and validate the arguments, then the tool's guards over them."""
    try:
        arguments = parse_arguments(tool, arguments_json)
    except InvalidArgument as exc:
        return Checked(None, invalid=exc.message)
    return Checked(arguments, guard_failed=failing_guard(tool, arguments.value))


def failing_guard(tool: ToolDefinition, args: dict[str, Any]) -> str | None:
    """The message of the first of the tool's guards that refuses ``args``."""
    if not tool.guards:
        return None
    conditions = tuple(g.condition for g in tool.guards)
    guards = [(compile_condition(g.condition, Scope.GUARD), g.message) for g in tool.guards]
    facts = CallFacts(args, reads=GUARD_READS, arg_fields=guard_fields(conditions))
    return first_failing(guards, facts)


def default_workers() -> int:
    """One fewer than the CPUs this server may run on, at least one: a CPU is
    left to the server's own threads, so light calls keep theirs while every
    worker is busy (measured: docs/explanation/speed.md)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) - 1)


def _worker_started() -> None:
    # The server handles ^C and SIGTERM and shuts the pool down itself; a
    # terminal's ^C reaching the whole process group must not kill a worker
    # mid-call (its caller would get a failure instead of the shutdown's grace).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Workers:
    """``size`` worker processes, started when first needed (a server whose
    calls are all small never starts one). Spawned, never forked: the server
    runs gRPC's threads, which a fork would copy in an unknown state."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def _current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise HeavyWorkFailed("the server is stopping")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.size,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_started,
                )
            return self._pool

    def check(self, tool: ToolDefinition, arguments_json: str) -> Checked:
        """The call's checks, by a worker. A pool that breaks (a worker died:
        killed, out of memory, or crashed by what it was checking) is replaced
        and the call tried once more on the new one; broken again, the call
        fails closed (UNAVAILABLE), its checks never passed."""
        for attempt in range(2):
            pool = self._current()
            try:
                return pool.submit(check_call, tool, arguments_json).result(WORK_TIMEOUT_S)
            except BrokenProcessPool:
                self._replace(pool, kill=False)
                log.warning("a worker checking large arguments died; the pool is restarted")
                if attempt:
                    raise HeavyWorkFailed(
                        "the worker checking this call's arguments stopped; retry the call"
                    ) from None
            except FutureTimeout:
                self._replace(pool, kill=True)
                log.warning("a worker checking large arguments hung; the pool is restarted")
                raise HeavyWorkFailed(
                    f"checking this call's arguments took over {WORK_TIMEOUT_S:g} s"
                ) from None
        raise AssertionError("unreachable")

    def _replace(self, pool: ProcessPoolExecutor, kill: bool) -> None:
        with self._lock:
            if self._pool is not pool:
                return  # another call replaced it already
            self._pool = None
        _stop(pool, kill)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool, kill=False, wait=True)


def _stop(pool: ProcessPoolExecutor, kill: bool, wait: bool = False) -> None:
    if kill:
        # No public way to stop a busy worker: the pool's own process table.
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
    pool.shutdown(wait=wait, cancel_futures=True)


class HeavyWork:
    """Which calls are heavy, their turns, and the workers that check them."""

    def __init__(self, gate: HeavyGate, workers: Workers, threshold_bytes: int) -> None:
        self.gate = gate
        self.workers = workers
        self.threshold_bytes = threshold_bytes

    def is_heavy(self, arguments_json: str) -> bool:
        """Whether the arguments' UTF-8 exceeds the threshold (found in O(1)
        for ASCII and for texts far from it)."""
        return utf8_size_over(arguments_json, self.threshold_bytes)

    def close(self) -> None:
        self.workers.close()

"""Warm pools: containers created and started ahead of time, each waiting for
the input of exactly one call.

A warm container runs only the sandbox init, blocked until a call hands it the
go signal: the tool's own command never starts before its call is admitted
and approved. A call takes one, hands it its arguments and sees it through; the
container is then removed like any other. It is never reused, so nothing leaks
from one call to the next: the pool only moves the engine's create, attach and
start off the call's critical path.

Every warm container holds a reservation in the server's sandbox budget
(``Admission``), taken only when no call waits; a call that needs room while
warm containers hold it gets one back (``evict_one``). Tools whose sandbox
gets host mounts (the workspace) are never pooled: a mount is given only to a
call that was approved.

A tool with egress is pooled on networks of its own (one per container,
removed with it), each container holding a proxy token the egress proxy does
not know: the call's grants (allow-list, injected headers, caps, from the
policy in force at the call) are bound to the container it takes and told to
the proxy only when the call is released (``SandboxPlanner.warm_spec``,
``unbound``). A container discarded unused was never registered at all.

A background worker refills each pool, recycles containers older than the
maximum age, and backs off when the engine cannot make more; callers then
take the cold path, and the log and counters say so.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from registry_server.domain.models import ToolDefinition
from registry_server.execution.admission import Admission, Reservation
from registry_server.execution.sandbox_plan import unbound
from sandbox_runner import PreparedSandbox, SandboxBackend, SandboxError, SandboxSpec, after_call

log = logging.getLogger(__name__)

DEFAULT_MAX_WARM = 16  # warm containers across all tools
DEFAULT_MAX_AGE_S = 300.0  # seconds a warm container may wait before it is replaced
MAX_AGE_LIMIT_S = 3600.0  # seconds: the longest an operator may let one wait
REFILL_BACKOFF_S = 5.0  # seconds to wait after the engine refused to make one
NO_ROOM_RETRY_S = 0.5  # seconds before asking the sandbox budget for room again
WORKER_TICK_S = 1.0  # seconds between the worker's checks when nothing happens

SpecFor = Callable[[ToolDefinition], SandboxSpec | None]


@dataclass(eq=False)
class WarmSandbox:
    """A started container waiting for its call, and the room it holds."""

    prepared: PreparedSandbox
    reservation: Reservation

    @property
    def container_id(self) -> str:
        return self.prepared.container_id


@dataclass
class _Pool:
    tool: ToolDefinition
    spec: SandboxSpec  # what every container of this pool was made from (input empty)
    size: int
    ready: collections.deque[WarmSandbox] = field(default_factory=collections.deque)
    refill_after: float = 0.0  # monotonic time before which refills are not tried
    engine_failing: bool = False  # the last refill failed in the engine (not for room)
    # Why the last refill failed: the same reason again (a preload that does not
    # import fails every refill) is not logged again until a refill succeeds.
    last_failure: str = ""
    # Monotonic time a call first took from a full pool (0: full). Refills yield to
    # calls in flight for at most after_call.YIELD_S from then, not from each refill:
    # under sustained load the pool never fills, and each refill must not wait again.
    short_since: float = 0.0


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0  # calls that found the pool empty and went cold
    refill_failures: int = 0
    recycled: int = 0  # removed unused: too old, dead, drained
    warm: dict[str, int] = field(default_factory=dict)


def _without_input(spec: SandboxSpec) -> SandboxSpec:
    return dataclasses.replace(spec, input=b"")


class WarmPools:
    def __init__(
        self,
        backend: SandboxBackend,
        spec_for: SpecFor,
        admission: Admission,
        *,
        default_size: int = 0,
        max_total: int = DEFAULT_MAX_WARM,
        max_age_s: float = DEFAULT_MAX_AGE_S,
    ) -> None:
        if not 0 < max_age_s <= MAX_AGE_LIMIT_S:
            raise ValueError(f"max_age_s must be in (0, {MAX_AGE_LIMIT_S}] seconds")
        self._backend = backend
        self._spec_for = spec_for
        self._admission = admission
        self._default_size = default_size
        self._max_total = max_total
        self._max_age_s = max_age_s
        self._pools: dict[str, _Pool] = {}
        self._cond = threading.Condition()
        self._stats = PoolStats()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="warm-pool", daemon=True)
        self._worker.start()
        admission.on_pressure(self.evict_one)

    # -- what to keep warm -----------------------------------------------------------

    def size_for(self, tool: ToolDefinition) -> int:
        """How many to keep warm: none of a disabled tool (its calls are refused)."""
        return 0 if tool.disabled else tool.warm_pool or self._default_size

    def track(self, tool: ToolDefinition) -> None:
        """Keep ``tool`` warm as its definition says (replacing any older pool of
        the same name: its containers were made from the old definition)."""
        size = self.size_for(tool)
        spec = self._spec_for(tool) if size > 0 else None
        if spec is not None and spec.mounts:
            log.info("%s is not pooled: host mounts go only to approved calls", tool.name)
            spec = None
        with self._cond:
            old = self._pools.pop(tool.name, None)
            if spec is not None:
                self._pools[tool.name] = _Pool(tool, _without_input(spec), size)
            self._cond.notify_all()
        if old is not None:
            self._discard_all(old.ready)

    def untrack(self, name: str) -> None:
        """Keep nothing warm for ``name`` any more, and remove what is (the tool
        was deleted). A call that already took one of its containers finishes."""
        with self._cond:
            old = self._pools.pop(name, None)
        if old is not None:
            self._discard_all(old.ready)

    def on_change(self, old: ToolDefinition | None, new: ToolDefinition | None) -> None:
        """Registry listener: a tool created, replaced, deleted, disabled or
        enabled. A deleted or disabled tool's pool is drained at once."""
        if new is None:
            if old is not None:
                self.untrack(old.name)
            return
        self.track(new)

    # -- the call's side ---------------------------------------------------------------

    def take(
        self, tool: ToolDefinition, spec: SandboxSpec, execution_id: str
    ) -> WarmSandbox | None:
        """A warm container made from exactly this tool and spec, or None. The
        caller claims its reservation (``Admission.claim``) for the call. With
        egress, the containers are made ``unbound`` and compared so; the one
        taken is bound to this call's grants (registered at the proxy when
        the call releases it)."""
        wanted = unbound(_without_input(spec))
        stale: list[WarmSandbox] = []
        found: WarmSandbox | None = None
        with self._cond:
            pool = self._pools.get(tool.name)
            if pool is None:
                return None
            if pool.tool.digest != tool.digest or pool.spec != wanted:
                self._stats.misses += 1
                return None
            while pool.ready:
                candidate = pool.ready.popleft()
                if candidate.prepared.alive() and not self._too_old(candidate):
                    found = candidate
                    pool.short_since = pool.short_since or time.monotonic()
                    break
                stale.append(candidate)
            if found is None:
                self._stats.misses += 1
                if pool.engine_failing:
                    log.info("warm pool of %s cannot refill; running cold", tool.name)
            else:
                self._stats.hits += 1
            if found is None:
                self._cond.notify_all()  # nothing to compete with: refill now
        self._discard_all(stale)
        if found is not None and spec.egress is not None:
            try:
                found.prepared.bind_egress(spec.egress, execution_id or found.container_id)
            except SandboxError as exc:
                log.warning("warm container of %s does not fit its call: %s", tool.name, exc)
                self._discard_all([found])
                return None
        return found

    def discard(self, warm: WarmSandbox) -> None:
        """A taken container its call could not use (its client hit a cap
        meanwhile): removed, never handed to another call."""
        self._discard_all([warm])

    def evict_one(self) -> bool:
        """Give back the room of the oldest warm container (a call needs it)."""
        with self._cond:
            pools = [p for p in self._pools.values() if p.ready]
            if not pools:
                return False
            oldest = min(pools, key=lambda p: p.ready[0].prepared.created)
            victim = oldest.ready.popleft()
            # Not refilled until the sandbox budget has room with no call waiting.
            oldest.refill_after = time.monotonic() + NO_ROOM_RETRY_S
        self._discard_all([victim])
        return True

    def call_done(self) -> None:
        """A call that took a warm container has finished: refill now. (Refilling
        while the call runs would compete with it for the engine and the CPUs.)"""
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> PoolStats:
        with self._cond:
            return dataclasses.replace(
                self._stats, warm={name: len(p.ready) for name, p in self._pools.items()}
            )

    def close(self) -> None:
        """Stop refilling and remove every warm container."""
        with self._cond:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
            self._cond.notify_all()
        self._worker.join(timeout=30)
        for pool in pools:
            self._discard_all(pool.ready)

    # -- the worker --------------------------------------------------------------------

    def _too_old(self, warm: WarmSandbox) -> bool:
        return time.monotonic() - warm.prepared.created > self._max_age_s

    def _discard_all(self, warm: collections.abc.Iterable[WarmSandbox]) -> None:
        for item in list(warm):
            item.prepared.discard()
            self._admission.release(item.reservation)
            with self._cond:
                self._stats.recycled += 1

    def _next_job(self) -> _Pool | None:
        """The pool that most needs one more container, within the caps."""
        now = time.monotonic()
        total = sum(len(p.ready) for p in self._pools.values())
        if total >= self._max_total:
            return None
        needy = [p for p in self._pools.values() if len(p.ready) < p.size and now >= p.refill_after]
        return min(needy, key=lambda p: len(p.ready) / p.size, default=None)

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                expired = self._collect_expired()
                job = self._next_job()
                if job is None and not expired:
                    self._cond.wait(WORKER_TICK_S)
                    continue
            self._discard_all(expired)
            if job is not None:
                self._refill_one(job)

    def _collect_expired(self) -> list[WarmSandbox]:
        out: list[WarmSandbox] = []
        for pool in self._pools.values():
            keep = collections.deque(p for p in pool.ready if not self._too_old(p))
            out += [p for p in pool.ready if p not in keep]
            pool.ready = keep
        return out

    def _refill_one(self, pool: _Pool) -> None:
        after_call.yield_to_calls(pool.short_since or time.monotonic())  # calls go first
        reservation = self._admission.reserve(pool.spec.limits.memory_mb)
        if reservation is None:
            with self._cond:  # calls come first; try again shortly
                pool.refill_after = time.monotonic() + NO_ROOM_RETRY_S
            return
        try:
            prepared = self._backend.prepare(
                pool.spec, execution_id=f"warm-{uuid.uuid4().hex}", lifetime_s=self._max_age_s
            )
        except Exception as exc:  # whatever it is, the worker must live on
            # SandboxError is the engine's; anything else (a spec the backend
            # refuses) is logged the same way: never kill the worker, never
            # keep the room.
            self._admission.release(reservation)
            level = logging.DEBUG if str(exc) == pool.last_failure else logging.WARNING
            log.log(
                level,
                "warm pool of %s cannot refill (calls run cold meanwhile): %s",
                pool.tool.name,
                exc,
            )
            with self._cond:
                pool.last_failure = str(exc)
                self._stats.refill_failures += 1
                pool.refill_after = time.monotonic() + REFILL_BACKOFF_S
                pool.engine_failing = True
            return
        warm = WarmSandbox(prepared, reservation)
        with self._cond:
            current = self._pools.get(pool.tool.name)
            if current is pool and not self._closed:
                pool.ready.append(warm)
                pool.refill_after, pool.engine_failing, pool.last_failure = 0.0, False, ""
                if len(pool.ready) >= pool.size:
                    pool.short_since = 0.0
                return
        self._discard_all([warm])  # the tool was replaced or the server is closing meanwhile

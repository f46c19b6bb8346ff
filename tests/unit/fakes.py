"""A fake sandbox backend: ``FakeBackend`` implements the ``SandboxBackend``
protocol of sandbox_runner/backend.py (and ``FakePrepared`` the
``PreparedSandbox`` protocol) in plain Python, with no engine, no container and
no process behind it.

For unit tests of pure logic only (the executor's steps, the warm pools,
admission): it proves nothing about isolation, limits or the Docker backend,
which the docker tier tests against a real engine.

What it does:

* records every call: the specs prepared (``prepared_specs``) and run
  (``ran``), the inputs handed to ``finish`` (``finished_inputs``), the
  sandboxes discarded (``discarded_ids``) and removed (``removed``), and the
  order of calls by method name (``calls``);
* answers ``finish`` and ``run`` with scripted ``SandboxResult``s
  (``queue_result``, one per call in order, or ``respond`` for a function of
  spec and input); by default exit 0 with stdout echoing the input;
* fails ``prepare`` on request (``fail_prepare``) with ``SandboxError`` or
  ``EngineUnavailable``, once, a few times or until ``stop_failing``;
* reports the runtimes it is given (``available_runtimes``), each with the
  arguments in ``runtime_args`` (none unless given), or fails to;
* lets a test mark a prepared sandbox dead (``kill``): ``alive()`` is then
  False and ``finish`` raises SandboxError, as a container gone meanwhile;
* runs hooks at ``prepare`` and ``finish`` (``on_prepare``, ``on_finish``),
  so a test can cancel, block or race at exactly that point.

Like the Docker backend's sandbox, a ``FakePrepared`` is used once: finishing
it twice, or after a discard, raises RuntimeError; a discard after use does
nothing (``discard_calls`` still counts it). Limits are not enforced: a
scripted result says what happened. Thread-safe (the warm pools' worker
prepares on its own thread).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable

from sandbox_runner import OutputSink, SandboxError, SandboxResult, SandboxSpec
from sandbox_runner.spec import EgressSpec

__all__ = ["FakeBackend", "FakePrepared", "result"]

DEFAULT_RUNTIMES = frozenset({"runc"})
ResultFor = Callable[[SandboxSpec, bytes], SandboxResult]


def result(
    *,
    exit_code: int | None = 0,
    stdout: bytes = b"",
    stderr: bytes = b"",
    duration_ms: int = 1,
    timed_out: bool = False,
    oom_killed: bool = False,
    pids_exhausted: bool = False,
    output_truncated: bool = False,
    cancelled: bool = False,
    container_id: str = "",
) -> SandboxResult:
    """A SandboxResult with quiet defaults: exit 0, no output, nothing hit."""
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        duration_ms=duration_ms,
        timed_out=timed_out,
        oom_killed=oom_killed,
        pids_exhausted=pids_exhausted,
        output_truncated=output_truncated,
        container_id=container_id,
        cancelled=cancelled,
    )


class FakePrepared:
    """One prepared sandbox: waits for ``finish`` or ``discard``, used once."""

    def __init__(
        self, backend: FakeBackend, spec: SandboxSpec, execution_id: str, lifetime_s: float,
        container_id: str,
    ) -> None:  # fmt: skip
        self._backend = backend
        self.spec = spec
        self.execution_id = execution_id
        self.lifetime_s = lifetime_s
        self.container_id = container_id
        self.created = time.monotonic()  # tests may set it back to age the sandbox
        self.dead = False  # set by FakeBackend.kill
        self.finished_input: bytes | None = None  # what finish was handed
        self.finish_deadline: float | None = None
        self.finish_cancel: threading.Event | None = None
        self.discarded = False  # a discard removed it unused
        self.discard_calls = 0
        self.bound_egress: tuple[EgressSpec | None, str] | None = None  # bind_egress's
        self._lock = threading.Lock()

    @property
    def used(self) -> bool:
        """Finished or discarded: it can never run a call again."""
        return self.finished_input is not None or self.discarded

    def alive(self) -> bool:
        with self._lock:
            return not self.dead and not self.used

    def bind_egress(self, egress: EgressSpec | None, execution_id: str) -> None:
        """The protocol's hand-over of a call's egress grants: kept for tests to read."""
        self.bound_egress = (egress, execution_id)

    def finish(
        self,
        input_bytes: bytes,
        deadline: float | None = None,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        with self._lock:
            if self.used:
                how = "finished" if self.finished_input is not None else "discarded"
                raise RuntimeError(f"sandbox {self.container_id} was already {how}")
            self.finished_input = input_bytes
            self.finish_deadline = deadline
            self.finish_cancel = cancel
        self._backend._note("finish", finished=input_bytes)
        if self._backend.on_finish is not None:
            self._backend.on_finish(self)
        if self.dead:
            raise SandboxError(f"container {self.container_id} is gone")
        out = self._backend._result_for(self.spec, input_bytes, self.container_id, cancel)
        if on_output is not None:
            for stream, data in (("stdout", out.stdout), ("stderr", out.stderr)):
                if data:
                    on_output(stream, data)
        return out

    def discard(self) -> None:
        with self._lock:
            self.discard_calls += 1
            if self.used:
                return
            self.discarded = True
        self._backend._note("discard", discarded=self.container_id)


class FakeBackend:
    """A SandboxBackend that records calls and answers from a script."""

    def __init__(
        self,
        *,
        runtimes: frozenset[str] = DEFAULT_RUNTIMES,
        respond: ResultFor | None = None,
        volumes: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.available_runtimes = runtimes
        # A runtime's runtimeArgs, as `docker info` reports them (e.g. runsc-net's
        # ("--network=host",)); a runtime not named here has none.
        self.runtime_args: dict[str, tuple[str, ...]] = {}
        self.runtimes_error: SandboxError | None = None  # raised by runtimes() when set
        self.respond = respond  # a result per (spec, input); queued results go first
        self.volumes = dict(volumes or {})  # image -> VOLUME paths; others: ()
        self.healthy = True
        self.on_prepare: Callable[[SandboxSpec], None] | None = None
        self.on_finish: Callable[[FakePrepared], None] | None = None

        self.calls: list[str] = []  # method names, in call order
        self.prepared: list[FakePrepared] = []  # every sandbox prepare returned
        self.prepare_attempts = 0  # including the failed ones
        self.prepare_lifetimes: list[float] = []
        self.ran: list[SandboxSpec] = []  # specs given to run()
        self.finished_inputs: list[bytes] = []  # inputs given to finish(), in order
        self.discarded_ids: list[str] = []  # sandboxes discarded unused, in order
        self.removed: list[str] = []  # ids given to remove()
        self.flushes = 0
        self.closed = False

        self._lock = threading.Lock()
        self._results: deque[SandboxResult] = deque()
        self._prepare_error: Exception | None = None
        self._prepare_failures_left: int | None = 0  # None: until stop_failing
        self._next_id = 0

    # -- scripting -------------------------------------------------------------------

    def queue_result(self, scripted: SandboxResult) -> None:
        """The next finish/run answers ``scripted`` (build it with ``result``);
        its container_id becomes the sandbox's own."""
        with self._lock:
            self._results.append(scripted)

    def fail_prepare(self, error: Exception, *, times: int | None = 1) -> None:
        """The next ``times`` prepares raise ``error`` (None: every one until
        ``stop_failing``)."""
        with self._lock:
            self._prepare_error = error
            self._prepare_failures_left = times

    def stop_failing(self) -> None:
        with self._lock:
            self._prepare_error = None
            self._prepare_failures_left = 0

    def kill(self, container_id: str) -> None:
        """The sandbox died while waiting: alive() is False from now on."""
        self.sandbox(container_id).dead = True

    def sandbox(self, container_id: str) -> FakePrepared:
        with self._lock:
            for prepared in self.prepared:
                if prepared.container_id == container_id:
                    return prepared
        raise KeyError(container_id)

    @property
    def prepared_specs(self) -> list[SandboxSpec]:
        with self._lock:
            return [p.spec for p in self.prepared]

    # -- SandboxBackend --------------------------------------------------------------

    def run(
        self,
        spec: SandboxSpec,
        *,
        execution_id: str,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        with self._lock:
            self.calls.append("run")
            self.ran.append(spec)
            container_id = self._new_id()
        out = self._result_for(spec, spec.input, container_id, cancel)
        if on_output is not None:
            for stream, data in (("stdout", out.stdout), ("stderr", out.stderr)):
                if data:
                    on_output(stream, data)
        return out

    def prepare(
        self, spec: SandboxSpec, *, execution_id: str, lifetime_s: float = 0
    ) -> FakePrepared:
        with self._lock:
            self.calls.append("prepare")
            self.prepare_attempts += 1
            error = self._prepare_error
            if error is not None and self._prepare_failures_left is not None:
                self._prepare_failures_left -= 1
                if self._prepare_failures_left <= 0:
                    self._prepare_error = None
        if self.on_prepare is not None:
            self.on_prepare(spec)
        if error is not None:
            raise error
        with self._lock:
            prepared = FakePrepared(self, spec, execution_id, lifetime_s, self._new_id())
            self.prepared.append(prepared)
            self.prepare_lifetimes.append(lifetime_s)
        return prepared

    def health(self) -> bool:
        self._note("health")
        return self.healthy

    def remove(self, container_id: str) -> None:
        with self._lock:
            self.calls.append("remove")
            self.removed.append(container_id)

    def flush(self) -> None:
        with self._lock:
            self.calls.append("flush")
            self.flushes += 1

    def close(self) -> None:
        with self._lock:
            self.calls.append("close")
            self.closed = True

    def runtimes(self) -> dict[str, tuple[str, ...]]:
        self._note("runtimes")
        if self.runtimes_error is not None:
            raise self.runtimes_error
        return {name: self.runtime_args.get(name, ()) for name in self.available_runtimes}

    def image_volumes(self, image: str) -> tuple[str, ...] | None:
        self._note("image_volumes")
        return self.volumes.get(image, ())

    def retry_removals(self) -> int:
        self._note("retry_removals")
        return 0

    def reap(self) -> int:
        self._note("reap")
        return 0

    # -- internals ---------------------------------------------------------------------

    def _new_id(self) -> str:
        self._next_id += 1  # under self._lock
        return f"fake-{self._next_id:04d}"

    def _note(self, call: str, *, finished: bytes | None = None, discarded: str = "") -> None:
        with self._lock:
            self.calls.append(call)
            if finished is not None:
                self.finished_inputs.append(finished)
            if discarded:
                self.discarded_ids.append(discarded)

    def _result_for(
        self, spec: SandboxSpec, input_bytes: bytes, container_id: str,
        cancel: threading.Event | None,
    ) -> SandboxResult:  # fmt: skip
        with self._lock:
            scripted = self._results.popleft() if self._results else None
        if scripted is None and self.respond is not None:
            scripted = self.respond(spec, input_bytes)
        if scripted is None:
            scripted = result(stdout=input_bytes)
        cancelled = scripted.cancelled or (cancel is not None and cancel.is_set())
        return dataclasses.replace(scripted, container_id=container_id, cancelled=cancelled)

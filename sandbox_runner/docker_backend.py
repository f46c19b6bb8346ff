"""The Docker Engine backend: the only module that imports `docker`.

One execution costs five engine round trips: create, attach, start, inspect, remove (and
an image inspect per image at most every IMAGE_FACTS_TTL_S, for the checks before create).
Input and output travel over the single attach connection (hijacked HTTP), read and
written with poll() so the wall-clock deadline, the caller's cancel event and the output
caps are enforced by this thread while the tool runs, without helper threads.

With an init (``DockerBackend(init_path=...)``, built by ``make init`` from
init/toolreg_init.c), every container's process is that init, bind-mounted read-only at
INIT_TARGET; it holds the tool until ``Prepared.finish`` sends SIZED_GO_BYTE ahead of the
call's input (and its length), so a container started ahead of its call (warm pools) runs
nothing of the tool before the call is admitted and approved. The init then runs the tool
(its process was forked while it waited: only the exec is left), hands it the input
through a pipe it closes after the input's last byte, and sends its output and exit
status as frames (protocol v3): the call is answered on the exit frame, without waiting
for the engine to notice the exit or inspecting the container.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import posixpath
import queue
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import docker
import docker.errors
import docker.types
import requests.exceptions

from . import after_call
from .backend import OutputSink
from .egress.gateway import (
    LABEL_EGRESS_NETWORK,
    UNROUTABLE_DNS,
    EgressCall,
    EgressConfig,
    EgressGateway,
)
from .framing import (
    INIT_EXIT,
    INIT_FAILED,
    INIT_HELLO,
    INIT_READY,
    STDERR,
    STDOUT,
    CappedBuffer,
    FrameDemuxer,
    FramingError,
    InitDecoder,
    InitExit,
)
from .ownership import (
    LABEL_DEADLINE,
    LABEL_EXECUTION_ID,
    LABEL_INSTANCE,
    LABEL_MANAGED,
    RESERVED_LABELS,
    OwnerIdentity,
    orphan_reason,
)
from .pieces import engine_fix, images_fix, init_fix, init_problem
from .profiles import GVISOR_NET, GVISOR_RUNTIMES
from .spec import (
    INIT_BINARY,
    EgressConnection,
    EgressSpec,
    EngineUnavailable,
    SandboxError,
    SandboxResult,
    SandboxSpec,
)
from .tracing import SANDBOX_REMOVE, TOOL_RUN, within_call
from .warm_interpreter import stub_command

__all__ = [
    "EXIT_FRAME",
    "FIRST_OUTPUT",
    "GO_BYTE",
    "GO_SENT",
    "INIT_BINARY",
    "INIT_NOT_RELEASED_EXIT",
    "INIT_PROTOCOL",
    "INIT_TARGET",
    "NETSTACK_UNSUPPORTED",
    "SIZED_GO_BYTE",
    "DockerBackend",
    "EngineFacts",
    "Prepared",
    "probe_engine",
    "runtimes_of",
]

log = logging.getLogger(__name__)

RECV_BYTES: Final = 64 * 1024  # bytes per socket read
SEND_BYTES: Final = 64 * 1024  # bytes per socket write of stdin
CANCEL_POLL_S: Final = 0.05  # seconds between checks of the caller's cancel event
KILL_GRACE_S: Final = 5.0  # seconds to wait for the stream to end after SIGKILL
API_TIMEOUT_S: Final = 60  # seconds: HTTP timeout of one engine call (not the tool's)
UNPRIVILEGED_USER: Final = "65534:65534"  # nobody:nogroup
# Runtimes known to reject a pids limit (gVisor enforces its own, and errors on ours):
# both of its runtimes, with and without a network.
NO_PIDS_LIMIT_RUNTIMES: Final = GVISOR_RUNTIMES
# What runsc says when it takes the call's network namespace for the host's. Builds that
# decide so by whether /proc/sys/net/core/rmem_default exists (those before gVisor's
# release-20240801, Debian's 20221219 and 20240729 among them) are wrong on kernels where
# every namespace has it (6.18 here): their netstack never starts there, and the call
# fails before its tool does. scripts/ensure_docker.sh registers runsc-net with hostinet
# (--network=host) there instead.
NETSTACK_UNSUPPORTED: Final = "cannot run with network enabled in root network namespace"

# The init (init/toolreg_init.c). Docker creates the mountpoint in the container's own
# layer, so this works on a read-only root, in a FROM scratch image, under runc and runsc.
INIT_TARGET: Final = "/.toolreg/init"  # in-container path of the init (read-only bind)
PRESTART_FLAG: Final = "--prestart"  # the init execs its program now (warm_interpreter.py)
INIT_PROTOCOL: Final = 3  # version of the init's protocol (init/toolreg_init.c)
GO_BYTE: Final = b"G"  # a first stdin byte that lets the init run the tool on that stdin
# The first stdin byte finish sends: it lets the init run the tool, and a 4-byte
# big-endian length and the input follow; the init closes the tool's stdin after the
# input, not waiting for the engine to (its EOF came 1.8 ms after the input here).
SIZED_GO_BYTE: Final = b"S"
MAX_INPUT_BYTES: Final = 2**32 - 1  # bytes: what the 4-byte length can say
HELLO_TIMEOUT_S: Final = 10.0  # seconds for a started init to say which protocol it speaks
# seconds for a prestarted interpreter (warm_interpreter.py) to import its preloads and
# say it is ready, after the hello (a slow import under half a CPU and gVisor included)
PRESTART_TIMEOUT_S: Final = 30.0
SIGKILL_NUMBER: Final = 9  # a tool killed so may have met the memory limit: ask the engine
INIT_NOT_RELEASED_EXIT: Final = 125  # exit code: the init got EOF/another byte, ran nothing
# Prepared.marks: the go byte and input sent, the first output frame and the exit
# frame received (the last two only with an init).
GO_SENT: Final = "go_sent"
FIRST_OUTPUT: Final = "first_output"
EXIT_FRAME: Final = "exit_frame"
_INIT_DIR: Final = posixpath.dirname(INIT_TARGET)  # reserved: no spec mount may touch it
# The image config is read before each create (VOLUME refusal, ENTRYPOINT); one
# inspect_image costs ~1.3 ms on a local engine (median of 200; 20.10, unix socket).
IMAGE_FACTS_TTL_S: Final = 5.0  # seconds an image's inspected config is reused
IMAGE_FACTS_MAX: Final = 256  # images remembered at most

# Docker's container name rule, minus the prefix we add.
_NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Where a container's pids cgroup lives for the common engine layouts (v1/v2, cgroupfs or
# systemd driver). Readable only when this process runs on the engine's host.
_PIDS_EVENTS_PATHS: Final = (
    "/sys/fs/cgroup/pids/docker/{id}/pids.events",
    "/sys/fs/cgroup/pids/system.slice/docker-{id}.scope/pids.events",
    "/sys/fs/cgroup/docker/{id}/pids.events",
    "/sys/fs/cgroup/system.slice/docker-{id}.scope/pids.events",
)


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(
        exc, requests.exceptions.ConnectionError | ConnectionError | FileNotFoundError
    )


def _image_missing(image: str) -> str:
    return f"image {image!r} not found locally; build the sandbox images: {images_fix()}"


def _unavailable(what: str, e: BaseException) -> str:
    return f"Docker engine unavailable during {what}: {e}; fix: {engine_fix()}"


@contextlib.contextmanager
def _engine_call(what: str, *, image: str | None = None) -> Iterator[None]:
    """Map engine/transport exceptions of one call to SandboxError / EngineUnavailable."""
    try:
        yield
    except SandboxError:
        raise
    except docker.errors.ImageNotFound as e:
        raise SandboxError(
            _image_missing(image) if image else f"{what} failed: {e.explanation or e}"
        ) from e
    except docker.errors.APIError as e:
        raise SandboxError(f"{what} failed: {e.explanation or e}") from e
    except requests.exceptions.RequestException as e:
        if _is_connection_error(e):
            raise EngineUnavailable(_unavailable(what, e)) from e
        raise SandboxError(f"{what} failed: {e}") from e
    except docker.errors.DockerException as e:
        raise SandboxError(f"{what} failed: {e}") from e
    except OSError as e:
        if _is_connection_error(e):
            raise EngineUnavailable(_unavailable(what, e)) from e
        raise SandboxError(f"{what} failed: {e}") from e


@contextlib.contextmanager
def _netstack_hint(runtime: str) -> Iterator[None]:
    """A start that failed on NETSTACK_UNSUPPORTED says what would fix it."""
    try:
        yield
    except SandboxError as e:
        if runtime != GVISOR_NET or NETSTACK_UNSUPPORTED not in str(e):
            raise
        raise SandboxError(
            f"{e} (this runsc cannot give gVisor its own network stack on this kernel:"
            " install runsc from gVisor release-20240801 or later, or run"
            " scripts/ensure_docker.sh, which registers runsc-net with hostinet here:"
            " docs/how-to/deploying.md, 1. The engine)"
        ) from e


# What dockerd says when the container's first process died before its start ended:
# at a small memory limit, the runtime's own `runc init` OOM-killed (moby/moby#41167).
STOPPED_AT_START: Final = "cannot start a stopped process"
SMALL_MEMORY_MB: Final = 64  # MiB: below this a start that fails so is likely the limit


@contextlib.contextmanager
def _small_memory_hint(memory_mb: int) -> Iterator[None]:
    """A start that failed on STOPPED_AT_START at a small memory limit says so."""
    try:
        yield
    except SandboxError as e:
        if memory_mb >= SMALL_MEMORY_MB or STOPPED_AT_START not in str(e):
            raise
        raise SandboxError(
            f"{e} (the sandbox's memory limit, {memory_mb} MiB, is likely too small for the"
            f" container runtime to start it: give the tool at least {SMALL_MEMORY_MB} MiB)"
        ) from e


def runtimes_of(info: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """The runtimes in an engine's `docker info` answer, each with the arguments
    the engine starts it with (its runtimeArgs in daemon.json)."""
    runtimes = info.get("Runtimes") or {}
    return {
        str(name): tuple(str(arg) for arg in (entry or {}).get("runtimeArgs") or ())
        for name, entry in runtimes.items()
    }


def _status(exc: BaseException) -> int | None:
    if isinstance(exc, docker.errors.APIError):
        return exc.status_code
    return None


def _raw_socket(attached: Any) -> socket.socket:
    """The plain socket under the SDK's attach object (SocketIO over unix/tcp)."""
    sock = getattr(attached, "_sock", attached)
    if not isinstance(sock, socket.socket) or hasattr(sock, "getpeercert"):
        # TLS cannot half-close (stdin EOF) and SSH/npipe are not sockets at all.
        raise SandboxError(
            "unsupported Docker transport for attach: use a unix:// or tcp:// engine address"
        )
    return sock


def _checked_init_path(path: str | Path) -> Path:
    """The init as an absolute host path, or ValueError naming what is wrong with it and
    the command that fixes it (pieces.init_problem: the same check `toolreg doctor` runs)."""
    problem = init_problem(path)
    # A file that is not ELF may be a script an engine can still run (tests use them).
    if problem is not None and not problem.not_elf:
        raise ValueError(f"{problem}; fix: {init_fix()}")
    return Path(path).resolve()


def _overlaps_init(target: str) -> bool:
    """True when a mount at `target` would cover the init or lie in its directory."""
    norm = "/" + posixpath.normpath(target).lstrip("/")  # "//x" is "/x" to Docker
    return norm == _INIT_DIR or norm.startswith(_INIT_DIR + "/") or _INIT_DIR.startswith(norm + "/")


# A container to remove: when it was asked for (monotonic), the caller's context,
# the engine's API, the container and the call's egress (network, secret files)
# to release after it.
_Removal = tuple[float, contextvars.Context, Any, str, "EgressCall | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class _ImageFacts:
    """What prepare() needs from a local image's config."""

    volumes: tuple[str, ...]  # VOLUME paths it declares, sorted
    entrypoint: tuple[str, ...]  # its ENTRYPOINT, () when it has none


def _image_facts(info: Mapping[str, Any]) -> _ImageFacts:
    config = info.get("Config") or {}
    return _ImageFacts(
        volumes=tuple(sorted(config.get("Volumes") or {})),
        entrypoint=tuple(config.get("Entrypoint") or ()),
    )


class _ImageFactsCache:
    """Image reference -> facts for IMAGE_FACTS_TTL_S, at most IMAGE_FACTS_MAX entries.

    Keyed by reference, so a retag shows up at the latest when the entry expires; an
    image found missing is never remembered (it may be built a moment later)."""

    def __init__(self, ttl_s: float = IMAGE_FACTS_TTL_S, max_entries: int = IMAGE_FACTS_MAX):
        self._ttl_s = ttl_s
        self._max = max_entries
        self._entries: dict[str, tuple[float, _ImageFacts]] = {}
        self._lock = threading.Lock()

    def get(self, image: str) -> _ImageFacts | None:
        with self._lock:
            entry = self._entries.get(image)
            if entry is None or entry[0] <= time.monotonic():
                return None
            return entry[1]

    def put(self, image: str, facts: _ImageFacts) -> None:
        now = time.monotonic()
        with self._lock:
            self._entries.pop(image, None)  # re-inserted last: dict order is age order
            if len(self._entries) >= self._max:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            while len(self._entries) >= self._max:
                del self._entries[next(iter(self._entries))]  # the oldest
            self._entries[image] = (now + self._ttl_s, facts)


def _pids_exhausted_locally(container_id: str) -> bool | None:
    """True/False from the container's pids cgroup, None when it is not visible here."""
    for pattern in _PIDS_EVENTS_PATHS:
        try:
            with open(pattern.format(id=container_id), encoding="ascii") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return value.strip().isdigit() and int(value) > 0
        return False
    return None


class _Pump:
    """Moves stdin in and stdout/stderr out of one attached container until it ends."""

    def __init__(
        self,
        api: Any,
        container_id: str,
        sock: socket.socket,
        spec: SandboxSpec,
        stdin: bytes,
        deadline: float,
        cancel: threading.Event | None,
        on_output: OutputSink | None,
        check_pids: bool,
        framed: bool = False,
    ) -> None:
        self.api = api
        self.container_id = container_id
        self.sock = sock
        self.spec = spec
        self.stdin = stdin  # the whole stream: the init's go byte and length (if any), the input
        self.deadline = deadline
        self.cancel = cancel
        self.on_output = on_output
        self.check_pids = check_pids
        cap = spec.limits.output_bytes
        self.buffers = {STDOUT: CappedBuffer(cap), STDERR: CappedBuffer(cap)}
        self.timed_out = False
        self.cancelled = False
        self.pids_exhausted = False
        self.killed = False
        self.ended = False  # the stream reached EOF: the container has stopped
        # With the init: its frames, and how the tool ended once the exit frame came.
        self.init: InitDecoder | None = InitDecoder() if framed else None
        self.exited: InitExit | None = None
        # When the hand-off's steps happened (time.monotonic()): GO_SENT, FIRST_OUTPUT
        # and EXIT_FRAME, for benchmarks (bench/handoff.py).
        self.marks: dict[str, float] = {}
        self._kill_deadline = math.inf
        self._killer: threading.Thread | None = None

    @property
    def output_truncated(self) -> bool:
        return any(b.truncated for b in self.buffers.values())

    def _kill(self, why: str) -> None:
        if self.killed:
            return
        self.killed = True
        self._kill_deadline = time.monotonic() + KILL_GRACE_S
        # The engine only finishes a kill once the container's output is drained, and we
        # are the drain: kill from a helper thread while this one keeps reading.
        self._killer = threading.Thread(
            target=self._kill_now,
            args=(why,),
            name=f"kill-{self.container_id[:12]}",
            daemon=True,
        )
        self._killer.start()

    def _kill_now(self, why: str) -> None:
        if self.check_pids and why != "output":
            # Read before the kill: the cgroup disappears with the container.
            self.pids_exhausted = self._probe_pids()
        try:
            self.api.kill(self.container_id)  # SIGKILL: cannot be trapped or ignored
        except Exception as e:
            # Already exited (409) is fine; anything else leaves the forced remove to do it.
            if _status(e) not in (404, 409):
                log.warning("kill of %s (%s) failed: %s", self.container_id[:12], why, e)

    def join_killer(self) -> None:
        if self._killer is not None:
            self._killer.join(KILL_GRACE_S)

    def _probe_pids(self) -> bool:
        local = _pids_exhausted_locally(self.container_id)
        if local is not None:
            return local
        try:  # engine elsewhere: one-shot stats, only on this (rare) kill path
            stats = self.api.stats(self.container_id, stream=False, one_shot=True)
            pids = stats.get("pids_stats") or {}
            limit = int(pids.get("limit") or 0)
            return limit > 0 and int(pids.get("current") or 0) >= limit
        except Exception:
            return False

    def run(self) -> None:
        sock = self.sock
        sock.setblocking(False)
        fd = sock.fileno()
        pending = memoryview(self.stdin)
        writing = True
        if not pending:
            self._close_stdin()
            writing = False
        poller = select.poll()
        poller.register(fd, select.POLLIN | (select.POLLOUT if writing else 0))
        demux = FrameDemuxer()
        cancel = self.cancel
        while True:
            now = time.monotonic()
            if not self.killed:
                if cancel is not None and cancel.is_set():
                    self.cancelled = True
                    self._kill("cancel")
                elif now >= self.deadline:
                    self.timed_out = True
                    self._kill("timeout")
            if self.killed:
                if now >= self._kill_deadline:
                    log.warning("%s: output did not end after SIGKILL", self.container_id[:12])
                    return
                wait = self._kill_deadline - now
            else:
                wait = self.deadline - now
                if cancel is not None:
                    wait = min(wait, CANCEL_POLL_S)
            for _, event in poller.poll(max(0, math.ceil(wait * 1000))):
                if writing and event & select.POLLOUT:
                    try:
                        sent = sock.send(pending[:SEND_BYTES])
                        pending = pending[sent:]
                        self.marks.setdefault(GO_SENT, time.monotonic())
                    except BlockingIOError:
                        pass
                    except OSError:
                        pending = pending[:0]  # the tool is gone or stopped reading stdin
                    if not pending:
                        # With the init the input is sized and the tool's EOF is the
                        # init's to give: the engine closes the container's stdin (calls
                        # through containerd, ~2 ms of CPU here, on the call's path if
                        # asked now) once the connection is closed after the call.
                        if self.init is None:
                            self._close_stdin()
                        writing = False
                        poller.modify(fd, select.POLLIN)
                if event & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        data = sock.recv(RECV_BYTES)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self.ended = True
                        if demux.mid_frame:
                            log.warning("%s: output ended mid-frame", self.container_id[:12])
                        return
                    self._deliver(demux, data)
                    if self.exited is not None and self.exited.signal != SIGKILL_NUMBER:
                        return  # answered by the init: the engine's exit is not awaited

    def _deliver(self, demux: FrameDemuxer, data: bytes) -> None:
        try:
            pieces = demux.feed(data)
        except FramingError as e:
            raise SandboxError(f"unexpected attach stream from the engine: {e}") from e
        if self.init is not None:
            pieces = self._unframe(pieces)
        for stream, piece in pieces:
            buf = self.buffers[stream]
            if buf.truncated:
                continue  # draining until the kill takes effect; nothing more is kept
            stored = buf.add(piece)
            if stored and self.on_output is not None:
                self.on_output(stream, stored)
            if buf.truncated:
                self._kill("output")

    def _unframe(self, pieces: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The init's stdout carries frames: the tool's output and its exit. Its own
        stderr (diagnostics of the init itself) counts as the tool's stderr."""
        assert self.init is not None
        out: list[tuple[str, bytes]] = []
        for stream, piece in pieces:
            if stream == STDERR:
                out.append((STDERR, piece))
                continue
            try:
                events = self.init.feed(piece)
            except FramingError as e:
                raise SandboxError(f"the sandbox init broke its protocol: {e}") from e
            for kind, value in events:
                if kind == INIT_EXIT:
                    assert isinstance(value, InitExit)
                    self.exited = value
                    self.marks[EXIT_FRAME] = time.monotonic()
                elif kind in (STDOUT, STDERR):
                    assert isinstance(value, bytes)
                    out.append((kind, value))
                    self.marks.setdefault(FIRST_OUTPUT, time.monotonic())
        return out

    def _close_stdin(self) -> None:
        # Half-close: with StdinOnce the engine then closes the tool's stdin (EOF) while
        # we keep reading its output on the same connection.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)


def _close_attached(attached: Any) -> None:
    response = getattr(attached, "_response", None)
    with contextlib.suppress(Exception):
        sock_obj = getattr(attached, "_sock", None)
        if isinstance(sock_obj, socket.socket):
            sock_obj.close()
        attached.close()
    if response is not None:
        with contextlib.suppress(Exception):
            response.close()


MAX_FAILED_CHARS: Final = 1000  # characters of a prestart failure's message kept


def _tool_text(raw: bytes) -> str:
    """A message the sandbox wrote (a prestart failure: a preloaded module's own
    words), fit for an error, the audit and a log line: capped, and its control
    characters (newlines, terminal escapes) shown as escapes, never obeyed."""
    text = raw.decode("utf-8", "replace")[:MAX_FAILED_CHARS]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _await_hello(sock: socket.socket, container_id: str, *, prestart: bool = False) -> None:
    """Read the init's hello frame, and nothing after it (nothing follows before the
    go byte): the init runs and speaks this server's protocol. A stale init, built
    before the protocol changed, fails here, before any call is handed to it.
    ``prestart``: then the frame that says the interpreter is ready (its preloads
    imported), or SandboxError with the reason it is not (a preload that failed)."""
    demux, decoder = FrameDemuxer(), InitDecoder()
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    hello = False
    while True:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([sock], [], [], wait)[0]:
            if hello:
                raise SandboxError(
                    f"{container_id[:12]}: prestart: the interpreter was not ready within"
                    f" {PRESTART_TIMEOUT_S:g} s (its preloads take too long)"
                )
            raise SandboxError(f"{container_id[:12]}: the sandbox init did not start")
        data = sock.recv(2048)
        if not data:
            raise SandboxError(f"{container_id[:12]}: the sandbox init exited at start")
        try:
            for stream, piece in demux.feed(data):
                if stream == STDERR:
                    continue
                for kind, value in decoder.feed(piece):
                    if kind == INIT_FAILED:
                        assert isinstance(value, bytes)
                        raise SandboxError(_tool_text(value))
                    if kind == INIT_READY and hello:
                        return
                    if kind != INIT_HELLO or hello:
                        raise FramingError(f"{kind} before hello")
                    if value != INIT_PROTOCOL:
                        raise SandboxError(
                            f"the sandbox init speaks protocol v{value}, this server v"
                            f"{INIT_PROTOCOL}: rebuild it ({init_fix()})"
                        )
                    if not prestart:
                        return
                    hello = True
                    deadline = time.monotonic() + PRESTART_TIMEOUT_S
        except FramingError as e:
            raise SandboxError(
                f"the sandbox init does not speak protocol v{INIT_PROTOCOL} ({e}):"
                f" rebuild it ({init_fix()})"
            ) from e


def _final_state(api: Any, container_id: str, pump: _Pump) -> tuple[int | None, bool]:
    exited = pump.exited
    if exited is not None and not pump.killed and exited.signal != SIGKILL_NUMBER:
        return exited.exit_code, False  # the init's word: no engine round trip
    with _engine_call("container inspect"):
        state = api.inspect_container(container_id).get("State") or {}
        if state.get("Running") and pump.ended:
            # The stream can end a moment before the engine records the exit.
            api.wait(container_id, timeout=KILL_GRACE_S)
            state = api.inspect_container(container_id).get("State") or {}
        if state.get("Running"):
            return None, bool(state.get("OOMKilled"))
        code = state.get("ExitCode")
    return (code if isinstance(code, int) else None), _out_of_memory(state, pump)


def _out_of_memory(state: Mapping[str, Any], pump: _Pump) -> bool:
    """Whether the container met its memory limit. The engine's mark, or, under gVisor,
    a whole sandbox SIGKILLed that toolreg did not kill and whose init never reported:
    the host's OOM killer ended the sandbox's kernel, and the engine does not always
    mark that (measured: 1 of 6 memory bombs under load, exit 137, OOMKilled false for
    good). Only an operator's own `docker kill` looks the same."""
    if state.get("OOMKilled"):
        return True
    return (
        pump.spec.runtime in GVISOR_RUNTIMES
        and state.get("ExitCode") == 128 + SIGKILL_NUMBER
        and not pump.killed
        and pump.exited is None
        and not state.get("Running")
    )


class Prepared:
    """A started container waiting on stdin: used for exactly one call (``finish``), or
    thrown away (``discard``). Never both, never twice.

    With an init, what waits is the init: the tool has not run and runs only once
    ``finish`` sends the go byte. Without one, the tool itself is running, blocked
    reading stdin (or not: nothing stops a command that does not read it)."""

    def __init__(
        self, backend: DockerBackend, api: Any, container_id: str, attached: Any,
        sock: socket.socket, spec: SandboxSpec, release: bytes,
        egress: EgressCall | None = None,
    ) -> None:  # fmt: skip
        self._backend = backend
        self._api = api
        self.container_id = container_id
        self._attached = attached
        self._sock = sock
        self.spec = spec
        # Sent ahead of the input: SIZED_GO_BYTE (then the input's length) with an init,
        # else b"".
        self._release = release
        self._egress = egress  # the call's network and secret files, if any
        self.created = time.monotonic()
        # After finish: when its hand-off's steps happened (GO_SENT, FIRST_OUTPUT,
        # EXIT_FRAME; time.monotonic()), for benchmarks.
        self.marks: Mapping[str, float] = {}
        self._used = False
        self._lock = threading.Lock()

    def _claim(self) -> None:
        with self._lock:
            if self._used:
                raise RuntimeError(f"container {self.container_id[:12]} was already used")
            self._used = True

    def bind_egress(self, egress: EgressSpec | None, execution_id: str) -> None:
        """Made ahead of its call: the call's egress grants (allow-list, headers,
        caps as the policy says now) and its id (the proxy's records name it),
        registered at the proxy by ``finish`` right before the tool is released.
        Until then the proxy refuses the sandbox's token."""
        self._backend.bind_egress(self._egress, egress, execution_id)

    def alive(self) -> bool:
        """True while the tool still waits for its input (no engine round trip:
        a container that died has closed its end of the attach stream)."""
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing to read: still waiting
        except OSError:
            return False
        return bool(data)  # early output means alive; EOF means it is gone

    def finish(
        self,
        input_bytes: bytes,
        deadline: float | None = None,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
        *,
        started: float | None = None,
    ) -> SandboxResult:
        """Release the tool (the init's go byte), hand it the call's input on the same
        stdin stream and see it through; the container is removed whatever happens.
        The deadline defaults to the spec's timeout from now: a warm container's wait
        before the call does not count."""
        self._claim()
        started = time.monotonic() if started is None else started
        if deadline is None:
            deadline = started + self.spec.limits.timeout_ms / 1000
        spec = dataclasses.replace(self.spec, input=input_bytes)
        try:
            with within_call(TOOL_RUN):
                return self._see_through(spec, started, deadline, on_output, cancel)
        finally:
            # After the call's answer (after_call.py): its audit fsync must not
            # wait behind the engine's own writes for this removal.
            after_call.later(
                functools.partial(self._backend.remove, self.container_id, self._egress)
            )

    def _see_through(
        self,
        spec: SandboxSpec,
        started: float,
        deadline: float,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> SandboxResult:
        """The tool's run, from the go byte to its final state (and its egress record)."""
        # The proxy learns of the call's token and grants now, not before: a
        # container made ahead of its call could not use its network until here.
        try:
            self._backend.register_egress(self._egress)
        except BaseException:
            _close_attached(self._attached)  # the init gets EOF: its tool never runs
            raise
        if self._release and len(spec.input) > MAX_INPUT_BYTES:
            _close_attached(self._attached)  # the init gets EOF: its tool never runs
            raise SandboxError(f"the input ({len(spec.input)} bytes) is too large to send")
        stream = (
            self._release + struct.pack(">I", len(spec.input)) + spec.input
            if self._release
            else spec.input
        )
        pump = _Pump(
            self._api, self.container_id, self._sock, spec, stream,
            deadline, cancel, on_output,
            check_pids=spec.runtime not in NO_PIDS_LIMIT_RUNTIMES,
            framed=bool(self._release),
        )  # fmt: skip
        self.marks = pump.marks
        try:
            pump.run()  # handles its own socket errors; the sink's exceptions propagate
        finally:
            pump.join_killer()
            _close_attached(self._attached)
        duration_ms = int((time.monotonic() - started) * 1000)
        exit_code, oom_killed = _final_state(self._api, self.container_id, pump)
        connections, unrecorded = self._backend.finish_egress(self._egress)
        return SandboxResult(
            exit_code=exit_code,
            stdout=pump.buffers[STDOUT].getvalue(),
            stderr=pump.buffers[STDERR].getvalue(),
            duration_ms=duration_ms,
            timed_out=pump.timed_out,
            oom_killed=oom_killed,
            pids_exhausted=pump.pids_exhausted,
            output_truncated=pump.output_truncated,
            container_id=self.container_id,
            cancelled=pump.cancelled,
            egress=connections,
            egress_unrecorded=unrecorded,
        )

    def discard(self) -> None:
        """Remove it unused (pool drained, too old, tool replaced). With an init the
        tool never runs: closing the attach stream gives the init EOF before any go
        byte, so it exits INIT_NOT_RELEASED_EXIT without exec (if the forced removal
        does not kill it first)."""
        with self._lock:
            if self._used:
                return
            self._used = True
        _close_attached(self._attached)
        self._backend.remove(self.container_id, self._egress)


# -- what an engine is (toolreg doctor) ---------------------------------------------------

PROBE_TIMEOUT_S: Final = 5.0  # seconds for each engine request of probe_engine


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What `toolreg doctor` reads of an engine: its version, its cgroup version and
    driver, its runtimes (with the arguments it starts each with), and the labels of
    the images asked about (None: not present locally)."""

    version: str
    cgroup_version: str  # "1", "2", or "" when the engine does not say
    cgroup_driver: str
    runtimes: Mapping[str, tuple[str, ...]]
    default_runtime: str
    images: Mapping[str, Mapping[str, str] | None]


def probe_engine(
    base_url: str | None, images: tuple[str, ...] = (), *, timeout_s: float = PROBE_TIMEOUT_S
) -> EngineFacts:
    """Ask the engine at ``base_url`` (None: DOCKER_HOST or the local socket) what
    it is, each request bounded by ``timeout_s``; EngineUnavailable naming why when
    it does not answer. Changes nothing on the engine."""
    timeout = max(1, math.ceil(timeout_s))  # the SDK's timeout is whole seconds
    client: docker.DockerClient | None = None
    try:
        if base_url is None:
            client = docker.DockerClient.from_env(version="auto", timeout=timeout)
        else:
            client = docker.DockerClient(base_url=base_url, version="auto", timeout=timeout)
        api: Any = client.api  # the SDK's low-level client is untyped
        with _engine_call("engine info"):
            info: Mapping[str, Any] = client.info()
        labels: dict[str, Mapping[str, str] | None] = {}
        for image in images:
            with _engine_call("image inspect"):
                try:
                    config = api.inspect_image(image).get("Config") or {}
                except docker.errors.ImageNotFound:
                    labels[image] = None
                    continue
            labels[image] = {str(k): str(v) for k, v in (config.get("Labels") or {}).items()}
    except docker.errors.DockerException as e:
        raise EngineUnavailable(f"Docker engine unavailable: {e}") from e
    except SandboxError as e:
        raise EngineUnavailable(str(e)) from e
    finally:
        if client is not None:
            client.close()
    return EngineFacts(
        version=str(info.get("ServerVersion") or ""),
        cgroup_version=str(info.get("CgroupVersion") or ""),
        cgroup_driver=str(info.get("CgroupDriver") or ""),
        runtimes=runtimes_of(info),
        default_runtime=str(info.get("DefaultRuntime") or ""),
        images=labels,
    )


class DockerBackend:
    """Runs each SandboxSpec in a fresh, locked-down container on a Docker engine."""

    def __init__(
        self,
        *,
        instance_id: str,
        base_url: str | None = None,
        max_pool_size: int = 16,
        name_prefix: str = "toolreg-",
        extra_labels: Mapping[str, str] | None = None,
        api_timeout_s: int = API_TIMEOUT_S,
        remove_in_background: bool = False,
        init_path: str | Path | None = None,
        egress: EgressConfig | None = None,
    ) -> None:
        """``init_path``: the built init (INIT_BINARY after ``make init``), a path on the
        engine's host, mounted read-only at INIT_TARGET in every container so that no
        tool runs before ``Prepared.finish``. ValueError when it is not a regular file
        executable by others. Leave it None only in a runner that never starts a tool
        ahead of its call (e.g. one that only reaps): without it, ``prepare`` starts the
        tool's command right away."""
        if not instance_id:
            raise ValueError("instance_id must be non-empty")
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", name_prefix):
            raise ValueError(f"invalid container name prefix {name_prefix!r}")
        if max_pool_size < 1:
            raise ValueError("max_pool_size must be >= 1")
        labels = dict(extra_labels or {})
        clash = RESERVED_LABELS.intersection(labels)
        if clash:
            raise ValueError(f"extra_labels may not set reserved labels: {sorted(clash)}")
        self.init_path: Path | None = None if init_path is None else _checked_init_path(init_path)
        self.instance_id = instance_id
        self.name_prefix = name_prefix
        self.extra_labels: Mapping[str, str] = labels
        self.owner = OwnerIdentity.current()
        self._base_url = base_url
        self._max_pool_size = max_pool_size
        self._api_timeout_s = api_timeout_s
        self._docker: docker.DockerClient | None = None
        self._lock = threading.Lock()
        # Removing a finished container changes nothing the caller is told, so a
        # server can answer first and remove right after; close() waits for it.
        # Each job carries its caller's context, so the removal's span and log lines
        # belong to the call that used the container.
        self._removals: queue.Queue[_Removal | None] | None = None
        self._remover: threading.Thread | None = None
        # Containers whose removal failed (the engine was down or erred): removed again by
        # retry_removals() once it answers, so an engine restart leaves nothing behind.
        self._unremoved: set[str] = set()
        self._unremoved_lock = threading.Lock()
        self._image_facts = _ImageFactsCache()
        if remove_in_background:
            self._removals = queue.Queue()
            self._remover = threading.Thread(target=self._remove_loop, name="remover", daemon=True)
            self._remover.start()
        self._static_labels = {
            **labels,
            LABEL_MANAGED: "true",
            LABEL_INSTANCE: instance_id,
            **self.owner.labels(),
        }
        # Tools with egress or secrets need it; None: such calls are refused.
        self._egress = (
            None
            if egress is None
            else EgressGateway(egress, name_prefix=name_prefix, labels=self._static_labels)
        )

    # -- engine connection ---------------------------------------------------------------

    def _client(self) -> docker.DockerClient:
        client = self._docker
        if client is not None:
            return client
        with self._lock:
            if self._docker is None:
                # Created lazily (and retried on the next call) so a server can start, and
                # report UNAVAILABLE, while the engine is down. "auto" costs one /version.
                try:
                    if self._base_url is None:
                        self._docker = docker.DockerClient.from_env(
                            version="auto",
                            timeout=self._api_timeout_s,
                            max_pool_size=self._max_pool_size,
                        )
                    else:
                        self._docker = docker.DockerClient(
                            base_url=self._base_url,
                            version="auto",
                            timeout=self._api_timeout_s,
                            max_pool_size=self._max_pool_size,
                        )
                except docker.errors.DockerException as e:
                    raise EngineUnavailable(
                        f"Docker engine unavailable: {e}; fix: {engine_fix()}"
                    ) from e
            return self._docker

    def close(self) -> None:
        if self._removals is not None and self._remover is not None:
            self._removals.put(None)  # finish what is queued, then stop
            self._remover.join(timeout=60)
            self._removals = None
        if self._egress is not None and self._docker is not None:
            self._egress.close(self._docker.api)
        with self._lock:
            if self._docker is not None:
                self._docker.close()
                self._docker = None

    def health(self) -> bool:
        if not self.ping():
            return False
        self.retry_removals()  # what an engine outage kept us from removing
        return True

    def ping(self) -> bool:
        try:
            return bool(self._client().ping())
        except Exception:
            return False

    def runtimes(self) -> Mapping[str, tuple[str, ...]]:
        with _engine_call("engine info"):
            return runtimes_of(self._client().info())

    # -- one execution -------------------------------------------------------------------

    def _host_config(self, api: Any, spec: SandboxSpec, network: str = "") -> dict[str, Any]:
        lim = spec.limits
        memory = lim.memory_mb * 1024 * 1024
        fsize = lim.fsize_mb * 1024 * 1024
        host_config: dict[str, Any] = api.create_host_config(
            # A call's own egress network (through its holder's namespace), else none.
            network_mode=network or "none",
            read_only=True,
            tmpfs={"/tmp": f"rw,noexec,nosuid,nodev,size={lim.tmpfs_mb}m"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=memory,
            memswap_limit=memory,  # equal: no swap beyond the memory limit
            nano_cpus=lim.cpu_millis * 1_000_000,
            pids_limit=None if spec.runtime in NO_PIDS_LIMIT_RUNTIMES else lim.pids,
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                docker.types.Ulimit(name="fsize", soft=fsize, hard=fsize),
            ],
            ipc_mode="none",
            privileged=False,
            # We read output over attach; a log driver would copy every byte to disk too.
            log_config=docker.types.LogConfig(type="none"),
            mounts=self._mounts(spec) or None,
            runtime=spec.runtime,
            auto_remove=False,  # we read the state first, then remove
            # In a holder's namespace the sandbox has the holder's resolver
            # settings (egress/gateway.py: UNROUTABLE_DNS); Docker allows none here.
            dns=[UNROUTABLE_DNS] if network and not network.startswith("container:") else None,
        )
        return host_config

    def _mounts(self, spec: SandboxSpec) -> list[docker.types.Mount]:
        mounts = [
            docker.types.Mount(target=m.target, source=m.source, type="bind", read_only=m.read_only)
            for m in spec.mounts
        ]
        if self.init_path is not None:
            mounts.append(
                docker.types.Mount(
                    target=INIT_TARGET, source=str(self.init_path), type="bind", read_only=True
                )
            )
        return mounts

    # -- images --------------------------------------------------------------------------

    def _inspect_image(self, image: str) -> _ImageFacts | None:
        """Fresh facts from the engine (and into the cache); None when not present locally."""
        api: Any = self._client().api  # the SDK's low-level client is untyped
        with _engine_call("image inspect"):
            try:
                info = api.inspect_image(image)
            except docker.errors.ImageNotFound:
                return None
        facts = _image_facts(info)
        self._image_facts.put(image, facts)
        return facts

    def image_volumes(self, image: str) -> tuple[str, ...] | None:
        """The VOLUME paths the local image declares (sorted), None when it is not
        present locally. Asks the engine every time (prepare() reuses the answer for
        IMAGE_FACTS_TTL_S)."""
        facts = self._inspect_image(image)
        return None if facts is None else facts.volumes

    def _facts_for_create(self, image: str) -> _ImageFacts:
        facts = self._image_facts.get(image) or self._inspect_image(image)
        if facts is None:
            raise SandboxError(_image_missing(image))
        if facts.volumes:
            # Docker would back each one with an anonymous volume: writable and unbounded
            # despite the read-only root and the tmpfs cap.
            raise SandboxError(
                f"image {image!r} declares VOLUME {', '.join(facts.volumes)}: refused, an "
                "anonymous volume would give the tool writable, unbounded storage; "
                "rebuild the image without VOLUME"
            )
        return facts

    def _check_holdable(self, spec: SandboxSpec) -> None:
        """ValueError for a spec the init cannot hold; before any engine call."""
        if self.init_path is None:
            return
        if not spec.command:
            # The image's default command would need its config; the registry always
            # names one, so an empty command is refused rather than looked up.
            raise ValueError("a runner with an init needs a non-empty SandboxSpec.command")
        clash = [m.target for m in spec.mounts if _overlaps_init(m.target)]
        if clash:
            raise ValueError(f"mount targets {clash} overlap the init's directory {_INIT_DIR}")
        if spec.prestart:
            stub_command(spec.command, spec.preload)  # ValueError for a form it cannot run

    def _process(self, spec: SandboxSpec, facts: _ImageFacts) -> dict[str, Any]:
        """The create arguments naming the container's process."""
        if self.init_path is None:
            return {"command": list(spec.command) or None}
        if spec.prestart:
            if facts.entrypoint:
                raise SandboxError(
                    f"image {spec.image!r} has an ENTRYPOINT ({' '.join(facts.entrypoint)}):"
                    " prestart needs the tool's command to be the interpreter itself"
                )
            # The held process is the interpreter, started now (init --prestart).
            return {
                "entrypoint": [INIT_TARGET, PRESTART_FLAG],
                "command": stub_command(spec.command, spec.preload),
            }
        # The init comes first whatever the image says: Docker runs Entrypoint + Cmd, so
        # the image's ENTRYPOINT (kept, as without an init) becomes the init's program.
        return {"entrypoint": [INIT_TARGET, *facts.entrypoint], "command": list(spec.command)}

    # -- one execution -------------------------------------------------------------------

    def run(
        self,
        spec: SandboxSpec,
        *,
        execution_id: str,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        started = time.monotonic()
        deadline = started + spec.limits.timeout_ms / 1000
        if not _NAME_PART.match(execution_id):
            raise ValueError(f"execution_id {execution_id!r} is not usable in a container name")
        if cancel is not None and cancel.is_set():
            return SandboxResult(
                exit_code=None, stdout=b"", stderr=b"", duration_ms=0, timed_out=False,
                oom_killed=False, pids_exhausted=False, output_truncated=False,
                container_id="", cancelled=True,
            )  # fmt: skip
        prepared = self.prepare(spec, execution_id=execution_id, lifetime_s=0)
        return prepared.finish(spec.input, deadline, on_output, cancel, started=started)

    def prepare(self, spec: SandboxSpec, *, execution_id: str, lifetime_s: float = 0) -> Prepared:
        """Create, attach and start a container for one call. With an init, the init
        waits on stdin and nothing of the tool runs before ``finish``; without one, the
        tool's command is started now. ``spec.input`` is ignored: the call brings its
        own. ``lifetime_s``: how long it may wait for its call (for the reaper's
        deadline label), on top of the call's own timeout.

        ValueError for a spec this runner cannot hold (with an init: an empty command,
        a mount over the init); SandboxError for an image that is missing or declares
        a VOLUME, and for engine failures."""
        if not _NAME_PART.match(execution_id):
            raise ValueError(f"execution_id {execution_id!r} is not usable in a container name")
        self._check_holdable(spec)
        api = self._client().api
        process = self._process(spec, self._facts_for_create(spec.image))
        name = f"{self.name_prefix}{execution_id}"
        expires = time.time() + lifetime_s + spec.limits.timeout_ms / 1000
        labels = {
            **self._static_labels,
            LABEL_EXECUTION_ID: execution_id,
            LABEL_DEADLINE: str(int(expires * 1000)),
        }
        call = self._open_egress(api, spec, execution_id, int(expires * 1000))
        if call is not None:
            # The server's proxy and CA settings replace any the tool's env names.
            ours = dict(call.env)
            env = [(k, v) for k, v in spec.env if k not in ours] + list(call.env)
            spec = dataclasses.replace(spec, env=tuple(env), mounts=spec.mounts + call.mounts)
            if call.network:
                labels[LABEL_EGRESS_NETWORK] = call.network
        # The call's network, joined through its holder's namespace (egress/gateway.py).
        network = f"container:{call.holder}" if call is not None and call.holder else ""
        container_id = ""
        try:
            with _engine_call("container create", image=spec.image):
                created = api.create_container(
                    image=spec.image,
                    **process,
                    user=UNPRIVILEGED_USER,
                    stdin_open=True,  # with detach=False this also sets StdinOnce
                    tty=False,
                    environment=[f"{k}={v}" for k, v in spec.env],
                    network_disabled=not network,
                    name=name,
                    labels=labels,
                    working_dir=spec.workdir,
                    host_config=self._host_config(api, spec, network),
                    use_config_proxy=False,  # never leak the host's proxy settings
                )
                container_id = created["Id"]
        except SandboxError as e:
            self._remove_after_failed_create(api, name, e)
            if call is not None and self._egress is not None:
                self._egress.release(api, call)
            raise
        try:
            # Attach before start so no early output is lost and nothing is buffered by
            # the HTTP layer ahead of our own reads.
            with _engine_call("container attach"):
                attached = api.attach_socket(
                    container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                )
            try:
                sock = _raw_socket(attached)
                with (
                    _netstack_hint(spec.runtime),
                    _small_memory_hint(spec.limits.memory_mb),
                    _engine_call("container start"),
                ):
                    api.start(container_id)
                if self.init_path is not None:
                    _await_hello(sock, container_id, prestart=bool(spec.prestart))
            except BaseException:
                _close_attached(attached)
                raise
        except BaseException:
            self._remove(api, container_id)
            if call is not None and self._egress is not None:
                self._egress.release(api, call)
            raise
        release = SIZED_GO_BYTE if self.init_path is not None else b""
        return Prepared(self, api, container_id, attached, sock, spec, release, call)

    def _open_egress(
        self, api: Any, spec: SandboxSpec, execution_id: str, deadline_ms: int
    ) -> EgressCall | None:
        if spec.egress is None and not spec.secret_files:
            return None
        if self._egress is None:
            raise SandboxError("this server runs no egress proxy; tools with egress cannot run")
        files = {f.name: f.value for f in spec.secret_files}
        return self._egress.open(api, execution_id, spec.egress, files, deadline_ms=deadline_ms)

    def bind_egress(
        self, call: EgressCall | None, egress: EgressSpec | None, execution_id: str
    ) -> None:
        """A container made ahead of its call now serves one: its grants and id,
        for ``register_egress``. SandboxError when they do not fit the container."""
        if call is None and egress is None:
            return
        if call is None or egress is None or self._egress is None:
            raise SandboxError("egress: the call's network does not match its sandbox's")
        self._egress.bind(call, egress, execution_id)

    def register_egress(self, call: EgressCall | None) -> None:
        """The proxy learns of the call's token and grants: right before the go byte."""
        if call is not None and self._egress is not None:
            self._egress.register(call)

    def finish_egress(self, call: EgressCall | None) -> tuple[tuple[EgressConnection, ...], int]:
        if call is None or self._egress is None:
            return (), 0
        return self._egress.finish(call)

    def remove(self, container_id: str, egress: EgressCall | None = None) -> None:
        """``egress``: the call's network and secret files, released once the
        container is gone (a network cannot go while a container is on it)."""
        api = self._client().api
        removals = self._removals
        if removals is None:
            self._traced_remove(api, container_id, egress)
        else:
            removals.put((time.monotonic(), contextvars.copy_context(), api, container_id, egress))

    def _remove_loop(self) -> None:
        assert self._removals is not None
        while True:
            job = self._removals.get()
            try:
                if job is None:
                    return
                asked_at, context, *args = job
                after_call.yield_to_calls(asked_at)  # calls in flight go first
                context.run(self._traced_remove, *args)
            finally:
                self._removals.task_done()

    def flush(self) -> None:
        """Wait until every container handed to background removal is gone."""
        if self._removals is not None:
            self._removals.join()

    def _traced_remove(self, api: Any, container_id: str, egress: EgressCall | None) -> None:
        with within_call(SANDBOX_REMOVE):
            self._remove(api, container_id, egress)

    def _remove(self, api: Any, container_id: str, egress: EgressCall | None = None) -> None:
        if container_id and not self._try_remove(api, container_id):
            with self._unremoved_lock:
                self._unremoved.add(container_id)
        if egress is not None and self._egress is not None:
            self._egress.release(api, egress)

    def _try_remove(self, api: Any, container_id: str) -> bool:
        """True when the container is gone (or going); False (logged) when it is not."""
        try:
            api.remove_container(container_id, force=True, v=True)
        except Exception as e:
            if _status(e) == 404:
                return True
            if _status(e) == 409 and "in progress" in str(e):
                return True
            log.error("could not remove container %s (retried when the engine answers): %s",
                      container_id[:12], e)  # fmt: skip
            return False
        return True

    def retry_removals(self) -> int:
        """Remove again the containers whose removal failed; returns how many are still
        there. Cheap when there are none: the health check calls it on every pass."""
        with self._unremoved_lock:
            pending = list(self._unremoved)
        if not pending:
            return 0
        api = self._client().api
        removed = {cid for cid in pending if self._try_remove(api, cid)}
        with self._unremoved_lock:
            self._unremoved -= removed
            left = len(self._unremoved)
        if removed:
            log.info("removed %d container(s) left when the engine failed", len(removed))
        return left

    def _remove_after_failed_create(self, api: Any, name: str, error: SandboxError) -> None:
        # A create that timed out on our side may still have happened on the engine's.
        cause = error.__cause__
        if isinstance(cause, docker.errors.APIError) or isinstance(error, EngineUnavailable):
            return  # the engine answered "no" (or not at all): nothing was created
        with contextlib.suppress(Exception):
            api.remove_container(name, force=True, v=True)

    # -- leftovers -----------------------------------------------------------------------

    def reap(self) -> int:
        """Remove leftovers of dead server instances among the containers that carry this
        runner's extra labels (so a runner scoped by labels only ever touches its scope)."""
        api = self._client().api
        filters = [f"{LABEL_MANAGED}=true"] + [f"{k}={v}" for k, v in self.extra_labels.items()]
        with _engine_call("container list"):
            containers = api.containers(all=True, filters={"label": filters})
        now_ms = int(time.time() * 1000)
        removed = 0
        for c in containers:
            labels = c.get("Labels") or {}
            reason = orphan_reason(
                labels, me=self.owner, my_instance=self.instance_id, now_ms=now_ms
            )
            if reason is None:
                continue
            try:
                api.remove_container(c["Id"], force=True, v=True)
            except Exception as e:
                if _status(e) != 404:
                    log.warning("reap: could not remove %s: %s", c["Id"][:12], e)
                continue
            removed += 1
            log.info("reaped container %s (%s)", c["Id"][:12], reason)
        return removed + self._reap_networks(api, filters, now_ms)

    def _reap_networks(self, api: Any, filters: list[str], now_ms: int) -> int:
        """Egress networks of dead instances (their containers went first)."""
        with _engine_call("network list"):
            networks = api.networks(filters={"label": filters})
        removed = 0
        for n in networks:
            reason = orphan_reason(
                n.get("Labels") or {}, me=self.owner, my_instance=self.instance_id, now_ms=now_ms
            )
            if reason is None:
                continue
            try:
                api.remove_network(n["Id"])
            except Exception as e:
                log.warning("reap: could not remove network %s: %s", n.get("Name"), e)
                continue
            removed += 1
            log.info("reaped network %s (%s)", n.get("Name"), reason)
        return removed

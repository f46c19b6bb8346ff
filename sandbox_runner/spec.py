"""Domain types of one sandboxed execution: what to run, with which limits, and what came out.

Nothing here talks to an engine; the types are frozen so a spec can be shared between
threads and hashed into audit records without defensive copies.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Final

__all__ = [
    "INIT_BINARY",
    "EgressConnection",
    "EgressSpec",
    "EngineUnavailable",
    "HeaderInjection",
    "Limits",
    "Mount",
    "SandboxError",
    "SandboxResult",
    "SandboxSpec",
    "SecretFile",
]

# Where `make init` builds the sandbox init (init/toolreg_init.c); runners mount it into
# every container. Here, not in docker_backend, so configuration can name it cheaply.
INIT_BINARY: Final = Path(__file__).resolve().parent / "init" / "toolreg-init"

# Docker's own rule for environment variable names is looser; this is the POSIX portable
# set, which keeps `KEY=VALUE` unambiguous for every shell a tool might use.
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SandboxError(Exception):
    """The engine failed to run the sandbox (create/start failed, image missing, ...).

    Not raised for anything the tool itself did: a crashing, looping or flooding tool is a
    SandboxResult. The message is meant to be shown to an operator or a model as is.
    """


class EngineUnavailable(SandboxError):
    """No container engine answers at all (socket missing, connection refused)."""


def _check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; `True` megabytes is always a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of one execution. In a tool's request, 0 means "use the profile".

    A SandboxSpec only accepts complete limits (every field > 0): merge a request into
    a profile with `profile.tightest(request)` first.
    """

    memory_mb: int  # MiB of RAM; swap is set equal, so no swap on top
    cpu_millis: int  # thousandths of one CPU (1000 = one full core)
    pids: int  # max processes+threads in the container (runc only; gVisor ignores)
    timeout_ms: int  # wall clock from the start of run() to kill, in milliseconds
    output_bytes: int  # cap per stream (stdout and stderr each), in bytes
    tmpfs_mb: int  # size of the writable /tmp, in MiB
    nofile: int  # max open file descriptors per process
    fsize_mb: int  # max size of one file a process may write, in MiB

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_int("Limits", f.name, getattr(self, f.name), minimum=0)

    @property
    def complete(self) -> bool:
        """True when every field is set (> 0), i.e. the limits can be applied as they are."""
        return all(getattr(self, f.name) > 0 for f in fields(self))

    def tightest(self, other: Limits) -> Limits:
        """Field-wise the stricter of the two; a field <= 0 in `other` means "no opinion".

        Never loosens a field of `self` that is set; a field unset in `self` takes
        `other`'s value.
        """
        merged: dict[str, int] = {}
        for f in fields(self):
            mine: int = getattr(self, f.name)
            theirs: int = getattr(other, f.name)
            if theirs <= 0:
                merged[f.name] = mine
            elif mine <= 0:
                merged[f.name] = theirs
            else:
                merged[f.name] = min(mine, theirs)
        return Limits(**merged)

    def replace(self, **changes: int) -> Limits:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Mount:
    """A host directory bind-mounted into the container, exactly as given."""

    source: str  # absolute host path; must exist
    target: str  # absolute path inside the container
    read_only: bool = True

    def __post_init__(self) -> None:
        for name in ("source", "target"):
            value = getattr(self, name)
            if not isinstance(value, str) or not posixpath.isabs(value) or "\0" in value:
                raise ValueError(f"Mount.{name} must be an absolute path, got {value!r}")
        if posixpath.normpath(self.target) == "/":
            raise ValueError("Mount.target must not be the container's root")


@dataclass(frozen=True, slots=True)
class HeaderInjection:
    """A secret the egress proxy adds to HTTPS requests to one host:port."""

    host: str
    port: int
    header: str
    value: str = field(repr=False)  # the rendered header value: a secret
    mask: tuple[str, ...] = field(repr=False, default=())  # masked in what comes back


@dataclass(frozen=True, slots=True)
class EgressSpec:
    """What one call may reach through the egress proxy (sandbox_runner/egress)."""

    allow: tuple[str, ...]  # "host:port" entries (rules.parse_entry)
    max_bytes: int  # bytes up and down, all connections of the call together
    max_connections: int  # connections the call may open, refused ones included
    allow_private: tuple[str, ...] = ()  # CIDR networks reachable although not public
    inject: tuple[HeaderInjection, ...] = ()


@dataclass(frozen=True, slots=True)
class SecretFile:
    """A secret mounted read-only at /run/secrets/NAME for one call."""

    name: str
    value: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class EgressConnection:
    """One connection a call asked the egress proxy for, allowed or refused."""

    host: str
    port: int
    address: str  # the address it was pinned to ("" when never resolved)
    allowed: bool
    reason: str  # "" when allowed and not cut
    bytes_up: int
    bytes_down: int
    duration_ms: int
    method: str = ""
    injected: bool = False


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """Everything needed to run one execution. `command` empty = the image's default."""

    image: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    limits: Limits
    runtime: str = "runc"
    input: bytes = b""  # written to the tool's stdin, which is then closed
    mounts: tuple[Mount, ...] = ()
    workdir: str | None = None
    egress: EgressSpec | None = None  # None: no network at all
    secret_files: tuple[SecretFile, ...] = ()
    # "python": the command's interpreter starts before the call with these modules
    # imported, and the release runs the tool's code in it (warm_interpreter.py).
    # Honoured only by a runner with an init; without one the command runs as it is.
    prestart: str = ""
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image or "\0" in self.image:
            raise ValueError("SandboxSpec.image must be a non-empty image reference")
        if not isinstance(self.command, tuple) or not all(
            isinstance(a, str) and "\0" not in a for a in self.command
        ):
            raise ValueError("SandboxSpec.command must be a tuple of strings without NUL")
        if not isinstance(self.env, tuple):
            raise ValueError("SandboxSpec.env must be a tuple of (key, value) pairs")
        for pair in self.env:
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not isinstance(pair[0], str)
                or not isinstance(pair[1], str)
            ):
                raise ValueError(f"SandboxSpec.env entries must be (str, str) pairs: {pair!r}")
            key, value = pair
            if not _ENV_KEY.match(key) or "\0" in value:
                raise ValueError(f"SandboxSpec.env has an invalid variable {key!r}")
        if not isinstance(self.limits, Limits) or not self.limits.complete:
            raise ValueError(
                f"SandboxSpec.limits must have every field > 0 (merge with a profile "
                f"first): {self.limits!r}"
            )
        if not isinstance(self.runtime, str) or not self.runtime:
            raise ValueError("SandboxSpec.runtime must be a runtime name such as 'runc'")
        if not isinstance(self.input, bytes):
            raise TypeError("SandboxSpec.input must be bytes")
        if not all(isinstance(m, Mount) for m in self.mounts):
            raise TypeError("SandboxSpec.mounts must be Mount instances")
        if self.workdir is not None and not posixpath.isabs(self.workdir):
            raise ValueError("SandboxSpec.workdir must be an absolute path")
        if self.prestart not in ("", "python"):
            raise ValueError(f"SandboxSpec.prestart must be '' or 'python', got {self.prestart!r}")
        if self.preload and not self.prestart:
            raise ValueError("SandboxSpec.preload needs prestart")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one execution produced. A failing, looping or flooding tool is a result."""

    exit_code: int | None  # None when the process never reported one (not started / lost)
    stdout: bytes  # at most limits.output_bytes
    stderr: bytes  # at most limits.output_bytes
    duration_ms: int  # from the start of run() until the tool's output ended
    timed_out: bool  # killed at limits.timeout_ms
    oom_killed: bool  # the kernel OOM killer fired inside the container
    pids_exhausted: bool  # best effort: the pids limit was hit (seen at kill time only)
    output_truncated: bool  # a stream passed limits.output_bytes; the container was killed
    container_id: str  # "" when no container was created
    cancelled: bool = False  # the caller's cancel event stopped it
    egress: tuple[EgressConnection, ...] = ()  # what it asked the egress proxy for
    egress_unrecorded: int = 0  # connections beyond what the proxy keeps per call

    @property
    def killed(self) -> bool:
        """True when the runner, not the tool, ended the execution."""
        return self.timed_out or self.output_truncated or self.cancelled

"""Default limits per safety level (docs/explanation/sandbox.md). Configuration/policy may
tighten them; a tool's own request is merged with `profile.tightest(request)` and never
loosens them.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Final

from .spec import Limits

__all__ = [
    "CAUTIOUS_LIMITS",
    "DANGEROUS_LIMITS",
    "GVISOR",
    "GVISOR_NET",
    "GVISOR_RUNTIMES",
    "HOSTINET",
    "LEVELS",
    "NETSTACK",
    "SAFE_LIMITS",
    "gvisor_network",
    "preferred_runtime",
    "profile_for",
    "runtime_for",
]

KIB: Final = 1024  # bytes
MIB: Final = 1024 * KIB  # bytes

# --- safe: read-only tools, no side effects -----------------------------------------------
SAFE_MEMORY_MB: Final = 256  # MiB (swap equal: no swap)
SAFE_CPU_MILLIS: Final = 1000  # millicpu: one core
SAFE_PIDS: Final = 64  # processes + threads
SAFE_TIMEOUT_MS: Final = 10_000  # milliseconds wall clock
SAFE_OUTPUT_BYTES: Final = 1 * MIB  # bytes per stream
SAFE_TMPFS_MB: Final = 64  # MiB of /tmp

# --- cautious: runs code / changes state inside its sandbox --------------------------------
CAUTIOUS_MEMORY_MB: Final = 128  # MiB
CAUTIOUS_CPU_MILLIS: Final = 500  # millicpu: half a core
CAUTIOUS_PIDS: Final = 32  # processes + threads
CAUTIOUS_TIMEOUT_MS: Final = 5_000  # milliseconds wall clock
CAUTIOUS_OUTPUT_BYTES: Final = 256 * KIB  # bytes per stream
CAUTIOUS_TMPFS_MB: Final = 16  # MiB of /tmp

# --- all levels ----------------------------------------------------------------------------
NOFILE: Final = 256  # open file descriptors per process
FSIZE_MB: Final = 16  # MiB: largest single file a process may write

SAFE_LIMITS: Final = Limits(
    memory_mb=SAFE_MEMORY_MB,
    cpu_millis=SAFE_CPU_MILLIS,
    pids=SAFE_PIDS,
    timeout_ms=SAFE_TIMEOUT_MS,
    output_bytes=SAFE_OUTPUT_BYTES,
    tmpfs_mb=SAFE_TMPFS_MB,
    nofile=NOFILE,
    fsize_mb=FSIZE_MB,
)

CAUTIOUS_LIMITS: Final = Limits(
    memory_mb=CAUTIOUS_MEMORY_MB,
    cpu_millis=CAUTIOUS_CPU_MILLIS,
    pids=CAUTIOUS_PIDS,
    timeout_ms=CAUTIOUS_TIMEOUT_MS,
    output_bytes=CAUTIOUS_OUTPUT_BYTES,
    tmpfs_mb=CAUTIOUS_TMPFS_MB,
    nofile=NOFILE,
    fsize_mb=FSIZE_MB,
)

# Dangerous tools differ by runtime (gVisor) and the approval gate, not by limits.
DANGEROUS_LIMITS: Final = CAUTIOUS_LIMITS

_BY_LEVEL: Final[dict[str, Limits]] = {
    "safe": SAFE_LIMITS,
    "cautious": CAUTIOUS_LIMITS,
    "dangerous": DANGEROUS_LIMITS,
}
LEVELS: Final = tuple(_BY_LEVEL)  # ordered from least to most dangerous

# The two gVisor runtimes scripts/ensure_docker.sh registers (docs/explanation/sandbox.md), one
# binary each. The names are Docker runtime names: an engine offers them or not.
GVISOR: Final = "runsc"  # --network=none: no network stack, only lo
# For dangerous tools with network.egress only, on the call's internal network (whose one
# reachable peer is the egress proxy): --network=sandbox, gVisor's own netstack, or, where
# this runsc's netstack cannot start (scripts/ensure_docker.sh probes), --network=host.
GVISOR_NET: Final = "runsc-net"
GVISOR_RUNTIMES: Final = frozenset({GVISOR, GVISOR_NET})

# gVisor's network modes (runsc --network), by what they mean for a sandbox's sockets:
NETSTACK: Final = "netstack"  # sandbox (runsc's default): TCP/IP in gVisor, in user space
HOSTINET: Final = "hostinet"  # host: socket calls go to the host kernel, in the container's netns
_GVISOR_NETWORKS: Final = {"sandbox": NETSTACK, "host": HOSTINET}

# gVisor for dangerous tools; others use the engine's default OCI runtime.
_PREFERRED_RUNTIME: Final[dict[str, str]] = {
    "safe": "runc",
    "cautious": "runc",
    "dangerous": GVISOR,
}
FALLBACK_RUNTIME: Final = "runc"


def _check_level(level: str) -> None:
    if level not in _BY_LEVEL:
        raise ValueError(f"unknown safety level {level!r}; expected one of {', '.join(LEVELS)}")


def profile_for(level: str) -> Limits:
    """The default limits of a safety level ('safe', 'cautious' or 'dangerous')."""
    _check_level(level)
    return _BY_LEVEL[level]


def preferred_runtime(level: str, *, egress: bool = False) -> str:
    """The runtime a level's tools (with network egress when ``egress``) want. A
    dangerous tool with egress wants GVISOR_NET: GVISOR has no network stack and
    could not reach the proxy."""
    _check_level(level)
    return GVISOR_NET if egress and level == "dangerous" else _PREFERRED_RUNTIME[level]


def runtime_for(level: str, available: Set[str], *, egress: bool = False) -> str | None:
    """The preferred runtime of a level (of a tool with network egress when ``egress``)
    if the engine has it, else None (the caller decides whether to fall back to
    FALLBACK_RUNTIME with a warning or to refuse)."""
    preferred = preferred_runtime(level, egress=egress)
    return preferred if preferred in available else None


def gvisor_network(runtime_args: Sequence[str]) -> str:
    """gVisor's network mode under these runsc runtimeArgs (the engine's, e.g.
    ``("--network=host",)``): NETSTACK, HOSTINET, or the --network value itself
    ("none", ...). runsc parses Go flags: ``-network=X``, ``--network=X`` and
    ``--network X`` alike, the last one winning; with none, runsc's default is
    the netstack."""
    network = "sandbox"
    for i, arg in enumerate(runtime_args):
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == "network":
            following = runtime_args[i + 1] if i + 1 < len(runtime_args) else ""
            network = value if eq else following
    return _GVISOR_NETWORKS.get(network, network)

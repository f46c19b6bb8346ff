"""Who owns a sandbox container, and whether that owner is dead (pure logic + /proc reads).

Every container carries its creator's identity in labels. At start (and on `toolreg reap`)
a server removes containers whose creator is provably gone, and never those of a live
server: two servers on one engine must not remove each other's running tools.

A process is identified by (boot id, pid namespace, pid, start time): a pid alone is
reused, and a start time alone means nothing across reboots or pid namespaces.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LABEL_DEADLINE",
    "LABEL_EXECUTION_ID",
    "LABEL_INSTANCE",
    "LABEL_MANAGED",
    "LABEL_OWNER_BOOT",
    "LABEL_OWNER_HOST",
    "LABEL_OWNER_PID",
    "LABEL_OWNER_PIDNS",
    "LABEL_OWNER_START",
    "RESERVED_LABELS",
    "STALE_AFTER_MS",
    "OwnerIdentity",
    "orphan_reason",
    "owner_gone",
    "process_alive",
    "process_start_ticks",
]

LABEL_MANAGED: Final = "io.toolreg.managed"  # "true" on every container we create
LABEL_EXECUTION_ID: Final = "io.toolreg.execution-id"
LABEL_INSTANCE: Final = "io.toolreg.instance"  # the creating server instance
LABEL_OWNER_PID: Final = "io.toolreg.owner-pid"
LABEL_OWNER_START: Final = "io.toolreg.owner-start"  # /proc/<pid>/stat field 22, clock ticks
LABEL_OWNER_BOOT: Final = "io.toolreg.owner-boot"  # /proc/sys/kernel/random/boot_id
LABEL_OWNER_HOST: Final = "io.toolreg.owner-host"  # /etc/machine-id, else the hostname
LABEL_OWNER_PIDNS: Final = "io.toolreg.owner-pidns"  # readlink /proc/self/ns/pid
LABEL_DEADLINE: Final = "io.toolreg.deadline"  # unix epoch milliseconds: the kill deadline

RESERVED_LABELS: Final = frozenset(
    {
        LABEL_MANAGED,
        LABEL_EXECUTION_ID,
        LABEL_INSTANCE,
        LABEL_OWNER_PID,
        LABEL_OWNER_START,
        LABEL_OWNER_BOOT,
        LABEL_OWNER_HOST,
        LABEL_OWNER_PIDNS,
        LABEL_DEADLINE,
    }
)

# Milliseconds past its kill deadline after which a container is a leftover whoever owns
# it: a live owner kills and removes at the deadline, so only a failed removal or a dead
# owner keeps it. Generous, so clock skew between hosts cannot matter.
STALE_AFTER_MS: Final = 5 * 60 * 1000


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` (field 22 of /proc/<pid>/stat, in clock ticks since boot)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19])  # fields 3.. start at index 0, so field 22 is index 19
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_ticks: int) -> bool:
    """True when a process with this pid exists and is the one that started at start_ticks."""
    return pid > 0 and process_start_ticks(pid) == start_ticks


@dataclass(frozen=True, slots=True)
class OwnerIdentity:
    pid: int
    start_ticks: int
    boot_id: str
    host_id: str
    pid_ns: str

    @classmethod
    def current(cls) -> OwnerIdentity:
        pid = os.getpid()
        host = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id") or ""
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        return cls(
            pid=pid,
            start_ticks=process_start_ticks(pid) or 0,
            boot_id=_read("/proc/sys/kernel/random/boot_id") or "",
            host_id=host or socket.gethostname(),
            pid_ns=pid_ns,
        )

    def labels(self) -> dict[str, str]:
        return {
            LABEL_OWNER_PID: str(self.pid),
            LABEL_OWNER_START: str(self.start_ticks),
            LABEL_OWNER_BOOT: self.boot_id,
            LABEL_OWNER_HOST: self.host_id,
            LABEL_OWNER_PIDNS: self.pid_ns,
        }

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> OwnerIdentity | None:
        """The owner recorded on a container, or None when the labels are missing/garbled."""
        try:
            ident = cls(
                pid=int(labels[LABEL_OWNER_PID]),
                start_ticks=int(labels[LABEL_OWNER_START]),
                boot_id=labels[LABEL_OWNER_BOOT],
                host_id=labels[LABEL_OWNER_HOST],
                pid_ns=labels[LABEL_OWNER_PIDNS],
            )
        except (KeyError, ValueError):
            return None
        if ident.pid <= 0 or not ident.boot_id or not ident.host_id:
            return None
        return ident


def orphan_reason(
    labels: Mapping[str, str],
    *,
    me: OwnerIdentity,
    my_instance: str,
    now_ms: int,
    owner_alive: Callable[[int, int], bool] = process_alive,
) -> str | None:
    """Why a container is a leftover to remove, or None to keep it.

    Keeps anything it cannot prove dead: containers not ours, of this instance, of an owner
    on another host or in another pid namespace (its pid means nothing here), and of owners
    with unreadable labels, unless the container is long past its own kill deadline.
    """
    if labels.get(LABEL_MANAGED) != "true":
        return None
    if labels.get(LABEL_INSTANCE) == my_instance:
        return None
    deadline = labels.get(LABEL_DEADLINE, "")
    if deadline.isdigit() and now_ms > int(deadline) + STALE_AFTER_MS:
        return f"past its deadline by more than {STALE_AFTER_MS // 1000} s"
    return owner_gone(labels, me=me, owner_alive=owner_alive)


def owner_gone(
    labels: Mapping[str, str],
    *,
    me: OwnerIdentity,
    owner_alive: Callable[[int, int], bool] = process_alive,
) -> str | None:
    """Why the owner the labels name is provably gone, or None: alive, this very
    process, on another host or pid namespace, or labels that name no owner."""
    owner = OwnerIdentity.from_labels(labels)
    if owner is None:
        return None
    if owner.host_id != me.host_id:
        return None
    if owner.boot_id != me.boot_id:
        return "its owner ran before the host rebooted"
    if owner.pid_ns != me.pid_ns:
        return None
    if owner.pid == me.pid and owner.start_ticks == me.start_ticks:
        return None  # another runner in this very process (e.g. a test): alive
    if not owner_alive(owner.pid, owner.start_ticks):
        return f"its owner (pid {owner.pid}) is gone"
    return None

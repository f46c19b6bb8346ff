"""Who holds a lease (a webhook delivery's claim, a SIEM destination's
cursor), written so that a later server can prove that process gone and take
the work back at once, instead of waiting out the lease
(dispatcher.CLAIM_LEASE_S, over a minute; siem/exporter.DEFAULT_LEASE_S).

A claim names its process the way a sandbox container names its server
(sandbox_runner/ownership.py): host, boot, pid namespace, pid and the pid's
start time, since a pid alone is reused. It is kept in the outbox's
``claimed_by`` text, after the ``host/nonce`` that made it unique before,
so no column changes:

    host/nonce;pid=812;start=93117;boot=<hash>;host_id=<hash>;pidns=pid:[4026531836]

(boot and host_id: the boot id and machine id, hashed as _hashed_ids says.)

Only a claimant on this host (machine id and hostname), in this boot and pid
namespace, whose process is not running, is gone (another boot is not enough:
see claimant_gone). Anything else (a live process, another host's
server on PostgreSQL, another pid namespace, a claim written before this
format) keeps its claim until the lease lapses.
"""

from __future__ import annotations

import hashlib
import socket
import uuid
from collections.abc import Callable
from dataclasses import replace

from sandbox_runner.ownership import (
    LABEL_OWNER_BOOT,
    LABEL_OWNER_HOST,
    LABEL_OWNER_PID,
    LABEL_OWNER_PIDNS,
    LABEL_OWNER_START,
    OwnerIdentity,
    owner_gone,
    process_alive,
)

# Field name in the claim -> the ownership label it stands for.
_FIELDS = {
    "pid": LABEL_OWNER_PID,
    "start": LABEL_OWNER_START,
    "boot": LABEL_OWNER_BOOT,
    "host_id": LABEL_OWNER_HOST,
    "pidns": LABEL_OWNER_PIDNS,
}
_BY_LABEL = {label: name for name, label in _FIELDS.items()}
# The machine id is not to be shown as it is (machine-id(5)): the claim, which
# other servers on a shared database read, holds it and the boot id hashed with
# this application key; equal ids still give equal hashes.
_ID_KEY = b"toolreg webhook claimant v1\0"


def _hashed_ids(me: OwnerIdentity) -> OwnerIdentity:
    def h(value: str) -> str:
        return hashlib.sha256(_ID_KEY + value.encode()).hexdigest()[:32] if value else ""

    return replace(me, host_id=h(me.host_id), boot_id=h(me.boot_id))


def claimant(me: OwnerIdentity, hostname: str | None = None, nonce: str | None = None) -> str:
    """The ``claimed_by`` of this process's dispatcher: unique per start."""
    host = (hostname if hostname is not None else socket.gethostname())[:64]
    head = f"{host}/{nonce if nonce is not None else uuid.uuid4().hex[:12]}"
    # ';' and '=' separate the fields; none of these values (from /proc, the
    # machine id or the hostname) has them, but a garbled one must not shift
    # the others: it is dropped, and the claim then proves nothing.
    fields = [
        f"{_BY_LABEL[label]}={value}"
        for label, value in _hashed_ids(me).labels().items()
        if ";" not in value and "=" not in value
    ]
    return ";".join([head.replace(";", "_"), *fields])


def claimant_gone(
    claimed_by: str,
    *,
    me: OwnerIdentity,
    owner_alive: Callable[[int, int], bool] = process_alive,
    hostname: str | None = None,
) -> str | None:
    """Why the process behind ``claimed_by`` is provably gone, or None (alive,
    this very process, elsewhere, or a claim that does not say)."""
    # The hostname must match too: hosts cloned from one image can share a
    # machine id, and there another boot id would read as a reboot.
    host = (hostname if hostname is not None else socket.gethostname())[:64]
    if claimed_by.split(";")[0].rpartition("/")[0] != host.replace(";", "_"):
        return None
    labels: dict[str, str] = {}
    for part in claimed_by.split(";")[1:]:
        name, sep, value = part.partition("=")
        if sep and name in _FIELDS:
            labels[_FIELDS[name]] = value
    hashed = _hashed_ids(me)
    # Another boot id is not taken for a reboot here (the reaper does so for its
    # containers): servers in containers on two hosts can share a hostname and a
    # machine id baked into their image, and would then take each other's live
    # claims. A claim from before a real reboot has mostly lapsed by now anyway.
    if labels.get(LABEL_OWNER_BOOT) != hashed.boot_id:
        return None
    return owner_gone(labels, me=hashed, owner_alive=owner_alive)

"""Reloading the policy while serving (docs/how-to/deploying.md, "A live policy"):
on SIGHUP, on `toolreg policy reload` (ReloadPolicy, admins), and when another
server on the store was asked to.

Each reload is an audit record carrying the new policy's digest (or, when the
file does not load, the first of its problems), so the audit log says which
policy held when. A reload asked through the RPC is announced on the store,
and every other server re-reads its own file; a server reloading because a
peer asked does not announce again.
"""

from __future__ import annotations

import contextlib
import logging

from registry_server.domain.errors import FailedPrecondition
from registry_server.policy.live import LivePolicy
from registry_server.policy.model import Policy, PolicyError
from registry_server.store import audit_chain as audit
from registry_server.store.base import Store

log = logging.getLogger(__name__)

MAX_PROBLEMS_AUDITED = 5  # problem lines of a refused reload kept in its audit record
MAX_PROBLEM_CHARS = 500  # characters of each


class PolicyReloads:
    def __init__(self, live: LivePolicy, store: Store) -> None:
        self._live = live
        self._store = store

    def reload(self, by: str, *, announce: bool = False) -> Policy:
        """Re-read the policy; ``by`` says who asked (a client id, "SIGHUP",
        "peer"). Raises FailedPrecondition naming every problem, the policy in
        force unchanged."""
        old = self._live.current
        try:
            new = self._live.reload()
        except PolicyError as exc:
            problems = [p[:MAX_PROBLEM_CHARS] for p in exc.problems[:MAX_PROBLEMS_AUDITED]]
            log.error("policy reload (%s) refused; the policy in force stays: %s", by,
                      "; ".join(exc.problems))  # fmt: skip
            with self._store.unit_of_work() as uow:
                audit.append(uow, "policy", {
                    "event": "reload_refused", "by": by, "source": old.source,
                    "digest_in_force": old.digest, "problems": problems,
                })  # fmt: skip
            raise FailedPrecondition(
                "the policy file does not load; the policy in force stays"
                f" (digest {old.digest[:16] or '-'}): " + "; ".join(exc.problems)
            ) from None
        with self._store.unit_of_work() as uow:
            audit.append(uow, "policy", {
                "event": "reloaded", "by": by, "source": new.source, "digest": new.digest,
                "previous_digest": old.digest,
            })  # fmt: skip
            if announce:
                uow.announce_policy(new.digest)
        return new

    def from_signal(self) -> None:
        with contextlib.suppress(FailedPrecondition):  # logged and audited; the old one serves
            self.reload("SIGHUP")

    def from_peer(self) -> None:
        with contextlib.suppress(FailedPrecondition):
            self.reload("peer")

"""The policy in force, replaced whole by a reload (docs/how-to/deploying.md, "A
live policy").

A reload reads the file again; a file that does not load is refused and the
policy in force stays, so a typo never leaves a server without a policy or
with half of one. Readers ask for ``current`` each time they decide, so a
successful reload holds from the next call on: a revoked client's next call
is refused, a removed approver's stored approvals stop counting, a narrowed
grant stops the tools outside it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from registry_server.policy.model import Policy, PolicyError

log = logging.getLogger(__name__)

PolicySource = Callable[[], Policy]  # what readers hold: the policy in force now


class LivePolicy:
    def __init__(self, load: Callable[[], Policy]) -> None:
        """``load`` reads the policy (the file, or development mode's keys);
        it raises PolicyError naming the file, line and rule."""
        self._load = load
        self._lock = threading.Lock()  # one reload at a time
        self._policy = load()
        self.loaded_at = time.time()
        self._listeners: list[Callable[[Policy], None]] = []

    @property
    def current(self) -> Policy:
        return self._policy

    def __call__(self) -> Policy:
        return self._policy

    def on_reload(self, listener: Callable[[Policy], None]) -> None:
        """Called with the new policy after each successful reload (what was
        derived from the old one is derived again)."""
        self._listeners.append(listener)

    def reload(self) -> Policy:
        """Read the policy again and put it in force; raises PolicyError (and
        keeps the old one) when it does not load."""
        with self._lock:
            # The identities seen under the old policy are re-derived under the new one.
            new = dataclasses.replace(self._load(), seen=self._policy.seen)
            self._policy, self.loaded_at = new, time.time()
            for listener in self._listeners:
                try:
                    listener(new)
                except Exception:  # a derivation must not undo the reload half-way
                    log.exception("applying the reloaded policy failed in %r", listener)
        log.info("policy reloaded from %s (digest %s)", new.source, new.digest[:16] or "-")
        return new


def source_of(policy: Policy | PolicySource) -> PolicySource:
    """A fixed policy as a source (tests and tools that never reload)."""
    if isinstance(policy, Policy):
        return lambda: policy
    return policy


__all__ = ["LivePolicy", "PolicyError", "PolicySource", "source_of"]

"""The webhook outbox: one stored delivery per (approval event, endpoint),
written by an ``Approvals.hooks`` hook inside the unit of work that stores
the event. So a committed event always has its deliveries and a rolled-back
one has none, and a server that stops or dies loses none: the rows wait in
the store until a dispatcher (dispatcher.py, on any server) delivers them.

The hook only writes rows; it never touches the network. That is what keeps
a down or slow receiver from slowing the approval RPCs.

Also here: when to try again after a failed attempt.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence

from registry_server.domain.models import SafetyLevel
from registry_server.notify.payload import Facts, render
from registry_server.policy.call_facts import egress_hosts, request_rule
from registry_server.policy.conditions import ToolFacts
from registry_server.policy.live import PolicySource, source_of
from registry_server.policy.model import Policy
from registry_server.policy.webhooks import WebhookSpec
from registry_server.store.base import (
    ApprovalEventRecord,
    ApprovalRequestRecord,
    UnitOfWork,
    WebhookDeliveryRecord,
)

DEFAULT_RETRY_BASE_S = 30.0  # seconds before the 2nd attempt; each later wait doubles
DEFAULT_MAX_ATTEMPTS = 8  # attempts before a delivery is failed: ~1 hour with the base above
MAX_RETRY_DELAY_S = 3_600.0  # seconds: no single wait is longer
JITTER = 0.5  # each wait is its nominal length times 0.75-1.25, so retries of many spread out


def retry_delay(
    attempts: int, base_s: float = DEFAULT_RETRY_BASE_S, rng: Callable[[], float] = random.random
) -> float:
    """Seconds to wait after ``attempts`` failed attempts (1, 2, ...): base,
    2 x base, 4 x base, ... up to MAX_RETRY_DELAY_S, with jitter. With the
    defaults, 8 attempts span about an hour (30 s + 60 s + ... + 32 min)."""
    nominal = min(MAX_RETRY_DELAY_S, base_s * 2.0 ** max(0, attempts - 1))
    return float(nominal * (1 + JITTER * (rng() - 0.5)))


def webhook_id(request_id: str, event_seq: int, endpoint: str) -> str:
    """The ``webhook-id`` header: one per (event, endpoint), the same on every
    attempt, so a receiver drops a delivery it already has. The request id
    (random) keeps ids apart across databases; the seq orders them."""
    return f"msg_{request_id}_{event_seq}_{endpoint}"


class Outbox:
    """The hook (``hook``) that queues an event's deliveries in its own transaction.

    The endpoints and the console link are the ones the server started with
    (their secrets are read at start); the rules that say how many approvals
    are missing are the policy's in force now (``policy``: a Policy, or what
    returns the current one after reloads)."""

    def __init__(
        self, specs: Sequence[WebhookSpec], policy: Policy | PolicySource, *,
        console_url: str = "", clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self._specs = tuple(specs)
        self._policy = source_of(policy)
        self._console_url = console_url
        self._clock = clock

    def hook(
        self, uow: UnitOfWork, event: ApprovalEventRecord, request: ApprovalRequestRecord
    ) -> None:
        wanting = [s for s in self._specs if s.wants(event.type)]
        if not wanting:
            return
        facts = self._facts(uow, event, request)
        now = self._clock()
        for spec in wanting:
            body = render(facts, spec.format, include_arguments=spec.include_arguments)
            uow.add_webhook_delivery(
                WebhookDeliveryRecord(
                    event_seq=event.seq,
                    endpoint=spec.id,
                    payload=body,
                    created_at=now,
                    webhook_id=webhook_id(request.id, event.seq, spec.id),
                    next_attempt_at=now,
                )
            )

    def _facts(
        self, uow: UnitOfWork, event: ApprovalEventRecord, request: ApprovalRequestRecord
    ) -> Facts:
        approvers = uow.approvers_of(request.id)
        level, categories, egress = _snapshot_facts(request.tool_manifest)
        policy = self._policy()
        tool = ToolFacts(
            request.tool_name, level.value, tuple(categories), request.tool_owner,
            request.tool_digest, egress,
        )  # fmt: skip
        rule = request_rule(
            policy, tool, request.arguments_json, request.requested_by, request.created_at
        )
        known = [a for a in map(policy.approver, approvers) if a is not None]
        return Facts(
            event_type=event.type, event_seq=event.seq, at=event.at, request_id=request.id,
            tool=request.tool_name, level=level.value, requested_by=request.requested_by,
            approvals_required=request.approvals_required,
            approvals_missing=rule.missing(known) if rule.requirements
            else max(0, request.approvals_required - len(approvers)),
            approved_by=approvers, state=request.state, actor=event.actor, reason=event.reason,
            created_at=request.created_at, expires_at=request.expires_at,
            arguments_json=request.arguments_json, console_url=self._console_url,
        )  # fmt: skip


def _snapshot_facts(manifest: str) -> tuple[SafetyLevel, list[str], tuple[str, ...]]:
    """Level, categories and egress hosts of the definition the request was
    made for (what conditions read as tool.*, as the approval service gives
    them: policy/call_facts.py). Requests exist only for dangerous tools, so
    that is the answer when the snapshot says nothing usable: a payload must
    never fail the transaction of its event."""
    try:
        snapshot = json.loads(manifest) if manifest else {}
        level = SafetyLevel.parse(str(snapshot.get("safety_level", "dangerous")))
        categories = [str(c) for c in snapshot.get("categories") or [] if isinstance(c, str)]
        entries = (snapshot.get("network") or {}).get("egress") or []
        hosts = egress_hosts(str(e) for e in entries if isinstance(e, str))
    except (ValueError, TypeError, AttributeError):
        return SafetyLevel.DANGEROUS, [], ()
    return level, categories, hosts

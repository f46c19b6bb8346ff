"""The kill switch (issue 22): deleting and disabling tools, by the rules.

Who may (owner or admin deletes, only an admin disables or enables, and only
an admin deletes a disabled tool), the reason's checks, what each writes to
the audit log, what listeners and another server's registry on the same
store see, what a disabled tool's calls get (TOOL_DISABLED with the reason),
its open approval requests voided with the reason in the same unit of work
(events, watches), an old approval never running a tool registered again
under the same name, and warm pools drained.

A real registry, approvals service and executor over the in-memory store and
the fake sandbox backend (tests/unit/fakes.py); no engine, no gRPC.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from registry_server.catalog.registry import RegisterOutcome, Registrant, Registry
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.errors import InvalidArgument, NotFound, PermissionDenied
from registry_server.domain.models import ToolDefinition
from registry_server.domain.outcome import Status
from registry_server.execution.warm_pool import WarmPools
from registry_server.signing.tokens import mint
from registry_server.store.base import FINAL_STATES, PENDING, VOIDED
from registry_server.store.memory import MemoryStore
from tests.factories import tool as make_tool
from tests.unit.test_executor import (
    AUDIENCE,
    CALLER,
    KEYS,
    MESSAGE,
    WIPE,
    Env,
    build,
    wait_until,
)

pytestmark = pytest.mark.unit

OWNER = Registrant("team-a")
OTHER = Registrant("team-b")
ADMIN = Registrant("ops", admin=True)


def audit(store: MemoryStore, kind: str | None = None) -> list[dict[str, Any]]:
    with store.reading() as reads:
        return [json.loads(e.record) for e in reads.audit_entries() if kind in (None, e.kind)]


@pytest.fixture
def registry() -> Registry:
    reg = Registry(MemoryStore())
    reg.register(make_tool(), by=OWNER)
    return reg


# ---------------------------------------------------------------- the registry's rules


def test_the_owner_deletes_its_tool_with_a_reason_in_the_audit_log(registry: Registry) -> None:
    heard: list[tuple[ToolDefinition | None, ToolDefinition | None]] = []
    registry.add_listener(lambda old, new: heard.append((old, new)))
    version = registry.version
    before = registry.get("echo")

    assert registry.delete("echo", reason="  superseded by echo2 ", by=OWNER) == before

    assert registry.find("echo") is None and registry.list() == []
    assert registry.version == version + 1
    assert heard == [(before, None)]
    assert audit(registry._store, "registration")[-1] == {  # type: ignore[arg-type]
        "event": "deleted", "tool": "echo", "digest": before.digest, "by": "team-a",
        "owner": "team-a", "reason": "superseded by echo2",
    }  # fmt: skip
    with pytest.raises(NotFound, match="Tool 'echo' not found"):
        registry.delete("echo", by=OWNER)


def test_another_client_may_not_delete_a_tool_an_admin_may(registry: Registry) -> None:
    with pytest.raises(PermissionDenied, match="belongs to 'team-a': only its owner or an admin"):
        registry.delete("echo", by=OTHER)
    assert registry.find("echo") is not None
    assert [r["event"] for r in audit(registry._store)] == ["created"]  # type: ignore[arg-type]
    registry.delete("echo", by=ADMIN)
    assert registry.find("echo") is None


def test_only_an_admin_disables_or_enables_and_a_disabling_needs_a_reason(
    registry: Registry,
) -> None:
    for who in (OWNER, OTHER):
        with pytest.raises(PermissionDenied, match="only an admin may disable or enable"):
            registry.set_enabled("echo", False, reason="x", by=who)
    with pytest.raises(InvalidArgument, match="reason: must not be empty"):
        registry.set_enabled("echo", False, reason="  ", by=ADMIN)
    with pytest.raises(NotFound):
        registry.set_enabled("nope", False, reason="x", by=ADMIN)
    assert not registry.get("echo").disabled


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("x" * 1001, "reason: longer than 1000 characters"),
        ("two\nlines", "reason: must not contain control characters"),
        ("\x1b[2Jclear", "reason: must not contain control characters"),
    ],
)
def test_a_reason_is_short_and_plain(registry: Registry, reason: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        registry.set_enabled("echo", False, reason=reason, by=ADMIN)
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        registry.delete("echo", reason=reason, by=OWNER)
    assert registry.find("echo") is not None and not registry.get("echo").disabled


def test_a_disabled_tool_stays_listed_and_is_enabled_again(registry: Registry) -> None:
    heard: list[tuple[bool | None, bool | None]] = []
    registry.add_listener(lambda o, n: heard.append((o and o.disabled, n and n.disabled)))
    digest = registry.get("echo").digest

    off = registry.set_enabled("echo", False, reason="leaks data", by=ADMIN)

    assert (off.disabled, off.disabled_reason, off.digest) == (True, "leaks data", digest)
    assert off.tokens_not_before > 0
    assert registry.list() == [off] and registry.get("echo") == off
    # the same switch again writes nothing; another reason is written
    assert registry.set_enabled("echo", False, reason="leaks data", by=ADMIN) == off
    on = registry.set_enabled("echo", True, by=ADMIN)
    assert (on.disabled, on.disabled_reason) == (False, "")
    assert on.tokens_not_before == off.tokens_not_before  # older tokens stay void
    assert registry.set_enabled("echo", True, by=ADMIN) == on
    assert heard == [(False, True), (True, False)]
    assert [(r["event"], r["reason"]) for r in audit(registry._store)[1:]] == [  # type: ignore[arg-type]
        ("disabled", "leaks data"), ("enabled", ""),
    ]  # fmt: skip


def test_replacing_a_disabled_tool_keeps_it_disabled(registry: Registry) -> None:
    registry.set_enabled("echo", False, reason="under review", by=ADMIN)
    changed = make_tool(description="Echoes, differently.")
    assert registry.register(changed, replace=True, by=OWNER) is RegisterOutcome.REPLACED
    now = registry.get("echo")
    assert (now.description, now.disabled, now.disabled_reason) == (
        "Echoes, differently.", True, "under review",
    )  # fmt: skip


def test_only_an_admin_deletes_a_disabled_tool(registry: Registry) -> None:
    registry.set_enabled("echo", False, reason="incident 7", by=ADMIN)
    # Deleting and registering again would switch it back on: the owner may not.
    with pytest.raises(PermissionDenied, match="disabled by an admin: only an admin may delete"):
        registry.delete("echo", by=OWNER)
    registry.delete("echo", reason="incident 7", by=ADMIN)
    assert registry.find("echo") is None


def test_a_deleted_name_is_registered_again_as_a_new_enabled_tool(registry: Registry) -> None:
    registry.set_enabled("echo", False, reason="bad", by=ADMIN)
    before = time.time()
    registry.delete("echo", by=ADMIN)
    assert registry.register(make_tool(), by=OTHER) is RegisterOutcome.CREATED
    again = registry.get("echo")
    assert (again.owner, again.disabled, again.disabled_reason) == ("team-b", False, "")
    assert before <= again.tokens_not_before <= time.time()  # when the name was deleted


def test_another_server_sees_a_deletion_and_a_disabling_on_reload() -> None:
    store = MemoryStore()
    one, two = Registry(store), Registry(store)
    one.register(make_tool(), by=OWNER)
    one.register(make_tool(name="other"), by=OWNER)
    two.reload("echo")
    two.reload("other")
    heard: list[tuple[str, bool | None]] = []
    two.add_listener(lambda o, n: heard.append(((n or o).name, n and n.disabled)))  # type: ignore[union-attr]

    one.set_enabled("echo", False, reason="r", by=ADMIN)
    two.reload("echo")
    assert two.get("echo").disabled and two.get("echo").disabled_reason == "r"
    one.delete("echo", by=ADMIN)
    version = two.version
    two.reload("echo")
    assert two.find("echo") is None and two.version == version + 1
    two.reload("echo")  # nothing more to hear
    one.delete("other", by=OWNER)
    two.reload(None)  # after a reconnect: a full reload finds it gone too
    assert two.names() == []
    assert heard == [("echo", True), ("echo", None), ("other", None)]


# ---------------------------------------------------------------- calls and approvals


@pytest.fixture
def env() -> Env:
    return build()


def admin_switch(env: Env, name: str, enabled: bool, reason: str = "") -> ToolDefinition:
    return env.registry.set_enabled(name, enabled, reason=reason, by=ADMIN)


def test_a_disabled_tools_calls_are_refused_with_the_reason_and_audited(env: Env) -> None:
    admin_switch(env, "echo", False, "prints secrets")

    outcome = env.call("echo")

    assert (outcome.status, outcome.success) == (Status.TOOL_DISABLED, False)
    assert outcome.error == "Tool 'echo' is disabled: prints secrets"
    entry = env.executions()[-1]
    assert (entry["status"], entry["tool"], entry["execution_id"], entry["decision"]) == (
        "TOOL_DISABLED", "echo", outcome.execution_id, "disabled",
    )  # fmt: skip
    assert env.backend.prepared == []
    admin_switch(env, "echo", True)
    assert env.call("echo").status is Status.OK


def test_a_disabled_dangerous_tool_opens_no_approval_request(env: Env) -> None:
    admin_switch(env, "wipe", False, "incident")
    outcome = env.call("wipe", approval_tokens=env.tokens(WIPE))
    assert outcome.status is Status.TOOL_DISABLED
    assert env.approvals.list_requests() == []
    assert env.executions()[-1]["decision"] == "disabled"  # never "allowed"


def test_a_call_waiting_for_a_slot_does_not_start_once_its_tool_is_disabled(env: Env) -> None:
    def switch_off(_prepared: object) -> None:  # between admission and the go byte
        admin_switch(env, "echo", False, "stop now")

    env.backend.on_prepare = switch_off
    outcome = env.call("echo")
    assert (outcome.status, outcome.error) == (
        Status.TOOL_DISABLED,
        "Tool 'echo' is disabled: stop now",
    )
    [prepared] = env.backend.prepared
    assert prepared.discarded and prepared.finished_input is None
    assert env.executions()[-1]["decision"] == "disabled"
    assert env.idle()


def test_a_running_call_finishes_when_its_tool_is_deleted(env: Env) -> None:
    def delete_meanwhile(_prepared: object) -> None:  # the tool has started
        env.registry.delete("echo", reason="gone", by=ADMIN)

    env.backend.on_finish = delete_meanwhile
    outcome = env.call("echo")
    assert outcome.status is Status.OK and outcome.content == json.dumps(
        MESSAGE, separators=(",", ":")
    )
    assert env.registry.find("echo") is None
    assert env.call("echo").status is Status.TOOL_NOT_FOUND


@pytest.mark.parametrize("how", ["delete", "disable"])
def test_open_requests_are_voided_with_the_reason_in_the_same_unit_of_work(
    env: Env, how: str
) -> None:
    required = env.call("wipe", {"message": "one"})
    other_args = env.call("wipe", {"message": "two"})
    assert required.approval_request is not None and other_args.approval_request is not None
    first, second = required.approval_request.id, other_args.approval_request.id
    sub = env.approvals.hub.subscribe(lambda e: True)
    commits = env.store.units_of_work

    if how == "delete":
        env.registry.delete("wipe", reason="compromised image", by=ADMIN)
        why = "tool 'wipe' was deleted: compromised image"
    else:
        admin_switch(env, "wipe", False, "compromised image")
        why = "tool 'wipe' was disabled: compromised image"

    assert env.store.units_of_work == commits + 1  # the change and the voids: one transaction
    for request_id in (first, second):
        voided = env.approvals.get(request_id)
        assert (voided.state, voided.voided_reason) == (VOIDED, why)
    events = [sub.events.get_nowait() for _ in range(2)]
    assert [(e.type, e.request_id, e.reason) for e in events] == [
        ("VOIDED", first, why), ("VOIDED", second, why),
    ]  # fmt: skip
    records = audit(env.store)
    assert records[-3]["event"] == ("deleted" if how == "delete" else "disabled")
    assert records[-2:] == [
        {"event": "voided", "request_id": r, "tool": "wipe", "reason": why, "by": "ops"}
        for r in (first, second)
    ]
    assert VOIDED in FINAL_STATES


def test_a_voided_request_denies_the_agents_call_naming_the_reason(env: Env) -> None:
    required = env.call("wipe")
    assert required.approval_request is not None
    request_id = required.approval_request.id
    for approver in ("alice", "bob"):  # fully approved before the kill switch
        token = mint(
            KEYS[approver], issuer=approver, audience=AUDIENCE, tool_name="wipe",
            tool_digest=WIPE.digest, args_digest=arguments_digest(MESSAGE), requester=CALLER,
            ttl_s=300, request_id=request_id,
        )  # fmt: skip
        env.approvals.submit(request_id, token, submitted_by=approver)
    admin_switch(env, "wipe", False, "do not run")
    admin_switch(env, "wipe", True)

    outcome = env.call("wipe", approval_request_id=request_id)

    assert outcome.status is Status.APPROVAL_DENIED
    assert outcome.error == (
        f"approval denied: approval request {request_id} was voided:"
        " tool 'wipe' was disabled: do not run"
    )
    assert env.backend.prepared == []
    # asked again, the same call gets a new request: approvals are asked for again
    again = env.call("wipe")
    assert again.status is Status.APPROVAL_REQUIRED and again.approval_request is not None
    assert again.approval_request.id != request_id
    assert again.approval_request.state == PENDING


def test_a_token_signed_before_deletion_does_not_run_the_tool_registered_again(
    env: Env,
) -> None:
    old = env.tokens(WIPE)  # unbound tokens, never stored: presented inline later
    env.registry.delete("wipe", reason="retired", by=ADMIN)
    assert env.registry.register(WIPE) is RegisterOutcome.CREATED  # the very same definition
    assert env.registry.get("wipe").digest == WIPE.digest

    outcome = env.call("wipe", approval_tokens=old)

    assert outcome.status is Status.APPROVAL_DENIED
    assert "was issued before tool 'wipe' was last deleted or disabled" in outcome.error
    assert env.backend.prepared == []
    assert not any(env.jti_used(j) for j in _jtis(old))
    # Tokens signed now (after the deletion) run it.
    fresh = tuple(
        mint(
            KEYS[a], issuer=a, audience=AUDIENCE, tool_name="wipe", tool_digest=WIPE.digest,
            args_digest=arguments_digest(MESSAGE), requester=CALLER, ttl_s=300,
            now=time.time() + 1,  # a whole second later than the deletion: iat is in seconds
        )
        for a in ("alice", "bob")
    )  # fmt: skip
    assert env.call("wipe", approval_tokens=fresh).status is Status.OK


def test_a_token_signed_before_disabling_does_not_count_after_enabling(env: Env) -> None:
    old = env.tokens(WIPE)
    admin_switch(env, "wipe", False, "pause")
    admin_switch(env, "wipe", True)
    outcome = env.call("wipe", approval_tokens=old)
    assert outcome.status is Status.APPROVAL_DENIED
    assert "last deleted or disabled; ask for a new approval" in outcome.error


def _jtis(tokens: tuple[str, ...]) -> list[str]:
    import jwt

    return [jwt.decode(t, options={"verify_signature": False})["jti"] for t in tokens]


# ---------------------------------------------------------------- warm pools


@pytest.fixture
def pools(env: Env) -> Iterator[WarmPools]:
    pools = WarmPools(env.backend, env.executor.warm_spec, env.admission)
    env.executor.use_pools(pools)
    env.registry.add_listener(pools.on_change)
    yield pools
    pools.close()


@pytest.mark.parametrize("how", ["delete", "disable"])
def test_the_warm_pool_is_drained_and_refills_only_when_enabled(
    env: Env, pools: WarmPools, how: str
) -> None:
    warm_echo = make_tool(warm_pool=2)  # echo, kept warm
    assert env.registry.register(warm_echo, replace=True) is RegisterOutcome.REPLACED
    wait_until(lambda: pools.stats().warm == {"echo": 2}, "the pool is warm")
    made = list(env.backend.prepared)

    if how == "delete":
        env.registry.delete("echo", by=ADMIN)
    else:
        admin_switch(env, "echo", False, "drain it")

    assert all(p.discarded for p in made)
    assert pools.stats().warm == {}
    assert env.admission.reserved == 0
    time.sleep(0.05)  # the worker makes none meanwhile
    assert len(env.backend.prepared) == 2
    if how == "disable":
        admin_switch(env, "echo", True)
        wait_until(lambda: pools.stats().warm == {"echo": 2}, "the pool refilled")

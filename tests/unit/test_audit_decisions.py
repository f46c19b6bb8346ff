"""The ``decision`` of an execution's audit record (execution/audit_record.py,
``decision_of``), one test per value. Each test makes the situation really
happen through the executor, as tests/unit/test_executor.py builds it (a real
registry, approvals service and admission over the in-memory store, the fake
sandbox backend of tests/unit/fakes.py), then reads the record the store got
and checks the decision against what happened: whether the backend made or
ran a container, the status, approval requests, tokens spent, approvers.

    not_found          no such tool (at look-up, or deleted between the gate and the start)
    invalid_arguments  the JSON Schema or one of the tool's guards
    approval_required  a dangerous call without enough approvals (a request is open)
    approval_denied    a wrong token or request, or tokens another call spent first
    disabled           the kill switch, before the gate or between it and the start
    policy_denied      a deny rule, or an approval rule whose condition errs
    refused            refused before the gate otherwise: no runtime, the owner's grant gone
    approved           passed the gate with approvals: ran, or tried to (its status says how)
    allowed            passed the gate needing none: ran, or tried to

Attempts that get no record, hence no decision (they raise out of
``Executor.execute``): a malformed tool name or approval request id, a
caller above its level, and every quota or capacity refusal. The client's
call rate is checked before the record exists; ``max_pending_approvals`` is
refused at the gate (``test_a_quota_refusal_at_the_gate_is_not_audited``);
admission (``max_queued``, the server's queue, a sandbox over the memory
budget, ``max_concurrent`` when a warm container is claimed) after it, in
``_run``, which does not catch AtCapacity. Only the rate and the queues are
counted anywhere (``toolreg_client_refused_calls_total``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from registry_server.domain.arguments import arguments_digest
from registry_server.domain.errors import EngineUnavailable, QuotaExceeded
from registry_server.domain.models import SafetyLevel
from registry_server.domain.outcome import Outcome, Status
from registry_server.execution.audit_record import decision_of
from registry_server.policy.clients import RegisterGrant
from registry_server.signing.tokens import mint_for
from sandbox_runner import EngineUnavailable as BackendEngineUnavailable
from sandbox_runner import SandboxError, SandboxSpec
from tests.factories import tool as make_tool
from tests.unit import test_executor
from tests.unit.fakes import FakePrepared, result
from tests.unit.test_executor import (
    CANONICAL,
    KEYS,
    WIPE,
    Env,
    build,
    jtis,
    sandbox_calls,
)

pytestmark = pytest.mark.unit

# test_executor's policy (a dangerous tool such as wipe needs two of alice, bob
# and carol), with a deny rule for wipe, an approval rule for deploy whose
# condition errs without `env`, and one open approval request per client.
_RULES = yaml.safe_load(test_executor.POLICY)
_RULES["approval_rules"].append(
    {"name": "prod-deploy", "match": {"tool": "deploy"}, "when": 'args.env == "prod"',
     "approvals_required": 1}
)  # fmt: skip
_RULES["deny_rules"] = [
    {"name": "no-root", "match": {"tool": "wipe"}, "when": 'args.message == "/"',
     "reason": "the root is never wiped"}
]  # fmt: skip
_RULES["quotas"] = {"default": {"max_pending_approvals": 1}}
POLICY = yaml.safe_dump(_RULES, sort_keys=False)

DEPLOY = make_tool(
    name="deploy",
    safety_level="dangerous",
    parameters={"type": "object", "properties": {"env": {"type": "string"}}},
)
GUARDED = make_tool(
    name="guarded",
    safety_level="dangerous",
    guard=[{"condition": 'args.message.startsWith("/work/")', "message": "only under /work/"}],
)
# Its secret is read after the gate; this server has no secrets directory.
SECRETIVE = make_tool(
    name="secretive", safety_level="dangerous", secrets=[{"name": "TOKEN", "deliver": "file"}]
)
ROOT = {"message": "/"}

# decision -> the tests that make it happen (``shows``)
TESTED: dict[str, list[str]] = {}


def shows(decision: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Marks a test as making ``decision`` happen."""

    def mark(test: Callable[..., None]) -> Callable[..., None]:
        TESTED.setdefault(decision, []).append(test.__name__)
        return test

    return mark


@pytest.fixture
def make_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Env]:
    """test_executor's ``build`` under this file's policy, with its tools."""
    monkeypatch.setattr(test_executor, "POLICY", POLICY)

    def make(**kw: Any) -> Env:
        env = build(**kw)
        for tool in (DEPLOY, GUARDED, SECRETIVE):
            env.registry.register(tool)
        return env

    return make


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def records_of(env: Env, outcome: Outcome) -> list[dict[str, Any]]:
    """The execution records of the call that ended with ``outcome``, oldest first."""
    assert outcome.execution_id
    return [e for e in env.executions() if e["execution_id"] == outcome.execution_id]


def record_of(env: Env, outcome: Outcome, decision: str) -> dict[str, Any]:
    """The call's final record, once its decision and status are checked."""
    entry = records_of(env, outcome)[-1]
    assert (entry["decision"], entry["status"]) == (decision, outcome.status.value)
    return entry


def spent(env: Env, tokens: tuple[str, ...]) -> list[bool]:
    return [env.jti_used(j) for j in jtis(tokens)]


def nothing_made(env: Env) -> bool:
    """The backend never made (let alone ran) a container."""
    return env.backend.prepared == [] and env.backend.finished_inputs == []


# ---------------------------------------------------------------- refused at or before the gate


@shows("not_found")
def test_an_unknown_tool_is_not_found(env: Env) -> None:
    outcome = env.call("nope")
    assert outcome.status is Status.TOOL_NOT_FOUND
    entry = record_of(env, outcome, "not_found")
    assert (entry["tool"], entry["tool_digest"], entry["level"]) == ("nope", "", "")
    assert env.backend.calls == []  # not even the engine's runtimes


@shows("not_found")
def test_a_tool_deleted_after_the_gate_is_not_found_and_never_starts(env: Env) -> None:
    tokens = env.tokens(WIPE)

    def delete(_spec: SandboxSpec) -> None:  # between admission and the start
        env.registry.delete("wipe", reason="compromised")

    env.backend.on_prepare = delete
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.TOOL_NOT_FOUND
    entry = record_of(env, outcome, "not_found")
    assert (entry["tool_digest"], entry["approvers"]) == (WIPE.digest, ["alice", "bob"])
    [prepared] = env.backend.prepared
    assert (prepared.discarded, env.backend.finished_inputs) == (True, [])
    assert spent(env, tokens) == [False, False]


@shows("invalid_arguments")
@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("wipe", '{"message": 5}', "$.message: 5 is not of type 'string'"),
        ("guarded", '{"message": "/etc/passwd"}', "guard failed: only under /work/"),
    ],
    ids=["schema", "guard"],
)
def test_invalid_arguments_open_no_request_and_run_nothing(
    env: Env, tool: str, arguments: str, error: str
) -> None:
    outcome = env.call(tool, arguments)
    assert outcome.status is Status.INVALID_ARGUMENTS
    assert error in outcome.error
    entry = record_of(env, outcome, "invalid_arguments")
    # The guard reads parsed arguments: only their digest is known by then.
    parsed = tool == "guarded"
    assert entry["args_digest"] == (arguments_digest({"message": "/etc/passwd"}) if parsed else "")
    assert env.approvals.list_requests() == []
    assert env.backend.calls == []


@shows("approval_required")
@pytest.mark.parametrize("approvers", [(), ("alice",)], ids=["no-token", "one-of-two"])
def test_too_few_approvals_open_a_request_and_run_nothing(
    env: Env, approvers: tuple[str, ...]
) -> None:
    tokens = env.tokens(WIPE, approvers=approvers) if approvers else ()
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.APPROVAL_REQUIRED
    request = outcome.approval_request
    assert request is not None and request.state == "PENDING"
    entry = record_of(env, outcome, "approval_required")
    assert entry["approvers"] == []
    assert entry["approval_request_id"] == request.id  # an auditor follows it to the request
    assert [r.id for r in env.approvals.list_requests()] == [request.id]
    assert sandbox_calls(env) == []
    assert not any(spent(env, tokens))


@shows("approval_denied")
def test_a_token_for_other_arguments_is_denied_at_the_gate(env: Env) -> None:
    tokens = env.tokens(WIPE, args={"message": "something else"})
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.APPROVAL_DENIED
    entry = record_of(env, outcome, "approval_denied")
    assert entry["approvers"] == []
    assert env.approvals.list_requests() == []
    assert sandbox_calls(env) == []
    assert spent(env, tokens) == [False, False]


@shows("approval_denied")
def test_tokens_a_racing_call_spent_first_are_denied_after_the_gate(env: Env) -> None:
    tokens = env.tokens(WIPE)
    racer: list[Outcome] = []

    def race(_spec: SandboxSpec) -> None:  # both passed the gate; the racer starts first
        env.backend.on_prepare = None
        racer.append(env.call("wipe", approval_tokens=tokens))

    env.backend.on_prepare = race
    outcome = env.call("wipe", approval_tokens=tokens)

    assert outcome.status is Status.APPROVAL_DENIED
    [winner] = racer
    assert [e["decision"] for e in records_of(env, winner)] == ["approved", "approved"]
    [entry] = records_of(env, outcome)  # no STARTING record: nothing was spent for it
    assert (entry["decision"], entry["status"]) == ("approval_denied", "APPROVAL_DENIED")
    assert entry["approvers"] == ["alice", "bob"]  # the approvals it presented
    racers, this = env.backend.prepared
    assert (racers.finished_input, this.finished_input, this.discarded) == (CANONICAL, None, True)


@shows("disabled")
def test_a_disabled_tool_is_refused_before_the_gate(env: Env) -> None:
    env.registry.set_enabled("wipe", False, reason="incident")
    tokens = env.tokens(WIPE)
    outcome = env.call("wipe", approval_tokens=tokens)
    assert (outcome.status, outcome.error) == (
        Status.TOOL_DISABLED, "Tool 'wipe' is disabled: incident",
    )  # fmt: skip
    entry = record_of(env, outcome, "disabled")
    assert entry["approvers"] == []  # the gate was never reached
    assert env.approvals.list_requests() == []
    assert env.backend.calls == []
    assert spent(env, tokens) == [False, False]


@shows("disabled")
def test_a_tool_disabled_after_the_gate_never_starts(env: Env) -> None:
    tokens = env.tokens(WIPE)

    def disable(_spec: SandboxSpec) -> None:  # between admission and the start
        env.registry.set_enabled("wipe", False, reason="stop now")

    env.backend.on_prepare = disable
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.TOOL_DISABLED
    entry = record_of(env, outcome, "disabled")
    assert entry["approvers"] == ["alice", "bob"]  # it passed the gate
    [prepared] = env.backend.prepared
    assert (prepared.discarded, env.backend.finished_inputs) == (True, [])
    assert spent(env, tokens) == [False, False]


@shows("policy_denied")
@pytest.mark.parametrize(
    ("tool", "args", "error", "allowed_args"),
    [
        ("wipe", ROOT, "denied by policy rule no-root: the root is never wiped",
         {"message": "/tmp"}),
        ("deploy", {}, "policy rule prod-deploy: its condition could not be evaluated",
         {"env": "prod"}),
    ],
    ids=["deny-rule", "erring-approval-rule"],
)  # fmt: skip
def test_policy_denied_opens_no_request_and_runs_nothing(
    env: Env, tool: str, args: dict[str, str], error: str, allowed_args: dict[str, str]
) -> None:
    outcome = env.call(tool, args)
    assert outcome.status is Status.POLICY_DENIED
    assert outcome.error.startswith(error)
    assert outcome.approval_request is None
    entry = record_of(env, outcome, "policy_denied")
    assert (entry["approvers"], entry["approval_request_id"]) == ([], None)
    assert env.approvals.list_requests() == []
    assert sandbox_calls(env) == []
    # The rule, not the tool, refused it: other arguments get the usual gate.
    assert env.call(tool, allowed_args).status is Status.APPROVAL_REQUIRED


def set_grant(env: Env, grant: RegisterGrant | None) -> None:
    """A reloaded policy gives the tools' owner ``grant`` (None: none at all)."""
    env.executor.use_sandbox_policy(
        dataclasses.replace(env.executor._planner.policy, grant_of=lambda _owner: grant)
    )


@shows("refused")
@pytest.mark.parametrize("why", ["no-runtime", "grant-narrowed"])
def test_refused_before_the_gate_asks_no_approver_and_runs_nothing(
    make_env: Callable[..., Env], why: str
) -> None:
    if why == "no-runtime":  # gVisor required, and the engine has runc only
        env = make_env(require_gvisor=True, runtimes=frozenset({"runc"}))
    else:  # the owner may register tools up to cautious now; wipe is dangerous
        env = make_env()
        set_grant(env, RegisterGrant(SafetyLevel.CAUTIOUS, ("*",)))
    tokens = env.tokens(WIPE)
    for offered in ((), tokens):  # asking for approval, and with enough of it
        outcome = env.call("wipe", approval_tokens=offered)
        assert (outcome.status, outcome.approval_request) == (Status.SANDBOX_ERROR, None)
        entry = record_of(env, outcome, "refused")
        assert (entry["approvers"], entry["runtime"], entry["container_id"]) == ([], "", "")
    assert env.approvals.list_requests() == []
    assert sandbox_calls(env) == []
    assert nothing_made(env)
    assert spent(env, tokens) == [False, False]


@shows("refused")
@pytest.mark.parametrize("tool", ["echo", "shell"])
def test_a_call_needing_no_approval_refused_before_the_gate_is_not_allowed(
    env: Env, tool: str
) -> None:
    set_grant(env, None)  # its owner's grant is gone
    outcome = env.call(tool)
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error.endswith("no longer holds a register grant in the policy")
    record_of(env, outcome, "refused")
    assert nothing_made(env)


# ---------------------------------------------------------------- past the gate


@shows("approved")
@pytest.mark.parametrize("how", ["tokens", "request"])
def test_an_approved_call_runs_and_records_its_approvers(env: Env, how: str) -> None:
    if how == "tokens":
        tokens, request_id, approvers = env.tokens(WIPE), "", ["alice", "bob"]
    else:
        required = env.call("wipe")
        assert required.approval_request is not None
        request_id, approvers = required.approval_request.id, ["alice", "carol"]
        for who in approvers:
            token = mint_for(KEYS[who], issuer=who, request=required.approval_request)
            env.approvals.submit(request_id, token, who)
        tokens = ()
    outcome = env.call("wipe", approval_tokens=tokens, approval_request_id=request_id)
    assert outcome.status is Status.OK
    starting, final = records_of(env, outcome)
    assert (starting["decision"], starting["status"]) == ("approved", "STARTING")
    assert record_of(env, outcome, "approved") == final
    for entry in (starting, final):
        assert entry["approvers"] == approvers and len(entry["jtis"]) == 2
        assert entry["approval_request_id"] == (request_id or None)
    [prepared] = env.backend.prepared
    assert (final["container_id"], final["exit_code"]) == (prepared.container_id, 0)
    assert env.backend.finished_inputs == [CANONICAL]
    if tokens:
        assert spent(env, tokens) == [True, True]
    else:
        assert env.approvals.get(request_id).state == "CONSUMED"


def _die(env: Env) -> None:
    def die(prepared: FakePrepared) -> None:
        prepared.dead = True

    env.backend.on_finish = die


# name -> (set-up, tool, status, error, whether the tool started: only then is
# the approval spent)
AFTER_APPROVAL: dict[str, tuple[Callable[[Env], None], str, Status, str, bool]] = {
    "image-missing": (
        lambda env: env.backend.fail_prepare(SandboxError("image toolreg/base not found")),
        "wipe", Status.SANDBOX_ERROR, "sandbox error: image toolreg/base not found", False,
    ),
    "secret-missing": (
        lambda env: None, "secretive", Status.SANDBOX_ERROR,
        "Tool 'secretive' cannot run: this server has no secrets directory", False,
    ),
    "cancelled-before-start": (
        lambda env: None, "wipe", Status.SANDBOX_ERROR, "call cancelled before it started", False,
    ),
    "container-gone": (_die, "wipe", Status.SANDBOX_ERROR, "sandbox error: container", True),
    "tool-error": (
        lambda env: env.backend.queue_result(result(exit_code=3, stderr=b"boom")),
        "wipe", Status.TOOL_ERROR, "boom", True,
    ),
    "timeout": (
        lambda env: env.backend.queue_result(result(exit_code=137, timed_out=True)),
        "wipe", Status.TIMEOUT, "Tool 'wipe' timed out", True,
    ),
    "out-of-memory": (
        lambda env: env.backend.queue_result(result(exit_code=137, oom_killed=True)),
        "wipe", Status.RESOURCE_EXHAUSTED, "Tool 'wipe' ran out of memory", True,
    ),
}  # fmt: skip


@shows("approved")
@pytest.mark.parametrize("case", AFTER_APPROVAL)
def test_an_approved_call_that_fails_after_the_gate_is_still_approved(env: Env, case: str) -> None:
    set_up, name, status, error, started = AFTER_APPROVAL[case]
    tool = env.registry.get(name)
    set_up(env)
    cancel = threading.Event()
    if case == "cancelled-before-start":
        cancel.set()
    tokens = env.tokens(tool)
    outcome = env.call(name, approval_tokens=tokens, cancel=cancel)
    assert (outcome.status, outcome.error[: len(error)]) == (status, error)
    entry = record_of(env, outcome, "approved")
    assert entry["approvers"] == ["alice", "bob"]
    assert entry["exit_code"] == (3 if status is Status.TOOL_ERROR else None)
    # Spent only by a call whose tool started (with its STARTING record).
    assert spent(env, tokens) == [started, started]
    assert len(records_of(env, outcome)) == (2 if started else 1)
    assert env.backend.finished_inputs == ([CANONICAL] if started else [])
    assert env.idle()


@shows("approved")
def test_an_approved_call_without_an_engine_is_recorded_as_approved(env: Env) -> None:
    tokens = env.tokens(WIPE)
    env.backend.fail_prepare(BackendEngineUnavailable("docker.sock: connection refused"))
    with pytest.raises(EngineUnavailable):
        env.call("wipe", approval_tokens=tokens)
    [entry] = env.executions()
    assert (entry["decision"], entry["status"]) == ("approved", "SANDBOX_ERROR")
    assert entry["approvers"] == ["alice", "bob"]
    assert spent(env, tokens) == [False, False]
    assert nothing_made(env)


@shows("allowed")
@pytest.mark.parametrize("tool", ["echo", "shell"])
def test_a_call_that_needs_no_approval_runs_and_is_allowed(env: Env, tool: str) -> None:
    outcome = env.call(tool)
    assert outcome.status is Status.OK
    [entry] = records_of(env, outcome)
    assert record_of(env, outcome, "allowed") == entry
    [prepared] = env.backend.prepared
    assert (entry["container_id"], entry["runtime"]) == (prepared.container_id, "runc")
    assert (entry["approvers"], entry["jtis"], entry["exit_code"]) == ([], [], 0)
    assert env.backend.finished_inputs == [CANONICAL]
    assert env.approvals.list_requests() == []


@shows("allowed")
@pytest.mark.parametrize(
    ("set_up", "status", "started"),
    [
        (lambda env: env.backend.fail_prepare(SandboxError("image gone")),
         Status.SANDBOX_ERROR, False),
        (_die, Status.SANDBOX_ERROR, True),
        (lambda env: env.backend.queue_result(result(exit_code=2)), Status.TOOL_ERROR, True),
        (lambda env: env.backend.queue_result(result(exit_code=137, timed_out=True)),
         Status.TIMEOUT, True),
    ],
    ids=["image-missing", "container-gone", "tool-error", "timeout"],
)  # fmt: skip
def test_a_call_that_needs_no_approval_and_fails_after_the_gate_is_still_allowed(
    env: Env, set_up: Callable[[Env], None], status: Status, started: bool
) -> None:
    set_up(env)
    outcome = env.call("echo")
    assert outcome.status is status
    record_of(env, outcome, "allowed")
    assert env.backend.finished_inputs == ([CANONICAL] if started else [])


# ---------------------------------------------------------------- no record, no decision


def test_a_quota_refusal_at_the_gate_is_not_audited(env: Env) -> None:
    first = env.call("wipe")
    assert first.status is Status.APPROVAL_REQUIRED  # the client's one open request
    before = env.kinds()
    with pytest.raises(QuotaExceeded) as info:
        env.call("wipe", {"message": "another"})
    assert info.value.limit == "max_pending_approvals"
    assert env.kinds() == before  # no execution record, no request
    assert sandbox_calls(env) == []


# ---------------------------------------------------------------- every value has its test


def decision_values() -> set[str]:
    """Every value ``decision_of`` can return, read from its source: the
    values of its table and the strings it returns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(decision_of)))
    values: set[str] = set()
    for node in ast.walk(tree):
        found: list[ast.expr] = []
        if isinstance(node, ast.Dict):
            found = list(node.values)
        elif isinstance(node, ast.Return) and node.value is not None:
            found = list(ast.walk(node.value))  # type: ignore[arg-type]
        values.update(
            n.value for n in found if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )
    return values


def test_every_decision_value_has_a_test_here() -> None:
    values = decision_values()
    assert {"allowed", "approved", "refused", "not_found"} <= values  # the reading works
    assert values == set(TESTED), (
        f"decision values without a test here: {sorted(values - set(TESTED))};"
        f" tests of values decision_of never returns: {sorted(set(TESTED) - values)}"
    )

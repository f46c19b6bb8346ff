"""The executor (execution/executor.py), step by step, against a fake sandbox
backend (tests/unit/fakes.py): name and look-up refusals and what they leave
in the audit log, argument checks, the caller's level, the sandbox a call
gets (canonical input, limits merged into the level's ceiling, the client's
deadline, gVisor for dangerous tools), the approval gate and when approvals
are spent (with the STARTING record, in one unit of work; never for a call
that did not start), engine failures, how results are classified,
cancellation, warm sandboxes, and a store that cannot write.

A real registry, approvals service, admission and policy (loaded from YAML),
the in-memory store; no engine, no gRPC, no network, no sleeping beyond a
few milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest

from registry_server.approvals.service import Approvals
from registry_server.catalog.registry import Registry
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.errors import (
    EngineUnavailable,
    InvalidArgument,
    PermissionDenied,
    StoreError,
    Violation,
)
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.domain.outcome import ApprovalRequestView, Outcome, Status
from registry_server.execution import sandbox_plan
from registry_server.execution.admission import Admission
from registry_server.execution.call_request import CallRequest
from registry_server.execution.executor import NOT_A_NAME, Executor
from registry_server.execution.sandbox_plan import SandboxPolicy
from registry_server.execution.secrets import SecretStore
from registry_server.execution.warm_pool import WarmPools
from registry_server.policy.clients import RegisterGrant
from registry_server.policy.model import Policy
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint, mint_for
from registry_server.store.memory import MemoryStore
from sandbox_runner import EngineUnavailable as BackendEngineUnavailable
from sandbox_runner import (
    Limits,
    PreparedSandbox,
    SandboxBackend,
    SandboxError,
    SandboxResult,
    SandboxSpec,
)
from sandbox_runner.pieces import gvisor_fix
from sandbox_runner.profiles import CAUTIOUS_LIMITS, SAFE_LIMITS, profile_for
from tests.factories import policy_of
from tests.factories import tool as make_tool
from tests.unit.fakes import FakeBackend, FakePrepared, result

pytestmark = pytest.mark.unit

AUDIENCE = "toolreg-test"
CALLER = "agent-1"
APPROVER_IDS = ("alice", "bob", "carol")
_PAIRS = {name: generate_keypair() for name in APPROVER_IDS}
KEYS = {name: load_private_key(pair[0]) for name, pair in _PAIRS.items()}
SAFE_MEMORY_CEILING_MB = 200  # the policy's safe ceiling (the built-in profile says 256)
JOIN_S = 1.0  # seconds: the longest anything here is waited for

# Every dangerous tool needs two approvers; the safe ceiling is tightened.
POLICY = f"""\
audience: {AUDIENCE}
approvers:
  - id: alice
    public_key: "{_PAIRS["alice"][1]}"
  - id: bob
    public_key: "{_PAIRS["bob"][1]}"
  - id: carol
    public_key: "{_PAIRS["carol"][1]}"
approval_rules:
  - match: {{level: dangerous}}
    approvals_required: 2
    max_token_ttl_s: 600
profiles:
  safe:
    memory_mb: {SAFE_MEMORY_CEILING_MB}
"""

MESSAGE = {"message": "hello"}
CANONICAL = b'{"message":"hello"}'

ECHO = make_tool()  # safe; {"message": string} required
SHELL = make_tool(name="shell", safety_level="cautious")
WIPE = make_tool(name="wipe", safety_level="dangerous", categories=["files"])
# asks for more memory and CPU than the safe ceiling, and less time and fewer pids
NUMBERS = make_tool(
    name="numbers",
    parameters={
        "type": "object",
        "properties": {"b": {"type": "number"}, "a": {"type": "string"}},
    },
    sandbox={
        "image": "toolreg/python",
        "command": ["python", "-c", "print(1)"],
        "env": {"ZED": "1", "ALPHA": "2"},
        "limits": {"memory_mb": 512, "cpu_millis": 4000, "pids": 10, "timeout_ms": 2000},
    },
)
TOOLS = (ECHO, SHELL, WIPE, NUMBERS)


# ---------------------------------------------------------------- stores


@dataclass(frozen=True)
class Commit:
    """One committed unit of work: the audit records it appended and the
    watched jtis it spent."""

    audit: tuple[dict[str, Any], ...]
    spent: frozenset[str]


class RecordingStore(MemoryStore):
    """A MemoryStore that remembers what each committed unit of work wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: set[str] = set()  # jtis whose spending is recorded
        self.commits: list[Commit] = []

    @contextmanager
    def unit_of_work(self) -> Iterator[Any]:
        with super().unit_of_work() as uow:
            before = len(uow.audit_entries())
            spent_before = {j for j in self.watched if uow.jti_used(j)}
            yield uow
            added = tuple(json.loads(e.record) for e in uow.audit_entries()[before:])
            spent = frozenset(j for j in self.watched if uow.jti_used(j)) - spent_before
        self.commits.append(Commit(added, spent))


class FailingStore(MemoryStore):
    """A MemoryStore whose writes fail (disk full) once ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    @contextmanager
    def unit_of_work(self) -> Iterator[Any]:
        if self.failing:
            raise StoreError("cannot write the store: disk full")
        with super().unit_of_work() as uow:
            yield uow


# ---------------------------------------------------------------- the executor under test


@dataclass
class Env:
    store: MemoryStore
    registry: Registry
    backend: FakeBackend
    admission: Admission
    approvals: Approvals
    executor: Executor

    def request(self, name: str, args: dict[str, Any] | str = MESSAGE, **kw: Any) -> CallRequest:
        text = args if isinstance(args, str) else json.dumps(args)
        return CallRequest(name, text, caller=kw.pop("caller", CALLER), **kw)

    def call(self, name: str, args: dict[str, Any] | str = MESSAGE, **kw: Any) -> Outcome:
        cancel = kw.pop("cancel", None)
        on_output = kw.pop("on_output", None)
        return self.executor.execute(self.request(name, args, **kw), on_output, cancel)

    def tokens(
        self,
        tool: ToolDefinition,
        args: dict[str, Any] = MESSAGE,
        approvers: tuple[str, ...] = ("alice", "bob"),
    ) -> tuple[str, ...]:
        return tuple(
            mint(
                KEYS[a],
                issuer=a,
                audience=AUDIENCE,
                tool_name=tool.name,
                tool_digest=tool.digest,
                args_digest=arguments_digest(args),
                requester=CALLER,
                ttl_s=300,
            )
            for a in approvers
        )

    def executions(self) -> list[dict[str, Any]]:
        """The execution records of the audit log, oldest first."""
        with self.store.reading() as reads:
            entries = reads.audit_entries()
        return [json.loads(e.record) for e in entries if e.kind == "execution"]

    def kinds(self) -> list[str]:
        with self.store.reading() as reads:
            return [e.kind for e in reads.audit_entries()]

    def jti_used(self, jti: str) -> bool:
        with self.store.reading() as reads:
            return reads.jti_used(jti)

    def idle(self) -> bool:
        """Admission holds nothing: every call gave its room back."""
        a = self.admission
        return (a.running, a.waiting, a.reserved, a.memory_mb) == (0, 0, 0, 0)


def jtis(tokens: tuple[str, ...]) -> list[str]:
    return [jwt.decode(t, options={"verify_signature": False})["jti"] for t in tokens]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ceilings(policy: Policy) -> dict[SafetyLevel, Limits]:
    """As the server builds them (api/app.py): the profile, the policy's fields over it."""
    return {
        level: profile_for(level.value).replace(**(policy.ceiling(level) or {}))
        for level in SafetyLevel
    }


def build(
    *,
    store: MemoryStore | None = None,
    runtimes: frozenset[str] = frozenset({"runc"}),
    require_gvisor: bool = False,
    max_running: int = 4,
    allow_hostinet: bool = True,
) -> Env:
    policy = policy_of(POLICY)
    store = store if store is not None else MemoryStore()
    registry = Registry(store)
    for tool in TOOLS:
        registry.register(tool)
    backend = FakeBackend(runtimes=runtimes)
    admission = Admission(max_running, max_waiting=4, memory_budget_mb=4096)
    approvals = Approvals(store, policy, registry)
    executor = Executor(
        registry,
        backend,
        admission=admission,
        policy=SandboxPolicy(
            ceilings=ceilings(policy),
            require_gvisor=require_gvisor,
            allow_hostinet=allow_hostinet,
        ),
        store=store,
        approvals=approvals,
    )
    return Env(store, registry, backend, admission, approvals, executor)


@pytest.fixture
def env() -> Env:
    return build()


def sandbox_calls(env: Env) -> list[str]:
    """What the call asked of the backend beyond the engine's list of runtimes
    (read before the approval gate, so no approval is asked for a call the
    engine cannot run)."""
    return [c for c in env.backend.calls if c != "runtimes"]


# ---------------------------------------------------------------- the fake itself


def test_the_fake_fits_the_backend_protocol() -> None:
    backend: SandboxBackend = FakeBackend()
    assert isinstance(backend, SandboxBackend)
    spec = SandboxSpec("toolreg/base", ("cat",), (), SAFE_LIMITS)
    prepared: PreparedSandbox = backend.prepare(spec, execution_id="x")
    assert prepared.alive() is True
    assert prepared.finish(b"in").stdout == b"in"
    assert prepared.alive() is False


def test_a_fake_sandbox_is_used_once() -> None:
    backend = FakeBackend()
    spec = SandboxSpec("toolreg/base", ("cat",), (), SAFE_LIMITS)
    first, second = (backend.prepare(spec, execution_id=str(i)) for i in range(2))
    assert first.finish(b"a").container_id == first.container_id
    with pytest.raises(RuntimeError, match="already finished"):
        first.finish(b"b")
    first.discard()  # after use: nothing happens
    second.discard()
    with pytest.raises(RuntimeError, match="already discarded"):
        second.finish(b"c")
    assert (first.finished_input, first.discarded, first.discard_calls) == (b"a", False, 1)
    assert (second.finished_input, second.discarded) == (None, True)
    assert backend.finished_inputs == [b"a"]
    assert backend.discarded_ids == [second.container_id]


# ---------------------------------------------------------------- refused before any sandbox


@pytest.mark.parametrize("name", ["", "Echo", "echo!", "../etc/passwd", "a" * 65, "echo\n"])
def test_a_malformed_name_is_not_found_and_leaves_no_trace(env: Env, name: str) -> None:
    before = env.kinds()
    outcome = env.call(name)
    assert outcome == Outcome(Status.TOOL_NOT_FOUND, error=NOT_A_NAME)
    assert env.kinds() == before  # no audit entry of any kind
    assert env.backend.calls == []


def test_an_unknown_tool_is_not_found_and_audited_once(env: Env) -> None:
    outcome = env.call("nope")
    assert outcome.status is Status.TOOL_NOT_FOUND
    assert outcome.error == "Tool 'nope' not found"
    [entry] = env.executions()
    assert entry["execution_id"] == outcome.execution_id != ""
    assert (entry["tool"], entry["tool_digest"], entry["level"]) == ("nope", "", "")
    assert (entry["decision"], entry["status"], entry["caller"]) == (
        "not_found", "TOOL_NOT_FOUND", CALLER,
    )  # fmt: skip
    assert env.backend.calls == []


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (
            '{"message": 5}',
            "invalid arguments for tool 'echo': $.message: 5 is not of type 'string'",
        ),
        ("{}", "invalid arguments for tool 'echo': $: 'message' is a required property"),
        ('{"message": "a", "message": "b"}', None),
        ("[1]", None),
        ("{", None),
    ],
)
def test_invalid_arguments_are_refused_before_any_sandbox(
    env: Env, arguments: str, error: str | None
) -> None:
    outcome = env.call("echo", arguments)
    assert outcome.status is Status.INVALID_ARGUMENTS
    if error is not None:
        assert outcome.error == error
    else:
        assert outcome.error.startswith("arguments_json: ")
    [entry] = env.executions()
    assert (entry["decision"], entry["status"], entry["args_digest"]) == (
        "invalid_arguments", "INVALID_ARGUMENTS", "",
    )  # fmt: skip
    assert entry["tool_digest"] == ECHO.digest
    assert env.backend.prepared == []
    assert env.backend.calls == []


@pytest.mark.parametrize("request_id", ["xyz", "A" * 32, "0" * 31, "0" * 33, "g" * 32])
def test_a_malformed_approval_request_id_is_an_invalid_request(env: Env, request_id: str) -> None:
    before = env.kinds()
    with pytest.raises(InvalidArgument) as info:
        env.call("wipe", approval_request_id=request_id)
    rule = "not an approval request id (32 lowercase hex digits)"
    assert info.value.message == f"approval_request_id: {rule}"
    assert info.value.violations == [Violation("approval_request_id", rule)]
    assert env.kinds() == before
    assert env.backend.calls == []


def test_an_unknown_approval_request_id_is_denied(env: Env) -> None:
    outcome = env.call("wipe", approval_request_id="0" * 32)
    assert outcome.status is Status.APPROVAL_DENIED
    assert outcome.error == f"approval denied: approval request '{'0' * 32}' not found"
    assert [e["decision"] for e in env.executions()] == ["approval_denied"]
    assert sandbox_calls(env) == []


def test_a_caller_below_the_tools_level_is_denied_without_a_sandbox(env: Env) -> None:
    before = env.kinds()
    with pytest.raises(PermissionDenied) as info:
        env.call("shell", max_level=SafetyLevel.SAFE)
    assert info.value.message == (
        f"client '{CALLER}' may run tools up to safe; 'shell' is cautious"
    )
    with pytest.raises(PermissionDenied):
        env.call("wipe", approval_tokens=env.tokens(WIPE), max_level=SafetyLevel.CAUTIOUS)
    assert env.kinds() == before
    assert env.backend.calls == []
    assert env.call("shell", max_level=SafetyLevel.CAUTIOUS).status is Status.OK


# ---------------------------------------------------------------- a call that runs


def test_a_safe_call_runs_once_with_the_canonical_arguments(env: Env) -> None:
    seen: list[tuple[str, bytes]] = []
    observed: list[tuple[dict[str, object], Outcome]] = []
    env.executor.observe(lambda entry, outcome: observed.append((entry, outcome)))
    text = '{"b": 1.0, "a": "x"}'  # key order and 1.0 differ from the canonical form
    canonical = b'{"a":"x","b":1}'

    outcome = env.call("numbers", text, on_output=lambda s, d: seen.append((s, d)))

    [prepared] = env.backend.prepared
    assert env.backend.calls == ["runtimes", "prepare", "finish"]
    assert prepared.spec.input == canonical
    assert env.backend.finished_inputs == [canonical]
    assert (prepared.finished_input, prepared.discarded) == (canonical, False)
    assert prepared.execution_id == outcome.execution_id
    assert outcome == Outcome(
        Status.OK, content=canonical.decode(), data_json=canonical.decode(), exit_code=0,
        duration_ms=1, execution_id=outcome.execution_id,
    )  # fmt: skip
    assert seen == [("stdout", canonical)]
    [entry] = env.executions()
    assert entry == {
        "execution_id": outcome.execution_id,
        "caller": CALLER,
        "tool": "numbers",
        "tool_digest": NUMBERS.digest,
        "level": "safe",
        "args_digest": sha256(canonical),
        "decision": "allowed",
        "approvers": [],
        "jtis": [],
        "approval_request_id": None,
        "status": "OK",
        "exit_code": 0,
        "duration_ms": 1,
        "runtime": "runc",
        "container_id": prepared.container_id,
        "warm": False,
        "limits": dataclasses.asdict(prepared.spec.limits),
    }
    assert [(e, o.status) for e, o in observed] == [(entry, Status.OK)]
    assert env.idle()


def test_the_spec_is_the_tools_request_within_its_levels_ceiling(env: Env) -> None:
    assert env.call("numbers", {"a": "x"}).status is Status.OK
    [spec] = env.backend.prepared_specs
    # memory and cpu: the ceiling (tighter); pids and timeout: the tool's (tighter);
    # the rest the ceiling's, as the tool cannot ask for them.
    assert spec.limits == Limits(
        memory_mb=SAFE_MEMORY_CEILING_MB, cpu_millis=SAFE_LIMITS.cpu_millis, pids=10,
        timeout_ms=2000, output_bytes=SAFE_LIMITS.output_bytes, tmpfs_mb=SAFE_LIMITS.tmpfs_mb,
        nofile=SAFE_LIMITS.nofile, fsize_mb=SAFE_LIMITS.fsize_mb,
    )  # fmt: skip
    assert (spec.image, spec.command, spec.runtime, spec.mounts) == (
        "toolreg/python", ("python", "-c", "print(1)"), "runc", (),
    )  # fmt: skip
    assert spec.env == (("ALPHA", "2"), ("ZED", "1"))
    # A tool that asks for nothing gets its level's ceiling as it is.
    assert env.call("shell").status is Status.OK
    assert env.backend.prepared_specs[1].limits == CAUTIOUS_LIMITS


def test_a_deadline_shorter_than_the_timeout_shortens_it(env: Env) -> None:
    deadline = time.monotonic() + 0.5
    assert env.call("numbers", {"a": "x"}, deadline=deadline).status is Status.OK
    [prepared] = env.backend.prepared
    assert prepared.finish_deadline is not None
    assert deadline - 0.05 <= prepared.finish_deadline <= deadline + 0.005
    assert prepared.spec.limits.timeout_ms == 2000  # made before the call's clock starts


@pytest.mark.parametrize("deadline_in_s", [None, 60.0])
def test_without_a_shorter_deadline_the_timeout_counts_from_the_start(
    env: Env, deadline_in_s: float | None
) -> None:
    started = time.monotonic()
    deadline = None if deadline_in_s is None else started + deadline_in_s
    assert env.call("numbers", {"a": "x"}, deadline=deadline).status is Status.OK
    [prepared] = env.backend.prepared
    assert prepared.finish_deadline is not None
    assert started + 2.0 <= prepared.finish_deadline <= time.monotonic() + 2.0


# ---------------------------------------------------------------- approvals


def test_a_dangerous_call_without_tokens_needs_approval_and_prepares_nothing(env: Env) -> None:
    outcome = env.call("wipe")
    assert outcome.status is Status.APPROVAL_REQUIRED
    request = outcome.approval_request
    assert request is not None
    assert (request.tool_name, request.tool_digest, request.requested_by) == (
        "wipe", WIPE.digest, CALLER,
    )  # fmt: skip
    assert (request.arguments_digest, request.approvals_required, request.state) == (
        arguments_digest(MESSAGE), 2, "PENDING",
    )  # fmt: skip
    assert outcome.error.startswith("Tool 'wipe' is dangerous: it needs 2 approval(s)")
    assert outcome.error.endswith(f"approval_request_id={request.id}")
    with env.store.reading() as reads:
        requested, executed = (json.loads(e.record) for e in reads.audit_entries()[-2:])
    assert (requested["event"], requested["request_id"]) == ("requested", request.id)
    assert (executed["decision"], executed["status"], executed["execution_id"]) == (
        "approval_required", "APPROVAL_REQUIRED", outcome.execution_id,
    )  # fmt: skip
    assert executed["args_digest"] == requested["args_digest"] == arguments_digest(MESSAGE)
    assert sandbox_calls(env) == []
    # Asking again opens no second request.
    again = env.call("wipe")
    assert again.approval_request is not None and again.approval_request.id == request.id
    assert env.kinds().count("approval") == 1


def test_enough_tokens_run_the_call_and_are_spent_with_the_starting_record() -> None:
    store = RecordingStore()
    env = build(store=store)
    tokens = env.tokens(WIPE)
    store.watched.update(jtis(tokens))
    at_finish: list[tuple[bool, str]] = []

    def check_at_finish(prepared: FakePrepared) -> None:  # the tool starts now
        at_finish.append((all(map(env.jti_used, jtis(tokens))), env.executions()[-1]["status"]))

    env.backend.on_finish = check_at_finish
    store.commits.clear()

    outcome = env.call("wipe", approval_tokens=tokens)

    assert outcome.status is Status.OK
    assert at_finish == [(True, "STARTING")]
    [prepared] = env.backend.prepared
    assert env.backend.finished_inputs == [CANONICAL]
    starting, final = store.commits
    assert starting.spent == frozenset(jtis(tokens))  # one unit of work: spent + recorded
    [record] = starting.audit
    assert (record["decision"], record["status"], record["execution_id"]) == (
        "approved", "STARTING", outcome.execution_id,
    )  # fmt: skip
    assert (record["approvers"], record["jtis"]) == (["alice", "bob"], jtis(tokens))
    assert (record["container_id"], record["runtime"]) == (prepared.container_id, "runc")
    assert final.spent == frozenset()
    [record] = final.audit
    assert (record["decision"], record["status"], record["exit_code"]) == ("approved", "OK", 0)
    assert env.idle()


def test_spent_tokens_are_denied_as_replayed(env: Env) -> None:
    tokens = env.tokens(WIPE)
    assert env.call("wipe", approval_tokens=tokens).status is Status.OK
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.APPROVAL_DENIED
    assert outcome.error == (
        "approval denied: approval token 1 rejected:"
        " token of 'alice' was already used (replayed jti)"
    )
    assert len(env.backend.prepared) == 1
    assert env.backend.finished_inputs == [CANONICAL]
    assert [e["decision"] for e in env.executions()] == [
        "approved", "approved", "approval_denied",
    ]  # fmt: skip


def test_one_token_is_not_enough(env: Env) -> None:
    outcome = env.call("wipe", approval_tokens=env.tokens(WIPE, approvers=("alice",)))
    assert outcome.status is Status.APPROVAL_REQUIRED
    assert "1 valid so far" in outcome.error
    assert sandbox_calls(env) == []


def test_tokens_for_other_arguments_are_denied(env: Env) -> None:
    tokens = env.tokens(WIPE, args={"message": "something else"})
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.APPROVAL_DENIED
    assert outcome.error == (
        "approval denied: approval token 1 rejected: arguments do not match (args_digest)"
    )
    assert sandbox_calls(env) == []


def test_an_approved_request_runs_once_and_is_consumed(env: Env) -> None:
    required = env.call("wipe")
    request = required.approval_request
    assert isinstance(request, ApprovalRequestView)
    for approver in ("alice", "carol"):
        env.approvals.submit(
            request.id, mint_for(KEYS[approver], issuer=approver, request=request), approver
        )
    outcome = env.call("wipe", approval_request_id=request.id)
    assert outcome.status is Status.OK
    assert env.approvals.get(request.id).state == "CONSUMED"
    entry = env.executions()[-1]
    assert (entry["approval_request_id"], entry["approvers"]) == (request.id, ["alice", "carol"])
    again = env.call("wipe", approval_request_id=request.id)
    assert again.status is Status.APPROVAL_DENIED
    assert again.error == f"approval denied: approval request {request.id} is consumed"
    assert env.backend.finished_inputs == [CANONICAL]


def test_tokens_spent_by_a_racing_call_deny_the_other_and_discard_its_sandbox(env: Env) -> None:
    tokens = env.tokens(WIPE)
    racer: list[Outcome] = []

    def race(spec: SandboxSpec) -> None:  # both calls passed the gate; the racer starts first
        env.backend.on_prepare = None
        racer.append(env.call("wipe", approval_tokens=tokens))

    env.backend.on_prepare = race
    outcome = env.call("wipe", approval_tokens=tokens)

    assert [o.status for o in racer] == [Status.OK]
    assert outcome.status is Status.APPROVAL_DENIED
    assert outcome.error == "approval denied: token of 'alice' was already used (replayed jti)"
    first, second = env.backend.prepared  # the racer's, then this call's
    assert (first.finished_input, first.discarded) == (CANONICAL, False)
    assert (second.finished_input, second.discarded) == (None, True)
    assert env.idle()


# ---------------------------------------------------------------- gVisor


def test_a_dangerous_tool_that_requires_gvisor_is_refused_without_runsc() -> None:
    env = build(require_gvisor=True, runtimes=frozenset({"runc"}))
    tokens = env.tokens(WIPE)
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == (
        f"Tool 'wipe' needs gVisor (runsc), which this engine lacks: {gvisor_fix()}"
    )
    assert env.backend.prepared == []
    assert not any(map(env.jti_used, jtis(tokens)))
    entry = env.executions()[-1]
    assert (entry["status"], entry["runtime"], entry["container_id"]) == ("SANDBOX_ERROR", "", "")
    # Other levels still run, under runc.
    assert env.call("echo").status is Status.OK
    assert [s.runtime for s in env.backend.prepared_specs] == ["runc"]


def test_a_dangerous_tool_runs_under_runsc_when_the_engine_has_it() -> None:
    env = build(require_gvisor=True, runtimes=frozenset({"runc", "runsc"}))
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    assert env.call("echo").status is Status.OK
    assert [s.runtime for s in env.backend.prepared_specs] == ["runsc", "runc"]
    assert [e["runtime"] for e in env.executions()] == ["runsc", "runsc", "runc"]


def test_without_require_gvisor_a_dangerous_tool_falls_back_to_runc(env: Env) -> None:
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    assert [s.runtime for s in env.backend.prepared_specs] == ["runc"]


# A dangerous tool with egress: gVisor with its own netstack (runsc-net), or nothing.
FETCH = make_tool(
    name="fetch", safety_level="dangerous", network={"egress": ["api.example.com:443"]}
)
NO_NET_FIX = (
    "Tool 'fetch' needs gVisor with networking (runtime 'runsc-net'), which this engine"
    f" lacks: {gvisor_fix()}"
)


def with_fetch(env: Env) -> Env:
    env.registry.register(FETCH)
    return env


def test_a_dangerous_tool_with_egress_runs_under_runsc_net_and_no_other() -> None:
    gvisor = frozenset({"runc", "runsc", "runsc-net"})
    env = with_fetch(build(require_gvisor=True, runtimes=gvisor))
    assert env.call("fetch", approval_tokens=env.tokens(FETCH)).status is Status.OK
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    assert env.call("shell").status is Status.OK
    fetch, wipe, shell = env.backend.prepared_specs
    assert (fetch.runtime, fetch.egress is not None) == ("runsc-net", True)
    assert (wipe.runtime, wipe.egress) == ("runsc", None)  # no egress: no network stack
    assert shell.runtime == "runc"
    # an approved call: its STARTING record, then its outcome
    runtimes = ["runsc-net", "runsc-net", "runsc", "runsc", "runc"]
    assert [e["runtime"] for e in env.executions()] == runtimes


@pytest.mark.parametrize("require_gvisor", [True, False], ids=["policy", "development"])
@pytest.mark.parametrize("runtimes", [{"runc", "runsc"}, {"runc"}], ids=["runsc-only", "no-gvisor"])
def test_an_engine_without_runsc_net_refuses_a_dangerous_tool_with_egress(
    require_gvisor: bool, runtimes: set[str]
) -> None:
    """Never runc, never runsc without a network, whatever the fallback setting:
    the development-mode fallback covers dangerous tools without egress only."""
    env = with_fetch(build(require_gvisor=require_gvisor, runtimes=frozenset(runtimes)))
    tokens = env.tokens(FETCH)
    outcome = env.call("fetch", approval_tokens=tokens)
    assert (outcome.status, outcome.error) == (Status.SANDBOX_ERROR, NO_NET_FIX)
    assert env.backend.prepared == []
    assert not any(map(env.jti_used, jtis(tokens)))  # the approval is kept for a retry
    entry = env.executions()[-1]
    assert (entry["status"], entry["runtime"], entry["container_id"]) == ("SANDBOX_ERROR", "", "")
    # A dangerous call without egress still gets what it got before.
    wipe = env.call("wipe", approval_tokens=env.tokens(WIPE))
    plain = "runsc" if "runsc" in runtimes else None if require_gvisor else "runc"
    assert [s.runtime for s in env.backend.prepared_specs] == ([plain] if plain else [])
    assert wipe.status is (Status.OK if plain else Status.SANDBOX_ERROR)


GVISOR_ALL = frozenset({"runc", "runsc", "runsc-net"})
HOSTINET_ARGS = ("--network=host",)  # what scripts/ensure_docker.sh registers where needed


def test_no_approval_is_asked_for_a_call_the_engine_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without runsc-net, a dangerous call with egress is refused before the
    approval gate: no request opens for approvers to sign in vain."""
    env = with_fetch(build(require_gvisor=True, runtimes=frozenset({"runc", "runsc"})))
    outcome = env.call("fetch")  # no tokens: this would open an approval request
    assert (outcome.status, outcome.error) == (Status.SANDBOX_ERROR, NO_NET_FIX)
    assert outcome.approval_request is None
    assert env.approvals.list_requests() == []
    assert [e["decision"] for e in env.executions()] == ["refused"]  # never "allowed"
    assert env.backend.prepared == []
    # Once the engine can run it, the same call asks for its approval as usual.
    env.backend.available_runtimes = GVISOR_ALL
    monkeypatch.setattr(sandbox_plan, "RUNTIMES_RECHECK_S", 0.0)  # the engine is asked again
    asked = env.call("fetch")
    assert asked.status is Status.APPROVAL_REQUIRED and asked.approval_request is not None
    assert len(env.approvals.list_requests()) == 1


@pytest.mark.parametrize(
    ("args", "mode"), [((), "netstack"), (("--network=sandbox",), "netstack"),
                       (HOSTINET_ARGS, "hostinet")],
)  # fmt: skip
def test_the_audit_record_says_which_gvisor_network_ran_the_call(
    args: tuple[str, ...], mode: str
) -> None:
    env = with_fetch(build(require_gvisor=True, runtimes=GVISOR_ALL))
    env.backend.runtime_args["runsc-net"] = args
    assert env.call("fetch", approval_tokens=env.tokens(FETCH)).status is Status.OK
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    fetch_starting, fetch_done, wipe_starting, wipe_done = env.executions()
    for record in (fetch_starting, fetch_done):
        assert (record["runtime"], record["gvisor_network"]) == ("runsc-net", mode)
    for record in (wipe_starting, wipe_done):  # runsc has no network to speak of
        assert record["runtime"] == "runsc" and "gvisor_network" not in record


HOSTINET_REFUSED = (
    "Tool 'fetch' needs gVisor with networking (runtime 'runsc-net'), which this engine runs"
    " with hostinet (--network=host: the tool's socket calls reach the host kernel's network"
    " stack), refused by TOOLREG_GVISOR_HOSTINET=refuse: install runsc from gVisor"
    f" release-20240801 or later, then {gvisor_fix()}, for gVisor's netstack"
    " (docs/how-to/deploying.md, 1. The engine)"
)


def test_a_server_that_refuses_hostinet_fails_closed_before_any_approval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = with_fetch(build(require_gvisor=True, runtimes=GVISOR_ALL, allow_hostinet=False))
    env.backend.runtime_args["runsc-net"] = HOSTINET_ARGS
    asked = env.call("fetch")
    assert (asked.status, asked.error) == (Status.SANDBOX_ERROR, HOSTINET_REFUSED)
    assert env.approvals.list_requests() == []  # nobody is asked to sign it
    tokens = env.tokens(FETCH)
    refused = env.call("fetch", approval_tokens=tokens)
    assert (refused.status, refused.error) == (Status.SANDBOX_ERROR, HOSTINET_REFUSED)
    assert env.backend.prepared == [] and not any(map(env.jti_used, jtis(tokens)))
    # Everything else runs as before: without egress, runsc has no network at all.
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    assert [s.runtime for s in env.backend.prepared_specs] == ["runsc"]
    # With gVisor's netstack, the same server runs the call.
    env.backend.runtime_args["runsc-net"] = ("--network=sandbox",)
    monkeypatch.setattr(sandbox_plan, "RUNTIMES_RECHECK_S", 0.0)  # the engine is asked again
    assert env.call("fetch", approval_tokens=tokens).status is Status.OK


def test_runsc_net_without_a_network_is_refused() -> None:
    env = with_fetch(build(require_gvisor=True, runtimes=GVISOR_ALL))
    env.backend.runtime_args["runsc-net"] = ("--network=none",)
    outcome = env.call("fetch", approval_tokens=env.tokens(FETCH))
    assert outcome.status is Status.SANDBOX_ERROR
    assert "starts with --network=none: no network for the sandbox" in outcome.error
    assert env.backend.prepared == []


def test_a_switch_to_hostinet_is_seen_within_the_recheck_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """scripts/ensure_docker.sh may switch runsc-net's mode with a reload while
    the server runs: the mode a call runs under is never older than
    RUNTIMES_RECHECK_S, even though runsc-net was there all along."""
    env = with_fetch(build(require_gvisor=True, runtimes=GVISOR_ALL, allow_hostinet=False))
    tokens = env.tokens(FETCH)
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    env.backend.runtime_args["runsc-net"] = HOSTINET_ARGS
    assert env.call("fetch", approval_tokens=tokens).status is Status.OK  # within the interval
    assert env.backend.calls.count("runtimes") == 1
    monkeypatch.setattr(sandbox_plan, "RUNTIMES_RECHECK_S", 0.0)
    refused = env.call("fetch", approval_tokens=env.tokens(FETCH))
    assert (refused.status, refused.error) == (Status.SANDBOX_ERROR, HOSTINET_REFUSED)
    # Calls without runsc-net keep the answer they have: no engine query each.
    asked = env.backend.calls.count("runtimes")
    assert env.call("wipe", approval_tokens=env.tokens(WIPE)).status is Status.OK
    assert env.backend.calls.count("runtimes") == asked


def test_runsc_net_registered_while_the_server_runs_is_found_without_a_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = with_fetch(build(require_gvisor=True, runtimes=frozenset({"runc", "runsc"})))
    tokens = env.tokens(FETCH)
    assert env.call("fetch", approval_tokens=tokens).status is Status.SANDBOX_ERROR
    env.backend.available_runtimes = frozenset({"runc", "runsc", "runsc-net"})
    # Within RUNTIMES_RECHECK_S of the last answer the engine is not asked again.
    assert env.call("fetch", approval_tokens=tokens).status is Status.SANDBOX_ERROR
    assert env.backend.calls.count("runtimes") == 1
    monkeypatch.setattr(sandbox_plan, "RUNTIMES_RECHECK_S", 0.0)
    assert env.call("fetch", approval_tokens=tokens).status is Status.OK
    assert [s.runtime for s in env.backend.prepared_specs] == ["runsc-net"]


# ---------------------------------------------------------------- engine failures


def test_a_sandbox_error_keeps_the_approval_for_a_retry(env: Env) -> None:
    tokens = env.tokens(WIPE)
    env.backend.fail_prepare(SandboxError("image toolreg/base not found"))
    outcome = env.call("wipe", approval_tokens=tokens)
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == "sandbox error: image toolreg/base not found"
    assert outcome.execution_id != ""
    assert env.backend.prepared == []
    assert not any(map(env.jti_used, jtis(tokens)))
    entry = env.executions()[-1]
    assert (entry["decision"], entry["status"], entry["container_id"]) == (
        "approved", "SANDBOX_ERROR", "",
    )  # fmt: skip
    assert env.idle()

    retry = env.call("wipe", approval_tokens=tokens)
    assert retry.status is Status.OK
    assert all(map(env.jti_used, jtis(tokens)))
    assert env.backend.finished_inputs == [CANONICAL]


def test_a_sandbox_errors_text_is_redacted_of_the_calls_secrets(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A prestarted interpreter's preload runs with the call's file secrets
    mounted and its failure's message (the init's 'F' frame) becomes the
    SandboxError: the secret must not reach the error, the audit log or a log line."""
    value = "s3cr3t-file-value-91c2"
    tool = make_tool(
        name="warm_secret", safety_level="cautious",
        secrets=[{"name": "TOKEN", "deliver": "file"}],
        sandbox={"image": "toolreg/python", "command": ["python3", "-c", "print(1)"],
                 "prestart": "python", "preload": ["evil"]},
    )  # fmt: skip
    env.registry.register(tool)
    planner = env.executor._planner
    planner.policy = dataclasses.replace(
        planner.policy,
        secrets=SecretStore(Path("/nonexistent"), environ={"TOOLREG_SECRET_TOKEN": value}),
    )
    env.backend.fail_prepare(SandboxError(f"prestart: preload 'evil' failed: {value}"))
    with caplog.at_level("DEBUG"):
        outcome = env.call("warm_secret")
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == "sandbox error: prestart: preload 'evil' failed: [secret TOKEN]"
    assert value not in json.dumps(env.executions())
    assert value not in caplog.text
    assert env.idle()


@pytest.mark.parametrize("tool", ["echo", "wipe"])
def test_no_engine_raises_unavailable_and_is_still_audited(env: Env, tool: str) -> None:
    tokens = env.tokens(WIPE) if tool == "wipe" else ()
    env.backend.fail_prepare(BackendEngineUnavailable("docker.sock: connection refused"))
    with pytest.raises(EngineUnavailable) as info:
        env.call(tool, approval_tokens=tokens)
    assert info.value.message == "no container engine answers: docker.sock: connection refused"
    assert isinstance(info.value.__cause__, BackendEngineUnavailable)
    [entry] = env.executions()
    assert (entry["tool"], entry["status"]) == (tool, "SANDBOX_ERROR")
    assert entry["decision"] == ("approved" if tokens else "allowed")
    assert not any(map(env.jti_used, jtis(tokens)))
    assert env.backend.prepared == []
    assert env.idle()


def test_a_sandbox_that_dies_before_its_call_is_a_sandbox_error(env: Env) -> None:
    def die(prepared: FakePrepared) -> None:
        prepared.dead = True

    env.backend.on_finish = die
    outcome = env.call("echo")
    [prepared] = env.backend.prepared
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == f"sandbox error: container {prepared.container_id} is gone"
    assert env.idle()


# ---------------------------------------------------------------- what came out


@pytest.mark.parametrize(
    ("scripted", "status", "error"),
    [
        (result(exit_code=137, oom_killed=True), Status.RESOURCE_EXHAUSTED,
         "Tool 'echo' ran out of memory and was stopped"),
        (result(exit_code=137, oom_killed=True, timed_out=True), Status.RESOURCE_EXHAUSTED,
         "Tool 'echo' ran out of memory and was stopped"),
        (result(exit_code=137, pids_exhausted=True), Status.RESOURCE_EXHAUSTED,
         "Tool 'echo' hit its process limit"),
        (result(exit_code=137, output_truncated=True), Status.RESOURCE_EXHAUSTED,
         "Tool 'echo' wrote more output than allowed; it was stopped and its output cut"),
        (result(exit_code=137, timed_out=True), Status.TIMEOUT,
         "Tool 'echo' timed out and was stopped"),
        (result(exit_code=3, stderr=b"warning\nboom\n"), Status.TOOL_ERROR, "warning\nboom"),
        (result(exit_code=2), Status.TOOL_ERROR, "exited with code 2"),
        (result(exit_code=None), Status.TOOL_ERROR, "exited with code None"),
    ],
)  # fmt: skip
def test_results_are_classified(
    env: Env, scripted: SandboxResult, status: Status, error: str
) -> None:
    env.backend.queue_result(dataclasses.replace(scripted, stdout=b'{"partial": true}'))
    outcome = env.call("echo")
    assert (outcome.status, outcome.error) == (status, error)
    assert outcome.data_json == ""  # only an OK result carries data
    assert outcome.content == '{"partial": true}'
    assert outcome.exit_code == (-1 if scripted.exit_code is None else scripted.exit_code)
    assert outcome.stderr == scripted.stderr.decode()
    assert outcome.output_truncated is scripted.output_truncated
    [entry] = env.executions()
    assert entry["status"] == status.value
    assert entry["exit_code"] == (outcome.exit_code if status is Status.TOOL_ERROR else None)


@pytest.mark.parametrize(
    ("stdout", "data_json"),
    [
        (b'{"a": 1}\n', '{"a": 1}'),
        (b"  [1, 2]  ", "[1, 2]"),
        (b"hello", ""),
        (b"", ""),
        (b'{"a": 1, "a": 2}', ""),  # duplicate keys are not JSON here
    ],
)
def test_json_stdout_becomes_data(env: Env, stdout: bytes, data_json: str) -> None:
    env.backend.queue_result(result(stdout=stdout, stderr=b"note"))
    outcome = env.call("echo")
    assert outcome.status is Status.OK
    assert (outcome.content, outcome.data_json, outcome.stderr) == (
        stdout.decode(), data_json, "note",
    )  # fmt: skip


# ---------------------------------------------------------------- cancellation


def test_a_call_cancelled_before_it_starts_gets_no_sandbox(env: Env) -> None:
    cancel = threading.Event()
    cancel.set()
    tokens = env.tokens(WIPE)
    outcome = env.call("wipe", approval_tokens=tokens, cancel=cancel)
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == "call cancelled before it started"
    assert env.backend.prepared == []
    assert not any(map(env.jti_used, jtis(tokens)))
    assert env.executions()[-1]["status"] == "SANDBOX_ERROR"
    assert env.idle()


def test_a_call_cancelled_while_its_sandbox_is_made_discards_it(env: Env) -> None:
    cancel = threading.Event()
    env.backend.on_prepare = lambda spec: cancel.set()
    tokens = env.tokens(WIPE)
    outcome = env.call("wipe", approval_tokens=tokens, cancel=cancel)
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error == "call cancelled before it started"
    [prepared] = env.backend.prepared
    assert (prepared.discarded, prepared.finished_input) == (True, None)
    assert env.backend.discarded_ids == [prepared.container_id]
    assert not any(map(env.jti_used, jtis(tokens)))
    assert env.idle()
    # The approval was not spent: the same tokens work.
    env.backend.on_prepare = None
    assert env.call("wipe", approval_tokens=tokens).status is Status.OK


def test_a_call_cancelled_while_it_runs_is_a_sandbox_error(env: Env) -> None:
    cancel = threading.Event()
    env.backend.on_finish = lambda prepared: cancel.set()
    outcome = env.call("echo", cancel=cancel)
    assert (outcome.status, outcome.error) == (Status.SANDBOX_ERROR, "call cancelled")
    [prepared] = env.backend.prepared
    assert prepared.finish_cancel is cancel


# ---------------------------------------------------------------- warm sandboxes


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


@pytest.fixture
def pools(env: Env) -> Iterator[WarmPools]:
    pools = WarmPools(env.backend, env.executor.warm_spec, env.admission)
    env.executor.use_pools(pools)
    yield pools
    pools.close()


def test_a_call_takes_a_warm_sandbox(env: Env, pools: WarmPools) -> None:
    warm_echo = dataclasses.replace(ECHO, warm_pool=1)
    pools.track(warm_echo)
    wait_until(lambda: pools.stats().warm == {"echo": 1}, "the pool is warm")
    [warm] = env.backend.prepared
    assert warm.spec.input == b""

    outcome = env.call("echo")

    assert outcome.status is Status.OK
    assert warm.finished_input == CANONICAL
    entry = env.executions()[-1]
    assert (entry["warm"], entry["container_id"]) == (True, warm.container_id)
    assert pools.stats().hits == 1
    wait_until(lambda: len(env.backend.prepared) == 2, "the pool refilled")
    assert env.admission.running == 0


def test_a_cancelled_call_gives_its_warm_sandbox_back_unused(env: Env, pools: WarmPools) -> None:
    pools.track(dataclasses.replace(ECHO, warm_pool=1))
    wait_until(lambda: pools.stats().warm == {"echo": 1}, "the pool is warm")
    [warm] = env.backend.prepared
    cancel = threading.Event()
    cancel.set()
    outcome = env.call("echo", cancel=cancel)
    assert (outcome.status, outcome.error) == (
        Status.SANDBOX_ERROR, "call cancelled before it started",
    )  # fmt: skip
    assert (warm.discarded, warm.finished_input) == (True, None)
    assert env.admission.running == 0


# ---------------------------------------------------------------- a store that cannot write


def test_a_store_that_cannot_write_fails_audited_calls_but_not_safe_ones() -> None:
    store = FailingStore()
    env = build(store=store)
    tokens = env.tokens(WIPE)
    store.failing = True

    safe = env.call("echo")
    assert safe.status is Status.OK  # its record is lost; the answer is not
    with pytest.raises(StoreError):
        env.call("shell")  # it ran, but without a record there is no answer
    assert env.backend.finished_inputs == [CANONICAL, CANONICAL]
    with pytest.raises(StoreError):
        env.call("wipe", approval_tokens=tokens)  # spending fails: the tool never starts
    assert env.backend.prepared[-1].discarded is True
    assert env.backend.finished_inputs == [CANONICAL, CANONICAL]
    assert env.executions() == []
    assert not any(map(env.jti_used, jtis(tokens)))
    assert env.idle()

    store.failing = False
    assert env.call("wipe", approval_tokens=tokens).status is Status.OK


def test_a_narrowed_grant_refuses_the_call_before_any_approval_is_asked(env: Env) -> None:
    # A reloaded policy that no longer lets the owner give the tool its level.
    narrowed = RegisterGrant(SafetyLevel.CAUTIOUS, ("*",))
    env.executor.use_sandbox_policy(
        dataclasses.replace(env.executor._planner.policy, grant_of=lambda _owner: narrowed)
    )
    outcome = env.call("wipe")
    assert outcome.status is Status.SANDBOX_ERROR
    assert outcome.error.startswith("Tool 'wipe' cannot run: client ")
    assert "may register tools up to level cautious; 'wipe' is dangerous" in outcome.error
    assert env.kinds().count("approval") == 0  # the approvers were never asked
    assert sandbox_calls(env) == []

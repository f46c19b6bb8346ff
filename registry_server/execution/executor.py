"""Executing one tool call, as a pipeline of named steps:

    look up -> [a turn, when the arguments are large] -> check arguments -> guards, deny rules
            -> choose the runtime -> approval gate
            -> plan the sandbox
            -> run (admission, a warm or cold sandbox, spend the approval, start)
            -> record (the audit log, the execution log, observers)

The runtime is chosen before the approval gate: approvers are never asked to
sign a call that this engine (or the server's settings) would refuse to run.

A step that refuses the call ends it with an ``Outcome`` that is recorded like
every other attempt. Only problems of the request or the server (a caller above
its level, a malformed request id, capacity, no engine) raise.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack

from registry_server.approvals.service import Approvals, Call, Denied, Required
from registry_server.catalog.registry import Registry
from registry_server.domain.arguments import ParsedArguments, check_size, parse_arguments
from registry_server.domain.errors import (
    EngineUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    ToolregError,
    Violation,
)
from registry_server.domain.models import NAME_PATTERN, SafetyLevel, ToolDefinition, valid_tool_name
from registry_server.domain.outcome import ApprovalRequestView, Outcome, Status
from registry_server.execution import tracing
from registry_server.execution.admission import Admission, Cancelled
from registry_server.execution.audit_record import AuditRecord, decision_of
from registry_server.execution.call_log import CallCancel
from registry_server.execution.call_request import CallRequest
from registry_server.execution.heavy_work import Checked, HeavyWork
from registry_server.execution.quotas import RateLimits
from registry_server.execution.redaction import Redactor
from registry_server.execution.results import outcome_of
from registry_server.execution.sandbox_plan import (
    NoRuntime,
    NotRunnable,
    Runtime,
    SandboxPlanner,
    SandboxPolicy,
    within_deadline,
)
from registry_server.execution.warm_pool import WarmPools
from registry_server.policy.call_facts import call_facts
from registry_server.policy.conditions import CallFacts, Scope, compile_condition, first_failing
from registry_server.policy.model import RuleNotEvaluable
from registry_server.store.base import Store
from registry_server.store.group_commit import AuditAppender
from sandbox_runner import EngineUnavailable as BackendEngineUnavailable
from sandbox_runner import (
    PreparedSandbox,
    SandboxBackend,
    SandboxError,
    SandboxResult,
    SandboxSpec,
    after_call,
)

log = logging.getLogger(__name__)
execution_log = logging.getLogger("toolreg.executions")

OutputSink = Callable[[str, bytes], None]
Observer = Callable[[dict[str, object], Outcome], None]
NOT_A_NAME = f"Tool not found: tool names match {NAME_PATTERN}"
REQUEST_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")  # what Approvals issues (uuid4 hex)


class _Refused(Exception):
    """A step ended the call before any sandbox; ``outcome`` says how."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome


class Executor:
    def __init__(
        self,
        registry: Registry,
        backend: SandboxBackend,
        *,
        admission: Admission,
        policy: SandboxPolicy,
        store: Store,
        approvals: Approvals,
        rates: RateLimits | None = None,
        heavy: HeavyWork | None = None,
    ) -> None:
        self._registry = registry
        # Large arguments: checked in a worker process, in turns fair across
        # clients (heavy_work.py); None: every call is checked here.
        self._heavy = heavy
        self._backend = backend
        self._admission = admission
        self._rates = rates
        self._planner = SandboxPlanner(backend, policy)
        # Records of calls that end together share one commit (group_commit.py).
        self._audit = AuditAppender(store)
        self._approvals = approvals
        self._pools: WarmPools | None = None
        self._observers: list[Observer] = []

    def observe(self, observer: Observer) -> None:
        """Called with each attempt's audit record and outcome (metrics)."""
        self._observers.append(observer)

    def use_pools(self, pools: WarmPools) -> None:
        self._pools = pools

    def use_sandbox_policy(self, policy: SandboxPolicy) -> None:
        """A reloaded policy's ceilings, egress and grants, from the next call on."""
        self._planner.policy = policy

    def warm_spec(self, tool: ToolDefinition) -> SandboxSpec | None:
        """What a warm container of ``tool`` is made from (None: it may not run here)."""
        return self._planner.warm_spec(tool)

    @property
    def admission(self) -> Admission:
        return self._admission

    @property
    def require_gvisor(self) -> bool:
        return self._planner.policy.require_gvisor

    def execute(
        self,
        call: CallRequest,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
        on_started: Callable[[str], None] | None = None,
    ) -> Outcome:
        """``on_started`` is told the execution id once every check has passed,
        before the call waits for a sandbox (StreamExecuteTool's ``started``)."""
        if not valid_tool_name(call.name):
            # Refused before look-up: a name that is not a name never becomes a
            # log line, an audit row or a metric label.
            return Outcome(Status.TOOL_NOT_FOUND, error=NOT_A_NAME)
        _check_request_id(call.approval_request_id)
        if self._rates is not None:
            # First: a client over its rate costs no look-up, no check, no row.
            self._rates.check(call.caller)
        record = AuditRecord(uuid.uuid4().hex, call)
        # The container's removal and the pool's refill wait for the record
        # (sandbox_runner/after_call.py): their engine writes would slow its fsync.
        with tracing.execution(record.execution_id), after_call.deferred():
            try:
                with tracing.step(tracing.VALIDATE):
                    tool = self._look_up(record)
                    arguments, facts = self._check(record, tool, cancel)
                runtime = self._choose_runtime(record, tool)
                self._approval_gate(record, tool, arguments, facts)
                spec = self._plan_sandbox(record, tool, arguments, runtime)
            except _Refused as refused:
                return self._record(record, refused.outcome)
            except Cancelled:  # its client went away while waiting for a turn
                return self._record(record, _asked_to_stop(record, cancel) or Outcome(
                    Status.SANDBOX_ERROR, error="call cancelled before its arguments were checked",
                    execution_id=record.execution_id,
                ))  # fmt: skip
            if on_started is not None:
                on_started(record.execution_id)
            return self._record(record, self._run(record, tool, spec, on_output, cancel))

    # -- the steps before any sandbox ---------------------------------------------------

    def _look_up(self, record: AuditRecord) -> ToolDefinition:
        call = record.call
        tool = self._registry.find(call.name)
        if tool is None:
            raise _refusal(record, Status.TOOL_NOT_FOUND, f"Tool '{call.name}' not found")
        record.tool = tool
        if call.max_level is not None and not tool.safety_level.at_most(call.max_level):
            raise PermissionDenied(
                f"client '{call.caller}' may run tools up to {call.max_level.value};"
                f" '{tool.name}' is {tool.safety_level.value}"
            )
        if tool.disabled:
            record.reason = tool.disabled_reason
            raise _refusal(record, Status.TOOL_DISABLED, _disabled(tool))
        return tool

    def _check(
        self, record: AuditRecord, tool: ToolDefinition, cancel: threading.Event | None
    ) -> tuple[ParsedArguments, CallFacts]:
        """The arguments, the tool's guards, the policy's deny rules. A heavy
        call waits for its turn, has its arguments and guards checked by a
        worker, and keeps the turn through the deny rules (they read the same
        large arguments): all of it counts against its caller."""
        call = record.call
        heavy = self._heavy
        if heavy is None or not heavy.is_heavy(call.arguments_json):
            arguments = self._check_arguments(record, tool)
            return arguments, self._check_policy(record, tool, arguments)
        try:
            check_size(call.arguments_json)  # over the cap: refused before it takes a turn
        except InvalidArgument as exc:
            raise _refusal(record, Status.INVALID_ARGUMENTS, exc.message) from None
        with heavy.gate.turn(call.caller, cancel, call.deadline):
            checked = heavy.workers.check(tool, call.arguments_json)
            arguments = self._checked_arguments(record, checked)
            return arguments, self._check_policy(record, tool, arguments, guards_checked=True)

    def _checked_arguments(self, record: AuditRecord, checked: Checked) -> ParsedArguments:
        """A worker's findings, refused as the same checks here refuse them."""
        if checked.arguments is None:
            raise _refusal(record, Status.INVALID_ARGUMENTS, checked.invalid)
        record.args_digest = checked.arguments.digest
        if checked.guard_failed is not None:
            raise _refusal(
                record, Status.INVALID_ARGUMENTS, f"guard failed: {checked.guard_failed}"
            )
        return checked.arguments

    def _check_arguments(self, record: AuditRecord, tool: ToolDefinition) -> ParsedArguments:
        try:
            arguments = parse_arguments(tool, record.call.arguments_json)
        except InvalidArgument as exc:
            raise _refusal(record, Status.INVALID_ARGUMENTS, exc.message) from None
        record.args_digest = arguments.digest
        return arguments

    def _check_policy(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        arguments: ParsedArguments,
        guards_checked: bool = False,
    ) -> CallFacts:
        """The tool's guards (its registrant's preconditions on the arguments),
        then the policy's deny rules: both before any approval request or
        sandbox exists. Returns what the approval rules' conditions read."""
        call = record.call
        policy = self._approvals.policy
        facts = call_facts(policy, tool, arguments.value, call.caller, time.time(), call.claims)
        if tool.guards and not guards_checked:
            guards = [(compile_condition(g.condition, Scope.GUARD), g.message) for g in tool.guards]
            failed = first_failing(guards, facts)
            if failed is not None:
                raise _refusal(record, Status.INVALID_ARGUMENTS, f"guard failed: {failed}")
        denial = policy.denial_for(
            tool_name=tool.name, categories=tool.categories, level=tool.safety_level, facts=facts
        )
        if denial is not None:
            record.rule, record.reason = denial.rule, denial.reason
            raise _refusal(record, Status.POLICY_DENIED, denial.message)
        return facts

    def _choose_runtime(self, record: AuditRecord, tool: ToolDefinition) -> Runtime:
        """The runtime ``tool`` runs under here (for runsc-net, with gVisor's
        network mode), once its owner's grant is found to still cover it: both
        refused before the approval gate, so no approval request is opened for
        a call the engine or the policy would not run."""
        try:
            runtime = self._planner.runtime_for(tool)
        except NoRuntime as exc:
            raise _refusal(record, Status.SANDBOX_ERROR, str(exc)) from None
        try:
            # Its owner's grant too (a reloaded policy may have narrowed it),
            # before approvers are asked and before any secret is read.
            self._planner.check_grant(tool)
        except NotRunnable as exc:
            raise _refusal(
                record, Status.SANDBOX_ERROR, f"Tool '{tool.name}' cannot run: {exc}"
            ) from None
        return runtime

    def _approval_gate(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        arguments: ParsedArguments,
        facts: CallFacts,
    ) -> None:
        """Dangerous tools: whether enough valid approvals exist (checked, not yet
        spent: ``_start`` spends them); kept in ``record.approved``."""
        if tool.safety_level is not SafetyLevel.DANGEROUS:
            record.passed_gate = True
            return
        call = record.call
        with tracing.step(tracing.APPROVAL) as span:
            try:
                decision = self._approvals.decide(
                    Call(tool, arguments.canonical.decode(), arguments.digest, call.caller, facts),
                    call.approval_tokens,
                    call.approval_request_id,
                )
            except RuleNotEvaluable as exc:
                span.set_attribute(tracing.DECISION, "denied")
                record.rule, record.reason = (
                    exc.rule,
                    f"its condition could not be evaluated: {exc.detail}",
                )
                raise _refusal(record, Status.POLICY_DENIED, str(exc)) from None
            except (Denied, NotFound) as exc:
                span.set_attribute(tracing.DECISION, "denied")
                reason = exc.reason if isinstance(exc, Denied) else exc.message
                raise _refusal(
                    record, Status.APPROVAL_DENIED, f"approval denied: {reason}"
                ) from None
            if isinstance(decision, Required):
                span.set_attribute(tracing.DECISION, "required")
                raise _refusal(record, Status.APPROVAL_REQUIRED, decision.message, decision.request)
            span.set_attribute(tracing.DECISION, "approved")
        record.approved = decision
        record.passed_gate = True

    def _plan_sandbox(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        arguments: ParsedArguments,
        runtime: Runtime,
    ) -> SandboxSpec:
        try:
            values = self._planner.secret_values(tool)  # check_grant passed before the gate
            spec = self._planner.spec(tool, arguments.canonical, runtime.name, values)
        except NotRunnable as exc:
            raise _refusal(
                record, Status.SANDBOX_ERROR, f"Tool '{tool.name}' cannot run: {exc}"
            ) from None
        record.redactor = Redactor(values)
        record.runtime, record.gvisor_network = runtime.name, runtime.gvisor_network
        record.limits = spec.limits
        return spec

    # -- the sandbox --------------------------------------------------------------------

    def _run(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        spec: SandboxSpec,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> Outcome:
        """Admission, a container (warm or cold), then the approval is spent and
        the tool started. Refused for capacity, cancelled, or failing in the
        engine before the tool starts: the approval is kept for a retry."""
        execution_id = record.execution_id
        redactor = record.redactor
        streamed = redactor.stream(on_output) if redactor and on_output is not None else None
        try:
            result = self._run_warm_or_cold(record, tool, spec, streamed or on_output, cancel)
            if streamed is not None:
                streamed.flush()
        except Cancelled:
            return _asked_to_stop(record, cancel) or Outcome(
                Status.SANDBOX_ERROR,
                error="call cancelled before it started",
                execution_id=execution_id,
            )
        except _Refused as refused:
            return refused.outcome
        except Denied as exc:
            return Outcome(
                Status.APPROVAL_DENIED, error=f"approval denied: {exc.reason}",
                execution_id=execution_id,
            )  # fmt: skip
        except BackendEngineUnavailable as exc:
            self._record(
                record, Outcome(Status.SANDBOX_ERROR, error=str(exc), execution_id=execution_id)
            )
            raise EngineUnavailable(f"no container engine answers: {exc}") from exc
        except SandboxError as exc:
            # Its text may be the tool's own (a prestarted interpreter's preload
            # failure, told in the init's 'F' frame, runs with the call's file
            # secrets mounted): redacted as the output is, before the log line,
            # the result, the audit record and the kept call.
            reason = redactor.text(str(exc)) if redactor else str(exc)
            log.warning("sandbox error for %s (%s): %s", tool.name, execution_id, reason)
            return Outcome(
                Status.SANDBOX_ERROR, error=f"sandbox error: {reason}", execution_id=execution_id
            )
        if redactor:
            result = dataclasses.replace(
                result,
                stdout=redactor.redact(result.stdout),
                stderr=redactor.redact(result.stderr),
                egress=tuple(
                    dataclasses.replace(c, host=redactor.text(c.host)) for c in result.egress
                ),
            )
        record.egress, record.egress_unrecorded = result.egress, result.egress_unrecorded
        outcome = outcome_of(tool, result, execution_id)
        if result.cancelled and outcome.status is Status.SANDBOX_ERROR:
            stopped = _asked_to_stop(record, cancel, outcome)
            if stopped is not None:
                return stopped
        return outcome

    def _run_warm_or_cold(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        spec: SandboxSpec,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> SandboxResult:
        pools = self._pools
        caller = record.call.caller
        warm = None
        if pools is not None and self._admission.may_take_warm(caller):
            warm = pools.take(tool, spec, record.execution_id)
        if warm is not None:
            assert pools is not None
            with ExitStack() as held:
                with tracing.step(tracing.ADMISSION):
                    try:
                        held.enter_context(self._admission.claim(warm.reservation, caller))
                    except QuotaExceeded:
                        pools.discard(warm)
                        raise
                with tracing.step(tracing.SANDBOX_START, **{tracing.WARM: True}):
                    # Made before the call: taking it is all there is to wait for.
                    record.container_id, record.warm = warm.container_id, True
                try:
                    return self._start(record, warm.prepared, spec, on_output, cancel)
                finally:
                    after_call.later(pools.call_done)
        with ExitStack() as held:
            with tracing.step(tracing.ADMISSION):
                held.enter_context(self._admission.slot(cancel, spec.limits.memory_mb, caller))
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            with tracing.step(tracing.SANDBOX_START, **{tracing.WARM: False}):
                prepared = self._backend.prepare(spec, execution_id=record.execution_id)
            record.container_id = prepared.container_id
            return self._start(record, prepared, spec, on_output, cancel)

    def _start(
        self,
        record: AuditRecord,
        prepared: PreparedSandbox,
        spec: SandboxSpec,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> SandboxResult:
        """Spend the approval (with its audit record, in one unit of work), then
        hand the waiting container its call. The tool's command starts only
        here; a container whose call is refused is removed unused."""
        try:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            self._still_runnable(record)
            if record.approved is not None:
                with tracing.step(tracing.APPROVAL_SPEND):
                    self._approvals.spend(
                        record.approved,
                        record.execution_id,
                        record.as_dict(decision="approved", status="STARTING"),
                    )
        except BaseException:
            prepared.discard()
            raise
        # The timeout counts from now, not from when the container was made, and
        # no container outlives the client's deadline: nobody would read it.
        spec = within_deadline(spec, record.call.deadline)
        deadline = time.monotonic() + spec.limits.timeout_ms / 1000
        if record.call.deadline is not None:  # the client's own, not re-derived from ms
            deadline = min(deadline, record.call.deadline)
        return prepared.finish(spec.input, deadline, on_output, cancel)

    def _still_runnable(self, record: AuditRecord) -> None:
        """The kill switch reaches a call that waited for a slot or a container:
        a tool deleted or disabled meanwhile does not start (one already
        started finishes)."""
        name = record.call.name
        current = self._registry.find(name)
        if current is None:
            raise _refusal(
                record, Status.TOOL_NOT_FOUND, f"Tool '{name}' was deleted before the call started"
            )
        if current.disabled:
            record.reason = current.disabled_reason
            raise _refusal(record, Status.TOOL_DISABLED, _disabled(current))

    # -- the record -----------------------------------------------------------------------

    def _record(self, record: AuditRecord, outcome: Outcome) -> Outcome:
        """Write the attempt's audit record, then hand the outcome back."""
        entry = record.as_dict(decision=decision_of(outcome, record), outcome=outcome)
        execution_log.info("execution", extra={"fields": entry})
        for observer in self._observers:
            observer(entry, outcome)
        tracing.describe(record.tool, outcome, record.warm if record.container_id else None)
        try:
            with tracing.step(tracing.AUDIT):
                self._audit.append("execution", entry)
        except ToolregError as exc:
            # Cautious and dangerous calls are audited: no durable record, no
            # answer. A safe call's record is not worth failing a read for.
            if record.tool is not None and record.tool.safety_level is not SafetyLevel.SAFE:
                raise
            log.warning("could not store the audit record of %s: %s", record.execution_id, exc)
        return outcome


def _refusal(
    record: AuditRecord, status: Status, error: str, request: ApprovalRequestView | None = None
) -> _Refused:
    """An attempt that ends before any sandbox: recorded like every other."""
    return _Refused(
        Outcome(status, error=error, execution_id=record.execution_id, approval_request=request)
    )


def _asked_to_stop(
    record: AuditRecord, cancel: threading.Event | None, stopped: Outcome | None = None
) -> Outcome | None:
    """CANCELLED, when CancelExecution stopped the call (not its client going
    away): who asked and why go into the result and the audit record."""
    if not isinstance(cancel, CallCancel) or not cancel.by:
        return None
    record.cancelled_by, record.cancel_reason = cancel.by, cancel.reason
    why = f": {cancel.reason}" if cancel.reason else ""
    error = f"call cancelled by '{cancel.by}'{why}"
    if stopped is None:
        return Outcome(Status.CANCELLED, error=error, execution_id=record.execution_id)
    return dataclasses.replace(stopped, status=Status.CANCELLED, error=error)


def _disabled(tool: ToolDefinition) -> str:
    return f"Tool '{tool.name}' is disabled: {tool.disabled_reason}"


def _check_request_id(request_id: str) -> None:
    """A malformed id is a malformed request: refused before it is stored anywhere."""
    if request_id and not REQUEST_ID_PATTERN.fullmatch(request_id):
        rule = "not an approval request id (32 lowercase hex digits)"
        field = "approval_request_id"
        raise InvalidArgument(f"{field}: {rule}", [Violation(field, rule)])

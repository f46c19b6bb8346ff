"""Executing one tool call: look-up, argument checks, admission, the sandbox,
and the execution record. Every outcome of the call itself is an ``Outcome``;
only problems of the request or the server (capacity, no engine) raise."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from registry_server.approvals.service import Approvals, Approved, Call, Denied, Required
from registry_server.catalog.registry import Registry
from registry_server.domain import strict_json
from registry_server.domain.arguments import parse_arguments
from registry_server.domain.errors import (
    EngineUnavailable,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ToolregError,
    Violation,
)
from registry_server.domain.models import NAME_PATTERN, SafetyLevel, ToolDefinition, valid_tool_name
from registry_server.domain.outcome import ApprovalRequestView, Outcome, Status
from registry_server.execution.admission import Admission, Cancelled
from registry_server.execution.warm_pool import WarmPools
from registry_server.store import audit_chain as audit
from registry_server.store.base import Store
from sandbox_runner import EngineUnavailable as RunnerEngineUnavailable
from sandbox_runner import (
    Limits,
    Mount,
    PreparedSandbox,
    SandboxBackend,
    SandboxError,
    SandboxResult,
    SandboxSpec,
)
from sandbox_runner.profiles import FALLBACK_RUNTIME, profile_for, runtime_for

log = logging.getLogger(__name__)
execution_log = logging.getLogger("toolreg.executions")

OutputSink = Callable[[str, bytes], None]
MAX_ERROR_CHARS = 4_096  # characters of stderr repeated in `error` for the model
WORKSPACE_TARGET = "/workspace"  # where a workspace tool sees its directory
TOOL_WORKSPACE_ENV = "TOOLREG_WORKSPACE"  # tells the tool where its workspace is
NOT_A_NAME = f"Tool not found: tool names match {NAME_PATTERN}"
REQUEST_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")  # what Approvals issues (uuid4 hex)


@dataclass(frozen=True)
class CallRequest:
    name: str
    arguments_json: str
    caller: str = "anonymous"
    approval_tokens: tuple[str, ...] = ()
    approval_request_id: str = ""
    # time.monotonic() by which the client stops waiting (its gRPC deadline)
    deadline: float | None = None
    # the most dangerous level this caller may run (None = any)
    max_level: SafetyLevel | None = None


@dataclass(frozen=True)
class SandboxPolicy:
    """What the server (not the tool) decides about sandboxes."""

    ceilings: Mapping[SafetyLevel, Limits] = field(
        default_factory=lambda: {lvl: profile_for(lvl.value) for lvl in SafetyLevel}
    )
    # Dangerous tools run under gVisor; without it, refuse (True) or fall back
    # to runc with a warning at start-up (False).
    require_gvisor: bool = False
    workspace_dir: Path | None = None
    # Tools that get workspace_dir mounted read-write. Only dangerous tools
    # qualify: a file that outlives the call is a permanent effect.
    workspace_tools: frozenset[str] = frozenset()


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
    ) -> None:
        self._registry = registry
        self._backend = backend
        self._admission = admission
        self._policy = policy
        self._store = store
        self._approvals = approvals
        self._pools: WarmPools | None = None
        self._observers: list[Callable[[dict[str, object], Outcome], None]] = []
        self._runtimes: frozenset[str] | None = None

    def observe(self, observer: Callable[[dict[str, object], Outcome], None]) -> None:
        """Called with each attempt's audit record and outcome (metrics)."""
        self._observers.append(observer)

    def use_pools(self, pools: WarmPools) -> None:
        self._pools = pools

    def warm_spec(self, tool: ToolDefinition) -> SandboxSpec | None:
        """What a warm container of ``tool`` is made from (None: it may not run here)."""
        runtime = self.runtime_for(tool.safety_level)
        return None if runtime is None else self.sandbox_spec(tool, b"{}", runtime)

    @property
    def admission(self) -> Admission:
        return self._admission

    @property
    def require_gvisor(self) -> bool:
        return self._policy.require_gvisor

    def runtime_for(self, level: SafetyLevel) -> str | None:
        """The OCI runtime a level runs under here, or None if it may not run."""
        if self._runtimes is None:
            try:
                self._runtimes = self._backend.runtimes()
            except SandboxError:
                return FALLBACK_RUNTIME if level is not SafetyLevel.DANGEROUS else None
        chosen = runtime_for(level.value, self._runtimes or frozenset())
        if chosen is None and not (level is SafetyLevel.DANGEROUS and self._policy.require_gvisor):
            return FALLBACK_RUNTIME
        return chosen

    def execute(
        self,
        call: CallRequest,
        on_output: OutputSink | None = None,
        cancel: threading.Event | None = None,
    ) -> Outcome:
        if not valid_tool_name(call.name):
            # Refused before look-up: a name that is not a name never becomes a
            # log line, an audit row or a metric label.
            return Outcome(Status.TOOL_NOT_FOUND, error=NOT_A_NAME)
        _check_request_id(call.approval_request_id)
        execution_id = uuid.uuid4().hex
        record = AuditRecord(execution_id, call)
        tool = self._registry.find(call.name)
        if tool is None:
            return self._refuse(record, Status.TOOL_NOT_FOUND, f"Tool '{call.name}' not found")
        record.tool = tool
        if call.max_level is not None and not tool.safety_level.at_most(call.max_level):
            raise PermissionDenied(
                f"client '{call.caller}' may run tools up to {call.max_level.value};"
                f" '{tool.name}' is {tool.safety_level.value}"
            )
        try:
            arguments = parse_arguments(tool, call.arguments_json)
        except InvalidArgument as exc:
            return self._refuse(record, Status.INVALID_ARGUMENTS, exc.message)
        record.args_digest = arguments.digest
        approved: Approved | None = None
        if tool.safety_level is SafetyLevel.DANGEROUS:
            gate = self._approval_gate(record, tool, arguments.canonical.decode())
            if isinstance(gate, Outcome):
                return gate
            approved = record.approved = gate
        runtime = self.runtime_for(tool.safety_level)
        if runtime is None:
            return self._refuse(
                record,
                Status.SANDBOX_ERROR,
                f"Tool '{tool.name}' needs gVisor (runsc), which this engine lacks",
            )
        spec = self.sandbox_spec(tool, arguments.canonical, runtime)
        record.runtime, record.limits = runtime, spec.limits
        return self._finish(record, self._run(record, tool, spec, approved, on_output, cancel))

    def _approval_gate(
        self, record: AuditRecord, tool: ToolDefinition, arguments_json: str
    ) -> Approved | Outcome:
        """Whether enough valid approvals exist (checked, not yet spent)."""
        call = record.call
        try:
            decision = self._approvals.decide(
                Call(tool, arguments_json, record.args_digest, call.caller),
                call.approval_tokens,
                call.approval_request_id,
            )
        except Denied as exc:
            return self._refuse(record, Status.APPROVAL_DENIED, f"approval denied: {exc.reason}")
        except NotFound as exc:
            return self._refuse(record, Status.APPROVAL_DENIED, f"approval denied: {exc.message}")
        if isinstance(decision, Required):
            return self._refuse(
                record, Status.APPROVAL_REQUIRED, decision.message, decision.request
            )
        return decision

    def _run(
        self,
        record: AuditRecord,
        tool: ToolDefinition,
        spec: SandboxSpec,
        approved: Approved | None,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> Outcome:
        """Admission, a container (warm or cold), then the approval is spent and
        the tool started. Refused for capacity, cancelled, or failing in the
        engine before the tool starts: the approval is kept for a retry."""
        execution_id = record.execution_id
        warm = self._pools.take(tool, spec) if self._pools is not None else None
        try:
            if warm is not None:
                record.container_id, record.warm = warm.container_id, True
                with self._admission.claim(warm.reservation):
                    try:
                        result = self._start(
                            record, warm.prepared, spec, approved, on_output, cancel
                        )
                    finally:
                        assert self._pools is not None
                        self._pools.call_done()
            else:
                with self._admission.slot(cancel, spec.limits.memory_mb):
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    prepared = self._backend.prepare(spec, execution_id=execution_id)
                    record.container_id = prepared.container_id
                    result = self._start(record, prepared, spec, approved, on_output, cancel)
        except Cancelled:
            return Outcome(
                Status.SANDBOX_ERROR,
                error="call cancelled before it started",
                execution_id=execution_id,
            )
        except Denied as exc:
            return Outcome(
                Status.APPROVAL_DENIED, error=f"approval denied: {exc.reason}",
                execution_id=execution_id,
            )  # fmt: skip
        except RunnerEngineUnavailable as exc:
            self._finish(
                record, Outcome(Status.SANDBOX_ERROR, error=str(exc), execution_id=execution_id)
            )
            raise EngineUnavailable(f"no container engine answers: {exc}") from exc
        except SandboxError as exc:
            log.warning("sandbox error for %s (%s): %s", tool.name, execution_id, exc)
            return Outcome(
                Status.SANDBOX_ERROR, error=f"sandbox error: {exc}", execution_id=execution_id
            )
        return outcome_of(tool, result, execution_id)

    def _start(
        self,
        record: AuditRecord,
        prepared: PreparedSandbox,
        spec: SandboxSpec,
        approved: Approved | None,
        on_output: OutputSink | None,
        cancel: threading.Event | None,
    ) -> SandboxResult:
        """Spend the approval (with its audit record, in one transaction), then
        hand the waiting container its call. The tool's command starts only
        here; a container whose call is refused is removed unused."""
        try:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            if approved is not None:
                self._approvals.spend(
                    approved,
                    record.execution_id,
                    record.as_dict(decision="approved", status="STARTING"),
                )
        except BaseException:
            prepared.discard()
            raise
        # The timeout counts from now, not from when the container was made, and
        # no container outlives the client's deadline: nobody would read it.
        spec = _within_deadline(spec, record.call.deadline)
        deadline = time.monotonic() + spec.limits.timeout_ms / 1000
        return prepared.finish(spec.input, deadline, on_output, cancel)

    def sandbox_spec(self, tool: ToolDefinition, input_bytes: bytes, runtime: str) -> SandboxSpec:
        """The tool's request merged into its level's ceiling (the tightest wins).
        ``input_bytes``: the RFC 8785 canonical arguments, the very bytes an
        approval's args_digest hashes (1 and 1.0 cannot differ on the way)."""
        asked = tool.sandbox.limits
        requested = Limits(
            memory_mb=asked.memory_mb,
            cpu_millis=asked.cpu_millis,
            pids=asked.pids,
            timeout_ms=asked.timeout_ms,
            output_bytes=asked.output_bytes,
            tmpfs_mb=0,
            nofile=0,
            fsize_mb=0,
        )
        limits = self._policy.ceilings[tool.safety_level].tightest(requested)
        env = dict(tool.sandbox.env)
        mounts: tuple[Mount, ...] = ()
        workspace = self._policy.workspace_dir
        if (
            workspace is not None
            and tool.name in self._policy.workspace_tools
            and tool.safety_level is SafetyLevel.DANGEROUS
        ):
            mounts = (Mount(str(workspace.resolve()), WORKSPACE_TARGET, read_only=False),)
            env[TOOL_WORKSPACE_ENV] = WORKSPACE_TARGET
        return SandboxSpec(
            image=tool.sandbox.image,
            command=tool.sandbox.command,
            env=tuple(sorted(env.items())),
            limits=limits,
            runtime=runtime,
            input=input_bytes,
            mounts=mounts,
        )

    def _refuse(
        self,
        record: AuditRecord,
        status: Status,
        error: str,
        request: ApprovalRequestView | None = None,
    ) -> Outcome:
        """An attempt that ends before any sandbox: recorded like every other."""
        outcome = Outcome(
            status, error=error, execution_id=record.execution_id, approval_request=request
        )
        return self._finish(record, outcome)

    def _finish(self, record: AuditRecord, outcome: Outcome) -> Outcome:
        """Write the attempt's audit record, then hand the outcome back."""
        entry = record.as_dict(decision=_decision(outcome, record), outcome=outcome)
        execution_log.info("execution", extra={"fields": entry})
        for observer in self._observers:
            observer(entry, outcome)
        try:
            with self._store.unit_of_work() as uow:
                audit.append(uow, "execution", entry)
        except ToolregError as exc:
            # Cautious and dangerous calls are audited: no durable record, no
            # answer. A safe call's record is not worth failing a read for.
            if record.tool is not None and record.tool.safety_level is not SafetyLevel.SAFE:
                raise
            log.warning("could not store the audit record of %s: %s", record.execution_id, exc)
        return outcome


class AuditRecord:
    """What the audit log says about one execution attempt."""

    def __init__(self, execution_id: str, call: CallRequest) -> None:
        self.execution_id = execution_id
        self.call = call
        self.tool: ToolDefinition | None = None
        self.args_digest = ""
        self.approved: Approved | None = None
        self.runtime = ""
        self.limits: Limits | None = None
        self.container_id = ""
        self.warm = False

    def as_dict(
        self, *, decision: str, status: str = "", outcome: Outcome | None = None
    ) -> dict[str, object]:
        approvals = self.approved.approvals if self.approved else ()
        return {
            "execution_id": self.execution_id,
            "caller": self.call.caller,
            "tool": self.tool.name if self.tool else self.call.name,
            "tool_digest": self.tool.digest if self.tool else "",
            "level": self.tool.safety_level.value if self.tool else "",
            "args_digest": self.args_digest,
            "decision": decision,
            "approvers": [a.approver for a in approvals],
            "jtis": [a.jti for a in approvals],
            "approval_request_id": (self.approved.request_id if self.approved else None)
            or self.call.approval_request_id
            or None,
            "status": outcome.status.value if outcome else status,
            "exit_code": outcome.exit_code
            if outcome and outcome.status in (Status.OK, Status.TOOL_ERROR)
            else None,
            "duration_ms": outcome.duration_ms if outcome else 0,
            "runtime": self.runtime,
            "container_id": self.container_id,
            "warm": self.warm,
            "limits": dataclasses.asdict(self.limits) if self.limits else {},
        }


def _decision(outcome: Outcome, record: AuditRecord) -> str:
    refused = {
        Status.TOOL_NOT_FOUND: "not_found",
        Status.INVALID_ARGUMENTS: "invalid_arguments",
        Status.APPROVAL_REQUIRED: "approval_required",
        Status.APPROVAL_DENIED: "approval_denied",
    }
    if outcome.status in refused:
        return refused[outcome.status]
    return "approved" if record.approved else "allowed"


def _within_deadline(spec: SandboxSpec, deadline: float | None) -> SandboxSpec:
    """No container outlives the client's deadline: nobody would read its result."""
    if deadline is None:
        return spec
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    if remaining_ms >= spec.limits.timeout_ms:
        return spec
    return dataclasses.replace(spec, limits=spec.limits.replace(timeout_ms=remaining_ms))


def outcome_of(tool: ToolDefinition, result: SandboxResult, execution_id: str) -> Outcome:
    """Map what the sandbox reported to what the model is told."""
    content = result.stdout.decode("utf-8", errors="replace")
    stderr = result.stderr.decode("utf-8", errors="replace")
    status, error = _classify(tool.name, result, stderr)
    return Outcome(
        status,
        content=content,
        data_json=_json_or_empty(content) if status is Status.OK else "",
        error=error,
        exit_code=result.exit_code if result.exit_code is not None else -1,
        stderr=stderr,
        duration_ms=result.duration_ms,
        output_truncated=result.output_truncated,
        execution_id=execution_id,
    )


def _classify(name: str, result: SandboxResult, stderr: str) -> tuple[Status, str]:
    # Order matters: a killed tool also exits non-zero or times out, and a limit
    # it hit on the way (memory, processes, output) is the cause to report.
    if result.oom_killed:
        return Status.RESOURCE_EXHAUSTED, f"Tool '{name}' ran out of memory and was stopped"
    if result.pids_exhausted:
        return Status.RESOURCE_EXHAUSTED, f"Tool '{name}' hit its process limit"
    if result.output_truncated:
        return (
            Status.RESOURCE_EXHAUSTED,
            f"Tool '{name}' wrote more output than allowed; it was stopped and its output cut",
        )
    if result.timed_out:
        return Status.TIMEOUT, f"Tool '{name}' timed out and was stopped"
    if result.cancelled:
        return Status.SANDBOX_ERROR, "call cancelled"
    if result.exit_code != 0:
        return Status.TOOL_ERROR, stderr.strip()[
            -MAX_ERROR_CHARS:
        ] or f"exited with code {result.exit_code}"
    return Status.OK, ""


def _json_or_empty(text: str) -> str:
    stripped = text.strip()
    if not stripped:
        return ""
    try:
        strict_json.loads(stripped, "stdout")
    except InvalidArgument:
        return ""
    return stripped


def _check_request_id(request_id: str) -> None:
    """A malformed id is a malformed request: refused before it is stored anywhere."""
    if request_id and not REQUEST_ID_PATTERN.fullmatch(request_id):
        rule = "not an approval request id (32 lowercase hex digits)"
        field = "approval_request_id"
        raise InvalidArgument(f"{field}: {rule}", [Violation(field, rule)])

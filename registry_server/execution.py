"""Executing one tool call: look-up, argument checks, admission, the sandbox,
and the execution record. Every outcome of the call itself is an ``Outcome``;
only problems of the request or the server (capacity, no engine) raise."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from registry_server import strict_json
from registry_server.admission import Admission, Cancelled
from registry_server.arguments import parse_arguments
from registry_server.errors import EngineUnavailable, InvalidArgument, ToolregError, Unimplemented
from registry_server.models import SafetyLevel, ToolDefinition
from registry_server.outcome import Outcome, Status
from registry_server.registry import Registry
from registry_server.store import Store
from sandbox_runner import EngineUnavailable as RunnerEngineUnavailable
from sandbox_runner import Limits, Mount, Runner, SandboxError, SandboxResult, SandboxSpec
from sandbox_runner.profiles import FALLBACK_RUNTIME, profile_for, runtime_for

log = logging.getLogger(__name__)
execution_log = logging.getLogger("toolreg.executions")

OutputSink = Callable[[str, bytes], None]
MAX_ERROR_CHARS = 4_096  # characters of stderr repeated in `error` for the model
WORKSPACE_TARGET = "/workspace"  # where a workspace tool sees its directory
TOOL_WORKSPACE_ENV = "TOOLREG_WORKSPACE"  # tells the tool where its workspace is


@dataclass(frozen=True)
class CallRequest:
    name: str
    arguments_json: str
    caller: str = "anonymous"
    approval_tokens: tuple[str, ...] = ()
    approval_request_id: str = ""
    # time.monotonic() by which the client stops waiting (its gRPC deadline)
    deadline: float | None = None


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
        runner: Runner | None,
        *,
        admission: Admission,
        policy: SandboxPolicy,
        store: Store | None = None,
    ) -> None:
        self._registry = registry
        self._runner = runner
        self._admission = admission
        self._policy = policy
        self._store = store
        self._runtimes: frozenset[str] | None = None

    @property
    def admission(self) -> Admission:
        return self._admission

    def runtime_for(self, level: SafetyLevel) -> str | None:
        """The OCI runtime a level runs under here, or None if it may not run."""
        if self._runtimes is None and self._runner is not None:
            try:
                self._runtimes = self._runner.runtimes()
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
        execution_id = uuid.uuid4().hex
        tool = self._registry.find(call.name)
        if tool is None:
            return Outcome(
                Status.TOOL_NOT_FOUND,
                error=f"Tool '{call.name}' not found",
                execution_id=execution_id,
            )
        try:
            arguments, args_digest = parse_arguments(tool, call.arguments_json)
        except InvalidArgument as exc:
            return Outcome(Status.INVALID_ARGUMENTS, error=exc.message, execution_id=execution_id)

        def refuse(status: Status, error: str) -> Outcome:
            outcome = Outcome(status, error=error, execution_id=execution_id)
            self._record(execution_id, tool, call, args_digest, outcome, "", None)
            return outcome

        if tool.safety_level is SafetyLevel.DANGEROUS:
            return refuse(
                Status.APPROVAL_REQUIRED,
                f"Tool '{tool.name}' is dangerous and needs signed approval before it runs",
            )
        if self._runner is None:
            raise Unimplemented("this server has no sandbox runner")
        runtime = self.runtime_for(tool.safety_level)
        if runtime is None:
            return refuse(
                Status.SANDBOX_ERROR,
                f"Tool '{tool.name}' needs gVisor (runsc), which this engine lacks",
            )
        spec = self.sandbox_spec(tool, arguments, runtime)
        try:
            with self._admission.slot(cancel):
                result = self._runner.run(
                    spec, execution_id=execution_id, on_output=on_output, cancel=cancel
                )
        except Cancelled:
            outcome = Outcome(
                Status.SANDBOX_ERROR,
                error="call cancelled before it started",
                execution_id=execution_id,
            )
        except RunnerEngineUnavailable as exc:
            raise EngineUnavailable(f"no container engine answers: {exc}") from exc
        except SandboxError as exc:
            log.warning("sandbox error for %s (%s): %s", tool.name, execution_id, exc)
            outcome = Outcome(
                Status.SANDBOX_ERROR, error=f"sandbox error: {exc}", execution_id=execution_id
            )
        else:
            outcome = outcome_of(tool, result, execution_id)
        self._record(execution_id, tool, call, args_digest, outcome, runtime, spec.limits)
        return outcome

    def sandbox_spec(
        self, tool: ToolDefinition, arguments: dict[str, object], runtime: str
    ) -> SandboxSpec:
        """The tool's request merged into its level's ceiling (the tightest wins)."""
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
            input=strict_json.dumps(arguments).encode(),
            mounts=mounts,
        )

    def _record(
        self,
        execution_id: str,
        tool: ToolDefinition,
        call: CallRequest,
        args_digest: str,
        outcome: Outcome,
        runtime: str,
        limits: Limits | None,
    ) -> None:
        applied = (
            {}
            if limits is None
            else {
                "memory_mb": limits.memory_mb,
                "cpu_millis": limits.cpu_millis,
                "pids": limits.pids,
                "timeout_ms": limits.timeout_ms,
                "output_bytes": limits.output_bytes,
                "tmpfs_mb": limits.tmpfs_mb,
                "nofile": limits.nofile,
                "fsize_mb": limits.fsize_mb,
            }
        )
        row: dict[str, object] = {
            "id": execution_id,
            "at": time.time(),
            "tool": tool.name,
            "tool_digest": tool.digest,
            "level": tool.safety_level.value,
            "caller": call.caller,
            "args_digest": args_digest,
            "status": outcome.status.value,
            "exit_code": outcome.exit_code
            if outcome.status in (Status.OK, Status.TOOL_ERROR)
            else None,
            "duration_ms": outcome.duration_ms,
            "runtime": runtime,
            "limits": json.dumps(applied, sort_keys=True),
        }
        execution_log.info("execution %s", json.dumps(row, sort_keys=True))
        if self._store is None:
            return
        try:
            self._store.record_execution(row)
        except ToolregError as exc:
            # Cautious and dangerous calls are audited: no durable record, no
            # answer. A safe call's record is not worth failing a read for.
            if tool.safety_level is not SafetyLevel.SAFE:
                raise
            log.warning("could not store the record of execution %s: %s", execution_id, exc)


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

"""Classifying what a sandbox reported into what the model is told: the
limit it hit, a timeout, the tool's own error, or its output."""

from __future__ import annotations

from registry_server.domain import strict_json
from registry_server.domain.errors import InvalidArgument
from registry_server.domain.models import ToolDefinition
from registry_server.domain.outcome import Outcome, Status
from sandbox_runner import SandboxResult

MAX_ERROR_CHARS = 4_096  # characters of stderr repeated in `error` for the model


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

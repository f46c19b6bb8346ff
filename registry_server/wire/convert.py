"""The one place where protobuf messages become domain objects and back."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.catalog.guards import guard_violations
from registry_server.domain import strict_json
from registry_server.domain.egress import (
    DEFAULT_TLS_PORT,
    MAX_EGRESS_ENTRIES,
    MAX_FORMAT_CHARS,
    MAX_SECRETS,
    SecretRef,
)
from registry_server.domain.errors import InvalidArgument, InvalidDefinition, Violation
from registry_server.domain.models import (
    LIMIT_FIELDS,
    MAX_CATEGORIES,
    MAX_CATEGORY_CHARS,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_DESCRIPTION_CHARS,
    MAX_ENV_KEY_CHARS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_GUARD_CONDITION_CHARS,
    MAX_GUARD_MESSAGE_CHARS,
    MAX_GUARDS,
    MAX_IMAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_PARAMETERS_BYTES,
    Guard,
    SafetyLevel,
    ToolDefinition,
    parse_definition,
)
from registry_server.domain.outcome import (
    AppliedRule,
    ApprovalEventView,
    ApprovalRequestView,
    Outcome,
    Status,
)
from registry_server.domain.schemas import SchemaFormat
from registry_server.policy.model import Policy
from sandbox_runner.egress import rules
from sandbox_runner.warm_interpreter import MAX_PRELOAD, MAX_PRELOAD_CHARS

_LEVEL_TO_PB = {
    SafetyLevel.SAFE: pb.SAFETY_LEVEL_SAFE,
    SafetyLevel.CAUTIOUS: pb.SAFETY_LEVEL_CAUTIOUS,
    SafetyLevel.DANGEROUS: pb.SAFETY_LEVEL_DANGEROUS,
}
_LEVEL_FROM_PB: dict[int, SafetyLevel] = {int(v): k for k, v in _LEVEL_TO_PB.items()}
_FORMAT_TO_PB = {
    SchemaFormat.OPENAI: pb.SCHEMA_FORMAT_OPENAI,
    SchemaFormat.ANTHROPIC: pb.SCHEMA_FORMAT_ANTHROPIC,
    SchemaFormat.MCP: pb.SCHEMA_FORMAT_MCP,
}
_FORMAT_FROM_PB: dict[int, SchemaFormat] = {
    pb.SCHEMA_FORMAT_UNSPECIFIED: SchemaFormat.OPENAI,
    **{int(v): k for k, v in _FORMAT_TO_PB.items()},
}
_STATUS_TO_PB = {s: pb.ExecutionStatus.Value(f"EXECUTION_STATUS_{s.value}") for s in Status}
GUARDS_FIELD = "guards"  # the Tool message's field; manifests say "guard"


def tool_from_pb(msg: pb.Tool) -> ToolDefinition:
    """Validate a Tool message to register; every problem is named by its
    proto field. Sizes are checked first, before any parsing: a 3 MB name or a
    huge schema costs nothing but this check. Its guards must compile (the
    registry checks again, for definitions that do not come as messages)."""
    tool = _definition_from_pb(msg)
    problems = guard_violations(tool, field=GUARDS_FIELD)
    if problems:
        raise InvalidDefinition(problems)
    return tool


def _definition_from_pb(msg: pb.Tool) -> ToolDefinition:
    """A Tool message as a validated definition (the domain's rules only)."""
    oversized = _oversized(msg)
    if oversized:
        raise InvalidDefinition(oversized)
    problems: list[Violation] = []
    parameters: Any = {}
    try:
        parameters = strict_json.loads(msg.parameters_json or "", "parameters_json")
    except InvalidArgument as exc:
        problems.extend(exc.violations)
    level: str | None = None
    if msg.safety_level != pb.SAFETY_LEVEL_UNSPECIFIED:
        found = _LEVEL_FROM_PB.get(int(msg.safety_level))
        level = found.value if found else f"<enum value {msg.safety_level}>"
    limits = msg.sandbox.limits
    raw: dict[str, Any] = {
        "name": msg.name,
        "description": msg.description,
        "parameters": parameters,
        "safety_level": level,
        "categories": list(msg.categories),
        "sandbox": {
            "image": msg.sandbox.image,
            "command": list(msg.sandbox.command),
            "env": dict(msg.sandbox.env),
            "limits": {name: getattr(limits, name) for name in LIMIT_FIELDS},
            "prestart": msg.sandbox.prestart,
            "preload": list(msg.sandbox.preload),
        },
        "warm_pool": msg.warm_pool,
        "network": {"egress": list(msg.network.egress)},
        "secrets": [_secret_from_pb(ref) for ref in msg.secrets],
        "guard": [{"condition": g.condition, "message": g.message} for g in msg.guards],
    }
    try:
        tool = parse_definition(raw)
    except InvalidDefinition as exc:
        problems.extend(_rename(v) for v in exc.violations if not _is_parse_echo(v, problems))
        raise InvalidDefinition(problems) from None
    if problems:
        raise InvalidDefinition(problems)
    return tool


def _oversized(msg: pb.Tool) -> list[Violation]:
    sandbox = msg.sandbox
    checks: list[tuple[str, bool, str]] = [
        ("name", len(msg.name) > MAX_NAME_CHARS, f"at most {MAX_NAME_CHARS} characters"),
        ("description", len(msg.description) > MAX_DESCRIPTION_CHARS,
         f"at most {MAX_DESCRIPTION_CHARS} characters"),
        ("parameters_json", len(msg.parameters_json.encode()) > MAX_PARAMETERS_BYTES,
         f"at most {MAX_PARAMETERS_BYTES} bytes"),
        ("categories", len(msg.categories) > MAX_CATEGORIES, f"at most {MAX_CATEGORIES} entries"),
        ("categories", any(len(c) > MAX_CATEGORY_CHARS for c in msg.categories),
         f"each at most {MAX_CATEGORY_CHARS} characters"),
        ("sandbox.image", len(sandbox.image) > MAX_IMAGE_CHARS,
         f"at most {MAX_IMAGE_CHARS} characters"),
        ("sandbox.command", len(sandbox.command) > MAX_COMMAND_ARGS,
         f"at most {MAX_COMMAND_ARGS} entries"),
        ("sandbox.command", any(len(a) > MAX_COMMAND_ARG_CHARS for a in sandbox.command),
         f"each entry at most {MAX_COMMAND_ARG_CHARS} characters"),
        ("sandbox.env", len(sandbox.env) > MAX_ENV_VARS, f"at most {MAX_ENV_VARS} variables"),
        ("sandbox.prestart", len(sandbox.prestart) > MAX_PRELOAD_CHARS, 'must be "" or "python"'),
        ("sandbox.preload", len(sandbox.preload) > MAX_PRELOAD, f"at most {MAX_PRELOAD} modules"),
        ("sandbox.preload", any(len(p) > MAX_PRELOAD_CHARS for p in sandbox.preload),
         f"each at most {MAX_PRELOAD_CHARS} characters"),
        ("sandbox.env", any(len(k) > MAX_ENV_KEY_CHARS for k in sandbox.env),
         f"names at most {MAX_ENV_KEY_CHARS} characters"),
        ("sandbox.env", any(len(v) > MAX_ENV_VALUE_CHARS for v in sandbox.env.values()),
         f"values at most {MAX_ENV_VALUE_CHARS} characters"),
    ]  # fmt: skip
    refs = msg.secrets
    checks += [
        ("network.egress", len(msg.network.egress) > MAX_EGRESS_ENTRIES,
         f"at most {MAX_EGRESS_ENTRIES} entries"),
        ("network.egress", any(len(e) > rules.MAX_ENTRY_CHARS for e in msg.network.egress),
         f"each at most {rules.MAX_ENTRY_CHARS} characters"),
        ("secrets", len(refs) > MAX_SECRETS, f"at most {MAX_SECRETS} entries"),
        ("secrets", any(len(r.name) > 64 or len(r.deliver) > 16 or len(r.inject.host) > 253
                        or len(r.inject.header) > 64 or len(r.inject.format) > MAX_FORMAT_CHARS
                        for r in refs),
         "name at most 64 characters, deliver 16, inject.host 253, inject.header 64,"
         f" inject.format {MAX_FORMAT_CHARS}"),
    ]  # fmt: skip
    guards = msg.guards
    checks += [
        (GUARDS_FIELD, len(guards) > MAX_GUARDS, f"at most {MAX_GUARDS} entries"),
        (GUARDS_FIELD, any(len(g.condition) > MAX_GUARD_CONDITION_CHARS
                           or len(g.message) > MAX_GUARD_MESSAGE_CHARS for g in guards),
         f"condition at most {MAX_GUARD_CONDITION_CHARS} characters,"
         f" message {MAX_GUARD_MESSAGE_CHARS}"),
    ]  # fmt: skip
    return [Violation(field, rule) for field, failed, rule in checks if failed]


def _secret_from_pb(ref: pb.SecretRef) -> dict[str, Any]:
    # Empty proto fields mean "the default", as unset manifest keys do.
    out: dict[str, Any] = {"name": ref.name, "deliver": ref.deliver or "header"}
    if ref.HasField("inject"):
        inj = ref.inject
        out["inject"] = {
            "host": inj.host,
            "port": inj.port or DEFAULT_TLS_PORT,
            "header": inj.header or "Authorization",
            "format": inj.format or "Bearer {value}",
        }
    return out


def _secret_to_pb(ref: SecretRef) -> pb.SecretRef:
    msg = pb.SecretRef(name=ref.name, deliver=ref.deliver)
    if ref.inject is not None:
        inj = ref.inject
        msg.inject.CopyFrom(
            pb.SecretInjection(host=inj.host, port=inj.port, header=inj.header, format=inj.format)
        )
    return msg


def stored_tool_from_pb(msg: pb.Tool) -> ToolDefinition:
    """A Tool the server sent: re-validated, with what is output only (its
    owner, and whether an admin disabled it). Its guards are not compiled
    again: the server did that when it was registered, and a client must be
    able to show a tool whatever CEL runtime it has."""
    return dataclasses.replace(
        _definition_from_pb(msg), owner=msg.owner, disabled=msg.disabled,
        disabled_reason=msg.disabled_reason,
    )  # fmt: skip


def _is_parse_echo(v: Violation, already: list[Violation]) -> bool:
    # When parameters_json did not parse, "parameters must be an object" is noise.
    return v.field == "parameters" and any(p.field == "parameters_json" for p in already)


def _rename(v: Violation) -> Violation:
    # Name fields as clients see them in the .proto.
    if v.field == "parameters" or v.field.startswith("parameters."):
        return Violation("parameters_json" + v.field[len("parameters") :], v.description)
    if v.field == "guard" or v.field.startswith("guard."):
        return Violation(GUARDS_FIELD + v.field[len("guard") :], v.description)
    return v


def tool_to_pb(tool: ToolDefinition) -> pb.Tool:
    lim = tool.sandbox.limits
    return pb.Tool(
        name=tool.name,
        description=tool.description,
        parameters_json=tool.parameters_json,
        safety_level=_LEVEL_TO_PB[tool.safety_level],
        categories=tool.categories,
        sandbox=pb.SandboxSpec(
            image=tool.sandbox.image,
            command=tool.sandbox.command,
            env=tool.sandbox.env_dict(),
            limits=pb.ResourceLimits(**lim.as_dict()),
            prestart=tool.sandbox.prestart,
            preload=tool.sandbox.preload,
        ),
        digest=tool.digest,
        warm_pool=tool.warm_pool,
        owner=tool.owner,
        network=pb.NetworkSpec(egress=list(tool.egress)),
        secrets=[_secret_to_pb(ref) for ref in tool.secrets],
        disabled=tool.disabled,
        disabled_reason=tool.disabled_reason,
        guards=[_guard_to_pb(g) for g in tool.guards],
    )


def _guard_to_pb(guard: Guard) -> pb.Guard:
    return pb.Guard(condition=guard.condition, message=guard.message)


def level_name(value: int) -> str:
    """A wire safety level for people ("dangerous"); an unknown one by number."""
    level = _LEVEL_FROM_PB.get(int(value))
    return level.value if level is not None else f"level {value}"


def max_level_to_pb(level: SafetyLevel | None) -> pb.SafetyLevel.ValueType:
    """None (no limit) is SAFETY_LEVEL_UNSPECIFIED."""
    return pb.SAFETY_LEVEL_UNSPECIFIED if level is None else _LEVEL_TO_PB[level]


def format_to_pb(fmt: SchemaFormat) -> pb.SchemaFormat.ValueType:
    return _FORMAT_TO_PB[fmt]


def max_level_from_pb(value: int, field: str = "max_safety_level") -> SafetyLevel | None:
    if value == pb.SAFETY_LEVEL_UNSPECIFIED:
        return None
    level = _LEVEL_FROM_PB.get(int(value))
    if level is None:
        raise InvalidArgument(
            f"{field}: unknown safety level {value}", [Violation(field, f"unknown value {value}")]
        )
    return level


def format_from_pb(value: int) -> SchemaFormat:
    fmt = _FORMAT_FROM_PB.get(int(value))
    if fmt is None:
        raise InvalidArgument(
            f"format: unknown schema format {value}",
            [Violation("format", f"unknown value {value}")],
        )
    return fmt


def _timestamp(when: Any) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(when)
    return ts


def approval_request_to_pb(req: ApprovalRequestView) -> pb.ApprovalRequest:
    return pb.ApprovalRequest(
        id=req.id,
        tool_name=req.tool_name,
        tool_digest=req.tool_digest,
        arguments_json=req.arguments_json,
        arguments_digest=req.arguments_digest,
        requested_by=req.requested_by,
        approvals_required=req.approvals_required,
        approved_by=req.approved_by,
        state=req.state,
        created_at=_timestamp(req.created_at),
        expires_at=_timestamp(req.expires_at),
        audience=req.audience,
        max_token_ttl_s=req.max_token_ttl_s,
        approvals_missing=req.approvals_missing,
        tool=tool_to_pb(req.tool) if req.tool is not None else None,
        rejected_by=req.rejected_by,
        rejection_reason=req.rejection_reason,
        voided_reason=req.voided_reason,
        applied_rules=[_applied_rule_to_pb(rule) for rule in req.applied_rules],
    )


def _applied_rule_to_pb(rule: AppliedRule) -> pb.AppliedRule:
    return pb.AppliedRule(
        name=rule.name,
        match=rule.match,
        condition=rule.condition,
        approvals_required=rule.approvals_required,
        groups=rule.groups,
    )


def _applied_rule_from_pb(msg: pb.AppliedRule) -> AppliedRule:
    return AppliedRule(
        name=msg.name,
        match=msg.match,
        condition=msg.condition,
        approvals_required=msg.approvals_required,
        groups=tuple(msg.groups),
    )


def approval_request_from_pb(msg: pb.ApprovalRequest) -> ApprovalRequestView:
    return ApprovalRequestView(
        id=msg.id,
        tool_name=msg.tool_name,
        tool_digest=msg.tool_digest,
        arguments_json=msg.arguments_json,
        arguments_digest=msg.arguments_digest,
        requested_by=msg.requested_by,
        approvals_required=msg.approvals_required,
        approved_by=tuple(msg.approved_by),
        state=msg.state,
        created_at=msg.created_at.ToDatetime(tzinfo=UTC),
        expires_at=msg.expires_at.ToDatetime(tzinfo=UTC),
        audience=msg.audience,
        max_token_ttl_s=msg.max_token_ttl_s,
        tool=_shown_tool(msg),
        approvals_missing=msg.approvals_missing,
        rejected_by=msg.rejected_by,
        rejection_reason=msg.rejection_reason,
        voided_reason=msg.voided_reason,
        applied_rules=tuple(_applied_rule_from_pb(rule) for rule in msg.applied_rules),
    )


def server_info_to_pb(policy: Policy, loaded_at: float) -> pb.ServerInfo:
    info = pb.ServerInfo(
        policy_digest=policy.digest,
        policy_source=policy.source if policy.digest else "",
        version=toolreg_version(),
    )
    info.policy_loaded_at.CopyFrom(_timestamp(datetime.fromtimestamp(loaded_at, UTC)))
    return info


def toolreg_version() -> str:
    try:
        return importlib.metadata.version("toolreg")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def approval_event_to_pb(item: ApprovalEventView) -> pb.ApprovalEvent:
    event = pb.ApprovalEvent(
        type=pb.ApprovalEventType.Value(f"APPROVAL_EVENT_TYPE_{item.type}"),
        actor=item.actor,
        reason=item.reason,
        seq=item.seq,
    )
    if item.request is not None:
        event.request.CopyFrom(approval_request_to_pb(item.request))
    if item.at is not None:
        event.at.CopyFrom(_timestamp(item.at))
    return event


def approval_event_from_pb(msg: pb.ApprovalEvent) -> ApprovalEventView:
    """An event type this client does not know (a newer server) reads as
    UNSPECIFIED: the request it carries still tells its state."""
    try:
        name = pb.ApprovalEventType.Name(msg.type)
    except ValueError:
        name = "APPROVAL_EVENT_TYPE_UNSPECIFIED"
    return ApprovalEventView(
        type=name.removeprefix("APPROVAL_EVENT_TYPE_"),
        request=approval_request_from_pb(msg.request) if msg.HasField("request") else None,
        actor=msg.actor,
        reason=msg.reason,
        at=msg.at.ToDatetime(tzinfo=UTC) if msg.HasField("at") else None,
        seq=msg.seq,
    )


def _shown_tool(msg: pb.ApprovalRequest) -> ToolDefinition | None:
    """The request's definition as a domain object, when it came in full (a
    listing leaves its parameters out) and still validates."""
    if not msg.HasField("tool") or not msg.tool.parameters_json:
        return None
    try:
        return stored_tool_from_pb(msg.tool)
    except InvalidArgument:
        return None


_STATUS_FROM_PB = {int(v): k for k, v in _STATUS_TO_PB.items()}


def status_name(value: int) -> str:
    """A wire status for people ("TOOL_ERROR"); a newer server's unknown one by number."""
    try:
        return pb.ExecutionStatus.Name(value).removeprefix("EXECUTION_STATUS_")  # type: ignore[arg-type]
    except ValueError:
        return f"STATUS_{value}"


def data_from_pb(data_json: str) -> Any:
    """A ToolResult's ``data_json`` parsed; None when it is empty or not JSON."""
    if not data_json:
        return None
    try:
        return json.loads(data_json)
    except ValueError:
        return None


def status_from_pb(value: int) -> Status:
    """An unknown status (a newer server's) is still a failure: SANDBOX_ERROR."""
    return _STATUS_FROM_PB.get(value, Status.SANDBOX_ERROR)


def outcome_to_pb(out: Outcome) -> pb.ToolResult:
    msg = pb.ToolResult(
        success=out.success,
        status=_STATUS_TO_PB[out.status],
        content=out.content,
        data_json=out.data_json,
        error=out.error,
        exit_code=out.exit_code,
        stderr=out.stderr,
        duration_ms=out.duration_ms,
        output_truncated=out.output_truncated,
        execution_id=out.execution_id,
    )
    if out.approval_request is not None:
        msg.approval_request.CopyFrom(approval_request_to_pb(out.approval_request))
    return msg

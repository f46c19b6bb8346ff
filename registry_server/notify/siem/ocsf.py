"""One audit entry as one OCSF 1.4.0 event (docs/how-to/audit.md, "SIEM export").
Pure: the entry, the log's name and (for approval events) the request's
requester and tool in, a JSON-ready dict out.

The classes, and why:

* Process Activity (1007, System Activity): a tool's run. The record an
  approved dangerous call stores as its approvals are spent, just before its
  command starts (status STARTING), is Launch; the record of a run's end,
  at every level, is Terminate, with the exit code, duration and start time.
* Authentication (3002, Identity & Access Management): refused credentials
  (kind "refusal", status UNAUTHENTICATED: an unknown or malformed bearer
  token, an IdP token that does not hold, no credential): a failed Logon, with
  ``count`` refusals folded into the record between ``start_time`` and
  ``end_time``, the source's address, and never the credential.
* Authorize Session (3003, Identity & Access Management): refused requests
  of a known client that lacks the right (kind "refusal", PERMISSION_DENIED),
  with ``count`` as above; and a call refused by
  authorization: a deny rule (policy_denied), a token or request that does
  not hold (approval_denied), or approvals still missing
  (approval_required). Each call is a session whose privilege to run the
  tool is decided at its start; these are the decisions that refuse it.
* User Access Management (3005, IAM): approval requests. An approver's
  approval, and the request reaching its threshold, assign the requester
  the privilege to run that one call; a rejection, expiry or voiding
  revokes it; the request itself is activity Other ("Request").
* API Activity (6003, Application Activity): every other record is an
  RPC's effect on the registry: tools registered, replaced, deleted,
  disabled or enabled; policy reloads, refused or not; calls refused before
  any authorization (unknown tool, invalid arguments, disabled tool); and
  requests refused for a quota or capacity (kind "refusal",
  RESOURCE_EXHAUSTED), with ``count``.
* Base Event (0): a kind of record this version does not know (or a
  record it cannot read), so that no record is ever left out or holds up
  the ones after it.

Every event carries the audit entry itself under ``unmapped.audit`` (its
seq, index = seq - 1, time, kind, canonical record text, prev_hash, hash
and Merkle leaf hash), so a SIEM copy can be checked against the chain and
against an inclusion proof (`toolreg audit prove --record SEQ`): nothing but
the audit's own fields, which hold no argument value, secret or token.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from registry_server import __version__
from registry_server.domain import merkle
from registry_server.store import audit_chain
from registry_server.store.base import AuditEntry

OCSF_VERSION = "1.4.0"  # the schema version every event declares (metadata.version)
PRODUCT = {"name": "toolreg", "vendor_name": "toolreg", "version": __version__}
SERVICE = "toolregistry.v1.ToolRegistry"  # the gRPC service whose calls are recorded

# (class_uid, class_name, category_uid, category_name)
BASE_EVENT = (0, "Base Event", 0, "Uncategorized")
PROCESS_ACTIVITY = (1007, "Process Activity", 1, "System Activity")
AUTHENTICATION = (3002, "Authentication", 3, "Identity & Access Management")
AUTHORIZE_SESSION = (3003, "Authorize Session", 3, "Identity & Access Management")
USER_ACCESS = (3005, "User Access Management", 3, "Identity & Access Management")
API_ACTIVITY = (6003, "API Activity", 6, "Application Activity")

# activity ids (per class) and their captions
OTHER = 99
LAUNCH, TERMINATE = 1, 2  # Process Activity
LOGON = 1  # Authentication
ASSIGN_PRIVILEGES, REVOKE_PRIVILEGES = 1, 2  # Authorize Session, User Access Management
CREATE, READ, UPDATE, DELETE = 1, 2, 3, 4  # API Activity
ACTIVITY_NAMES = {
    PROCESS_ACTIVITY: {LAUNCH: "Launch", TERMINATE: "Terminate"},
    AUTHENTICATION: {LOGON: "Logon"},
    AUTHORIZE_SESSION: {ASSIGN_PRIVILEGES: "Assign Privileges"},
    USER_ACCESS: {ASSIGN_PRIVILEGES: "Assign Privileges", REVOKE_PRIVILEGES: "Revoke Privileges"},
    API_ACTIVITY: {CREATE: "Create", READ: "Read", UPDATE: "Update", DELETE: "Delete"},
}

# status_id
UNKNOWN, SUCCESS, FAILURE = 0, 1, 2
STATUS_NAMES = {UNKNOWN: "Unknown", SUCCESS: "Success", FAILURE: "Failure", OTHER: "Other"}
# severity_id
INFORMATIONAL, LOW, MEDIUM = 1, 2, 3
SEVERITY_NAMES = {INFORMATIONAL: "Informational", LOW: "Low", MEDIUM: "Medium"}
SERVER_DEVICE = 1  # device.type_id: Server

# Execution decisions refused by authorization (Authorize Session), and by
# other checks before it (API Activity).
AUTHORIZATION_REFUSALS = ("approval_required", "approval_denied", "policy_denied")
RAN = ("allowed", "approved")  # decisions of calls that reached a sandbox
REGISTRATION_ACTIVITIES = {
    "created": (CREATE, "RegisterTool"),
    "replaced": (UPDATE, "RegisterTool"),
    "deleted": (DELETE, "DeleteTool"),
    "disabled": (UPDATE, "SetToolEnabled"),
    "enabled": (UPDATE, "SetToolEnabled"),
}
# approval record "event" -> (activity, its name when Other)
APPROVAL_ACTIVITIES = {
    "requested": (OTHER, "Request"),
    "approved": (ASSIGN_PRIVILEGES, ""),
    "request_approved": (ASSIGN_PRIVILEGES, ""),
    "rejected": (REVOKE_PRIVILEGES, ""),
    "expired": (REVOKE_PRIVILEGES, ""),
    "voided": (REVOKE_PRIVILEGES, ""),
}
UNKNOWN_REQUESTER = "(unknown)"  # an approval event whose request is not in the store


@dataclass(frozen=True)
class Source:
    """What every event says about where it comes from."""

    log_name: str  # the audit log's name (its checkpoints' origin): toolreg/<audience>


@dataclass(frozen=True)
class RequestFacts:
    """Who asked for an approval request, for what tool: in the request's own
    "requested" record, and in the store's request, for the approval events
    that do not repeat them."""

    requested_by: str
    tool: str


def event_uid(log_name: str, seq: int) -> str:
    """The event's ``metadata.uid``: the same for every copy of one record,
    so a receiver drops a copy it already has."""
    return f"{log_name}#{seq}"


def audit_fields(entry: AuditEntry) -> dict[str, Any]:
    """The entry as stored, with its tree index and leaf hash: enough to
    recompute its hash, check its link and match an inclusion proof."""
    data = audit_chain.canonical(entry)
    return {
        "seq": entry.seq,
        "index": entry.seq - 1,
        "at": entry.at,
        "kind": entry.kind,
        "record": entry.record,
        "prev_hash": entry.prev_hash,
        "hash": entry.hash,
        "leaf_hash": merkle.leaf_hash(data).hex(),
    }


def request_wanted(entry: AuditEntry) -> str | None:
    """The request whose facts an approval event needs, if it does not carry them."""
    if entry.kind != "approval":
        return None
    record = _record(entry)
    if record.get("requested_by") and record.get("tool"):
        return None
    request_id = record.get("request_id")
    return str(request_id) if request_id else None


def event(
    entry: AuditEntry, source: Source, requests: Mapping[str, RequestFacts] | None = None
) -> dict[str, Any]:
    """The OCSF event of ``entry``. ``requests``: the facts of the requests
    its approval events name (``request_wanted``); missing ones show as unknown."""
    record = _record(entry)
    mappers = {
        "execution": lambda: _execution(record, source),
        "approval": lambda: _approval(record, requests or {}),
        "registration": lambda: _registration(record),
        "policy": lambda: _policy(record),
        "refusal": lambda: _refusal(record, source),
    }
    body = None
    if entry.kind in mappers:
        try:
            body = mappers[entry.kind]()
        except (ValueError, TypeError, AttributeError):
            body = None  # a record this version cannot read: exported all the same, below
    if body is None:
        body = _Body(BASE_EVENT, OTHER, f"audit record of kind {entry.kind!r}", {},
                     activity_name=entry.kind or "Other")  # fmt: skip
    return body.event(entry, source)


@dataclass
class _Body:
    kind: tuple[int, str, int, str]
    activity_id: int
    message: str
    fields: dict[str, Any]
    status_id: int = SUCCESS
    status: str = ""  # the source's own status, when not the status_id's caption
    status_code: str = ""
    status_detail: str = ""
    severity_id: int = INFORMATIONAL
    activity_name: str = ""  # for OTHER
    correlation_uid: str = ""

    def event(self, entry: AuditEntry, source: Source) -> dict[str, Any]:
        class_uid, class_name, category_uid, category_name = self.kind
        activity_name = self.activity_name or ACTIVITY_NAMES.get(self.kind, {}).get(
            self.activity_id, "Other"
        )
        time_ms = round(entry.at * 1000)
        metadata: dict[str, Any] = {
            "version": OCSF_VERSION,
            "product": dict(PRODUCT),
            "uid": event_uid(source.log_name, entry.seq),
            "log_name": source.log_name,
            "log_provider": "toolreg audit log",
            "sequence": entry.seq,
            "logged_time": time_ms,
        }
        if self.correlation_uid:
            metadata["correlation_uid"] = self.correlation_uid
        out: dict[str, Any] = {
            "class_uid": class_uid,
            "class_name": class_name,
            "category_uid": category_uid,
            "category_name": category_name,
            "activity_id": self.activity_id,
            "activity_name": activity_name,
            "type_uid": class_uid * 100 + self.activity_id,
            "type_name": f"{class_name}: {activity_name}",
            "severity_id": self.severity_id,
            "severity": SEVERITY_NAMES[self.severity_id],
            "time": time_ms,
            "status_id": self.status_id,
            "status": self.status or STATUS_NAMES[self.status_id],
            "message": self.message,
            "metadata": metadata,
            **self.fields,
            "unmapped": {"audit": audit_fields(entry)},
        }
        if self.status_code:
            out["status_code"] = self.status_code
        if self.status_detail:
            out["status_detail"] = self.status_detail
        return out


def _record(entry: AuditEntry) -> dict[str, Any]:
    try:
        parsed = json.loads(entry.record)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _user(uid: str) -> dict[str, Any]:
    return {"uid": uid, "name": uid}


def _actor(who: str, *, invoked_by: str = "") -> dict[str, Any]:
    """The actor: a client or approver by its id, or toolreg itself."""
    actor: dict[str, Any] = {"user": _user(who)} if who else {"app_name": "toolreg"}
    if invoked_by and invoked_by != who:
        actor["invoked_by"] = invoked_by
    return actor


def _privilege(tool: str) -> str:
    return f"execute:{tool}" if tool else "execute"


def _execution(r: Mapping[str, Any], source: Source) -> _Body:
    caller = _text(r.get("caller"))
    tool = _text(r.get("tool"))
    decision = _text(r.get("decision"))
    status = _text(r.get("status"))
    execution_id = _text(r.get("execution_id"))
    actor = _actor(caller, invoked_by=_text(r.get("actor")))
    correlation = _text(r.get("approval_request_id")) or execution_id
    if decision in RAN:
        duration = int(r.get("duration_ms") or 0)
        fields: dict[str, Any] = {
            "actor": actor,
            # A record does not say which of a deployment's servers ran the call.
            "device": {"type_id": SERVER_DEVICE, "type": "Server", "name": source.log_name},
            "process": {"uid": execution_id, "name": tool},
        }
        if status == "STARTING":  # the approvals are spent; the command starts next
            approvers = ", ".join(map(str, r.get("approvers") or ())) or "nobody"
            return _Body(
                PROCESS_ACTIVITY, LAUNCH, f"{caller} starts tool '{tool}', approved by"
                f" {approvers}", fields, status_id=OTHER, status=status, status_code=status,
                status_detail=decision, correlation_uid=correlation,
            )  # fmt: skip
        if r.get("exit_code") is not None:
            fields["exit_code"] = int(r["exit_code"])
        fields["duration"] = duration
        ok = status == "OK"
        return _Body(
            PROCESS_ACTIVITY, TERMINATE, f"{caller} ran tool '{tool}': {status}",
            fields, status_id=SUCCESS if ok else FAILURE, status_code=status,
            status_detail=decision, severity_id=INFORMATIONAL if ok else LOW,
            correlation_uid=correlation,
        )  # fmt: skip
    if decision in AUTHORIZATION_REFUSALS:
        fields = {
            "actor": actor,
            "user": _user(caller),
            "privileges": [_privilege(tool)],
            "session": {"uid": execution_id},
        }
        severity = INFORMATIONAL if decision == "approval_required" else MEDIUM
        return _Body(
            AUTHORIZE_SESSION, ASSIGN_PRIVILEGES,
            f"{caller} may not run tool '{tool}' ({decision})", fields, status_id=FAILURE,
            status_code=status, status_detail=decision, severity_id=severity,
            correlation_uid=correlation,
        )  # fmt: skip
    # refused before authorization: an unknown tool, bad arguments, a disabled tool, ...
    fields = {
        "actor": actor,
        "api": {"operation": "ExecuteTool", "service": {"name": SERVICE}},
        "src_endpoint": {"name": caller},
        "resources": [{"type": "tool", "name": tool}],
    }
    return _Body(
        API_ACTIVITY, OTHER, f"{caller}'s call of tool '{tool}' refused ({decision})", fields,
        status_id=FAILURE, status_code=status, status_detail=decision,
        severity_id=MEDIUM if decision in ("disabled", "refused") else LOW,
        activity_name="Execute", correlation_uid=correlation,
    )  # fmt: skip


def _approval(r: Mapping[str, Any], requests: Mapping[str, RequestFacts]) -> _Body:
    what = _text(r.get("event"))
    request_id = _text(r.get("request_id"))
    known = requests.get(request_id)
    requester = _text(r.get("requested_by")) or (known.requested_by if known else "")
    tool = _text(r.get("tool")) or (known.tool if known else "")
    activity, other_name = APPROVAL_ACTIVITIES.get(what, (OTHER, what or "Other"))
    submitted_by = _text(r.get("submitted_by"))
    who = {
        "requested": requester,
        "approved": _text(r.get("approver")),
        "rejected": _text(r.get("rejected_by")),
        "voided": _text(r.get("by")),
    }.get(what, "")  # request_approved, expired: toolreg itself
    fields: dict[str, Any] = {
        "actor": _actor(who, invoked_by=submitted_by),
        "user": _user(requester or UNKNOWN_REQUESTER),
        "privileges": [_privilege(tool)],
        "resource": {"type": "approval request", "uid": request_id, "name": tool},
    }
    messages = {
        "requested": f"{requester} asks to run tool '{tool}' (request {request_id})",
        "approved": f"{who} approves request {request_id} (tool '{tool}')",
        "request_approved": f"request {request_id} (tool '{tool}') has its approvals",
        "rejected": f"{who} rejects request {request_id} (tool '{tool}')",
        "expired": f"request {request_id} (tool '{tool}') expired unused",
        "voided": f"request {request_id} (tool '{tool}') voided",
    }
    severity = MEDIUM if what in ("rejected", "voided") else INFORMATIONAL
    return _Body(
        USER_ACCESS, activity, messages.get(what, f"approval request {request_id}: {what}"),
        fields, status_detail=what, severity_id=severity,
        activity_name=other_name if activity == OTHER else "", correlation_uid=request_id,
    )  # fmt: skip


def _registration(r: Mapping[str, Any]) -> _Body:
    what = _text(r.get("event"))
    by = _text(r.get("by"))
    tool = _text(r.get("tool"))
    activity, operation = REGISTRATION_ACTIVITIES.get(what, (OTHER, "RegisterTool"))
    fields = {
        "actor": _actor(by),
        "api": {"operation": operation, "service": {"name": SERVICE}},
        "src_endpoint": {"name": by or "toolreg"},
        "resources": [{"type": "tool", "name": tool, "uid": _text(r.get("digest"))}],
    }
    return _Body(
        API_ACTIVITY, activity, f"{by} {what} tool '{tool}'", fields, status_detail=what,
        severity_id=MEDIUM if what == "disabled" else INFORMATIONAL,
        activity_name="" if activity != OTHER else what or "Other",
    )  # fmt: skip


def _policy(r: Mapping[str, Any]) -> _Body:
    what = _text(r.get("event"))
    by = _text(r.get("by"))
    refused = what == "reload_refused"
    digest = _text(r.get("digest_in_force" if refused else "digest"))
    fields = {
        "actor": _actor(by),
        "api": {"operation": "ReloadPolicy", "service": {"name": SERVICE}},
        "src_endpoint": {"name": by or "toolreg"},
        "resources": [{"type": "policy", "name": _text(r.get("source")), "uid": digest}],
    }
    message = f"policy reload by {by} refused" if refused else f"policy reloaded by {by}"
    return _Body(
        API_ACTIVITY, UPDATE, message, fields, status_id=FAILURE if refused else SUCCESS,
        status_detail=what, severity_id=MEDIUM if refused else INFORMATIONAL,
    )  # fmt: skip


def _refusal(r: Mapping[str, Any], source: Source) -> _Body:
    """Refused requests, ``count`` of them folded into one record
    (domain/refusals.py): by their gRPC status, a failed authentication, a
    refused authorization, or an API call refused for a quota or capacity."""
    status = _text(r.get("status"))
    who = _text(r.get("who"))
    method = _text(r.get("method"))
    tool = _text(r.get("tool"))
    reason = r.get("reason") or {}
    code, text = _text(reason.get("code")), _text(reason.get("text"))
    where = r.get("source") or {}
    peer, client = _text(where.get("peer")), _text(where.get("client"))
    count = int(r["count"])
    endpoint: dict[str, Any] = {"name": client or peer or "unknown"}
    if peer and peer != OVERFLOW_SOURCE:
        endpoint["ip" if _is_ip(peer) else "hostname"] = peer
    fields: dict[str, Any] = {
        "count": count,
        "start_time": round(float(r["first_at"]) * 1000),
        "end_time": round(float(r["last_at"]) * 1000),
        "src_endpoint": endpoint,
    }
    times = f"{count} time(s)" if count != 1 else "once"
    about = f" (tool '{tool}')" if tool else ""
    if status == "UNAUTHENTICATED":
        credential = _text(r.get("credential"))
        fields |= {
            "user": {"name": who, **({"uid": client} if client else {})},
            "service": {"name": SERVICE},
            "dst_endpoint": {"name": source.log_name, "svc_name": SERVICE},
            "auth_protocol_id": OTHER,
            "auth_protocol": credential or "none",
            "is_remote": True,
        }
        message = f"{who} ({credential or 'no credential'}) refused at {method}{about}, {times}"
        kind, activity, severity = AUTHENTICATION, LOGON, MEDIUM
    elif status == "PERMISSION_DENIED":
        fields |= {
            "actor": _actor(client),
            "user": _user(client or who),
            "privileges": [f"{method}:{tool}" if tool else method],
        }
        message = f"{who} may not call {method}{about}: refused {times}"
        kind, activity, severity = AUTHORIZE_SESSION, ASSIGN_PRIVILEGES, MEDIUM
    else:
        fields |= {
            "actor": _actor(client),
            "api": {"operation": method, "service": {"name": SERVICE}},
            "resources": [{"type": "tool", "name": tool}] if tool else [],
        }
        message = f"{who}'s {method}{about} refused ({code}), {times}"
        kind, activity, severity = API_ACTIVITY, OTHER, LOW
        if not fields["resources"]:
            del fields["resources"]
    return _Body(
        kind, activity, message, fields, status_id=FAILURE, status_code=code,
        status_detail=text, severity_id=severity,
        activity_name="Refuse" if activity == OTHER else "",
    )  # fmt: skip


OVERFLOW_SOURCE = "(overflow)"  # domain/refusals.OVERFLOW: many sources folded into one record


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def dumps(event_: Mapping[str, Any]) -> str:
    """One event as one line of JSON: ASCII only (a syslog message without a
    BOM, RFC 5424 6.4), keys sorted, no spaces."""
    return json.dumps(event_, ensure_ascii=True, sort_keys=True, separators=(",", ":"))

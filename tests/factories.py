"""Small builders for test data (plain data, no fakes)."""

from __future__ import annotations

import copy
import functools
import hashlib
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from registry_server.client.registry_client import CallResult, Status
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.domain.outcome import ApprovalRequestView
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy


def sha(token: str) -> str:
    """The ``token_sha256`` a policy holds for the bearer token ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


@functools.cache
def policy_of(text: str) -> Policy:
    """What a policy file holding ``text`` loads to, loaded once per run: a
    Policy is immutable, so tests that only use one share it (tests of the
    loading itself call load_policy)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "policy.yaml")
        path.write_text(text)
        return load_policy(path)


def manifest(**overrides: Any) -> dict[str, Any]:
    """A valid manifest-shaped mapping; overrides replace top-level keys."""
    base: dict[str, Any] = {
        "name": "echo",
        "description": "Returns its arguments.",
        "parameters": {
            "type": "object",
            "properties": {"message": {"type": "string"}},
            "required": ["message"],
        },
        "safety_level": "safe",
        "categories": ["debug"],
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    }
    out = copy.deepcopy(base)
    out.update(overrides)
    return out


def tool(**overrides: Any) -> ToolDefinition:
    return parse_definition(manifest(**overrides))


def approval_request(**overrides: Any) -> ApprovalRequestView:
    """An approval request for write_file, 1 of 2 approvals, pending."""
    base = ApprovalRequestView(
        id="r1",
        tool_name="write_file",
        tool_digest="t" * 64,
        arguments_json='{"content":"hi","path":"a.txt"}',
        arguments_digest="a" * 64,
        requested_by="agent",
        approvals_required=2,
        approved_by=("alice",),
        state="PENDING",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        expires_at=datetime(2026, 1, 1, 1, tzinfo=UTC),
    )
    return replace(base, **overrides)


def call_result(status: Status, **overrides: Any) -> CallResult:
    """What the client's ExecuteTool returns with ``status``; empty otherwise."""
    base = CallResult(
        success=status is Status.OK, status=status, content="", data=None, error="",
        exit_code=0, stderr="", duration_ms=1, output_truncated=False, execution_id="e1",
        approval_request=None,
    )  # fmt: skip
    return replace(base, **overrides)


def example_tools_policy(
    audience: str,
    approver_keys: dict[str, str],
    clients: list[dict[str, Any]],
    **settings: Any,
) -> dict[str, Any]:
    """A policy for a server of examples/tools: the approvers (id -> public key)
    in group security, one of whom must approve write_file; ``clients`` as given
    (see ``token_client``); ``settings`` are further top-level keys."""
    return {
        "audience": audience,
        **settings,
        "approvers": [
            {"id": who, "public_key": key, "groups": ["security"]}
            for who, key in approver_keys.items()
        ],
        "approval_rules": [
            {
                "match": {"tool": "write_file"},
                "approvals_required": 1,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            },
        ],
        "clients": clients,
    }


def token_client(
    client_id: str, token: str, roles: list[str], max_level: str | None = None
) -> dict[str, Any]:
    """A policy client entry identified by a bearer token."""
    entry: dict[str, Any] = {"id": client_id, "token_sha256": sha(token), "roles": roles}
    if max_level is not None:
        entry["max_safety_level"] = max_level
    return entry


def collect_events(events: Iterable[Any]) -> tuple[bytes, bytes, Any]:
    """A stream's (or an attachment's) stdout, stderr and result (None: none came)."""
    stdout, stderr, result = b"", b"", None
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "stdout":
            stdout += event.stdout
        elif kind == "stderr":
            stderr += event.stderr
        elif kind == "result":
            result = event.result
    return stdout, stderr, result

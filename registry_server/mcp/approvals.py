"""Approvals as MCP input requests (docs/how-to/mcp.md, "Approvals in the host").

A dangerous call without approvals answers, on 2026-07-28, an
``InputRequiredResult``: one URL-mode elicitation pointing at the console page
of that approval request (``<console>/#/requests/<id>``: no credential in the
URL; the console signs the approver in), a message naming the tool, the rule
and the approvers needed, and a ``requestState`` naming the request. The SDK's
``RequestStateBoundary`` seals that state (AES-256-GCM under the bridge's key)
in an envelope bound to the method, the tool, a digest of the arguments, the
authenticated principal and an expiry, and verifies every echo before the
handler runs: a tampered, expired, other-arguments or other-principal state is
JSON-RPC -32602 "Invalid or expired requestState". The plaintext names the
same facts again and the bridge checks them once more (``ApprovalState``).

On 2025-11-25 a client that declares URL elicitation is sent the same page
with ``elicitation/create``; when the person answers, the call is tried once
more with the request's id. Every other client keeps the text answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import mcp.types as types
import rfc8785
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.context import ServerRequestContext
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.shared.exceptions import MCPError
from starlette.requests import Request

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

MODERN_VERSION = "2026-07-28"  # the first revision with InputRequiredResult
DEFAULT_STATE_TTL_S = (
    900.0  # seconds a sealed requestState is accepted (a host retries well within)
)
INPUT_KEY = "toolreg_approval"  # the key of the one input request in InputRequiredResult
REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")  # approval request ids (as the console checks them)
MAX_STATE_CHARS = 1024  # characters of a requestState plaintext the bridge parses
INVALID_STATE = "Invalid or expired requestState"  # the SDK's frozen wire message


def principal_of(ctx: ServerRequestContext[Any]) -> str | None:
    """Who is calling, for the requestState binding: the policy client or the
    IdP-signed-in person the bearer token proved; None without authentication
    (stdio, ``--insecure-dev``: every caller is the bridge's own identity)."""
    request = ctx.request
    user = request.scope.get("user") if isinstance(request, Request) else None
    if not isinstance(user, AuthenticatedUser):
        return None
    token = user.access_token
    return json.dumps(["client", token.client_id, token.subject or ""])


def boundary(ttl_s: float = DEFAULT_STATE_TTL_S) -> RequestStateBoundary:
    """The SDK's sealing middleware under a key held by this bridge process
    only: a restart invalidates outstanding states (the host asks again; the
    approval request itself lives on in the registry)."""
    security = RequestStateSecurity.ephemeral(ttl=ttl_s)
    security.bind_principal = principal_of
    return RequestStateBoundary(security, default_audience="toolreg-mcp")


def arguments_digest(arguments: dict[str, Any]) -> str:
    return hashlib.sha256(rfc8785.dumps(arguments)).hexdigest()


def is_modern(ctx: ServerRequestContext[Any]) -> bool:
    return ctx.protocol_version >= MODERN_VERSION


@dataclass(frozen=True)
class ApprovalState:
    """What a requestState names: the approval request, and the call and
    caller it was minted for."""

    request_id: str
    tool: str
    args_digest: str
    principal: str | None

    def dumps(self) -> str:
        return json.dumps(
            {"r": self.request_id, "t": self.tool, "a": self.args_digest, "p": self.principal}
        )

    @classmethod
    def check(
        cls, text: str, ctx: ServerRequestContext[Any], tool: str, arguments: dict[str, Any]
    ) -> ApprovalState:
        """The state of a retry, verified against this call; -32602 otherwise.
        (The SDK has already verified its seal and envelope.)"""
        try:
            if len(text) > MAX_STATE_CHARS:
                raise ValueError("too long")
            raw = json.loads(text)
            state = cls(raw["r"], raw["t"], raw["a"], raw["p"])
        except (ValueError, KeyError, TypeError):
            raise MCPError(types.INVALID_PARAMS, INVALID_STATE) from None
        if (
            not isinstance(state.request_id, str)
            or not REQUEST_ID.match(state.request_id)
            or state.tool != tool
            or state.args_digest != arguments_digest(arguments)
            or state.principal != principal_of(ctx)
        ):
            raise MCPError(types.INVALID_PARAMS, INVALID_STATE)
        return state


class ApprovalInputs:
    """Builds the input request of an APPROVAL_REQUIRED result."""

    def __init__(self, console_url: str) -> None:
        self.console_url = console_url.rstrip("/")

    def page(self, request_id: str) -> str:
        return f"{self.console_url}/#/requests/{request_id}"

    @staticmethod
    def message(tool: str, req: pb.ApprovalRequest) -> str:
        rules = "; ".join(
            f"rule {r.name!r} ({r.match}): {r.approvals_required} approval(s)"
            + (f" from {', '.join(r.groups)}" if r.groups else " from any approver")
            for r in req.applied_rules
        )
        missing = req.approvals_missing or max(req.approvals_required - len(req.approved_by), 0)
        text = (
            f"Tool {tool!r} is dangerous: it runs only once approvers have approved this call"
            f" ({req.approvals_required} approval(s) needed, {missing} missing"
        )
        text += f"; {rules})." if rules else ")."
        return (
            text + " Open the approval page and ask them to approve it; the call runs once,"
            " when you go on after they have."
        )

    def input_required(
        self, ctx: ServerRequestContext[Any], tool: str, arguments: dict[str, Any],
        req: pb.ApprovalRequest,
    ) -> types.InputRequiredResult:  # fmt: skip
        state = ApprovalState(req.id, tool, arguments_digest(arguments), principal_of(ctx))
        ask = types.ElicitRequest(
            params=types.ElicitRequestURLParams(
                mode="url",
                message=self.message(tool, req),
                url=self.page(req.id),
                elicitation_id=req.id,
            )
        )
        return types.InputRequiredResult(
            input_requests={INPUT_KEY: ask}, request_state=state.dumps()
        )

    @staticmethod
    def declined(params: types.CallToolRequestParams) -> bool:
        """Whether the person declined or cancelled the approval page."""
        answer = (params.input_responses or {}).get(INPUT_KEY)
        return isinstance(answer, types.ElicitResult) and answer.action != "accept"

    @staticmethod
    def url_elicitation_declared(ctx: ServerRequestContext[Any]) -> bool:
        """2025-11-25: whether the client said it handles URL-mode elicitation."""
        params = ctx.session.client_params
        caps = params.capabilities if params is not None else None
        elicitation = caps.elicitation if caps is not None else None
        return elicitation is not None and elicitation.url is not None

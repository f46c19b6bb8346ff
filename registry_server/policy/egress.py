"""The policy's word on egress and secrets: which levels may reach the
network at all, which private networks the proxy may reach, the per-call caps,
and the one check of a tool against its owner's grant, made at registration
and again before every call (a policy changes; a stored tool does not)."""

from __future__ import annotations

from registry_server.domain.models import ToolDefinition
from registry_server.policy.clients import RegisterGrant
from registry_server.policy.model import EgressPolicy
from sandbox_runner.egress import rules


def egress_refusal(
    tool: ToolDefinition, owner: str, grant: RegisterGrant | None, policy: EgressPolicy
) -> str | None:
    """Why ``tool`` may not have its egress or secrets under ``grant`` (its
    owner's; None: the owner holds no grant any more), or None when it may."""
    if not tool.egress and not tool.secrets:
        return None
    if tool.egress and tool.safety_level not in policy.levels:
        allowed = ", ".join(sorted(lvl.value for lvl in policy.levels)) or "no"
        return (
            f"the policy allows egress only for {allowed} tools;"
            f" '{tool.name}' is {tool.safety_level.value}"
        )
    if grant is None:
        return f"'{owner}' may not grant egress or secrets (no register grant in the policy)"
    for entry in rules.parse_entries(tool.egress):
        if not grant.allows_egress(entry):
            shown = ", ".join(grant.egress) or "none"
            return f"'{owner}' may not grant egress to {entry} (allowed: {shown})"
    for secret in tool.secrets:
        if not grant.allows_secret(secret.name):
            return f"'{owner}' may not use the secret {secret.name}"
    return None

"""Whether a tool stays within what its owner may grant: at registration,
and again before every call, so a narrowed grant in a reloaded policy stops
the stored tools outside it (docs/how-to/deploying.md, "A live policy")."""

from __future__ import annotations

from registry_server.domain.models import ToolDefinition
from registry_server.policy.clients import RegisterGrant
from registry_server.policy.egress import egress_refusal
from registry_server.policy.model import EgressPolicy


def grant_refusal(
    tool: ToolDefinition, owner: str, grant: RegisterGrant | None, egress: EgressPolicy
) -> str | None:
    """Why ``grant`` (``owner``'s; None: the policy gives it none any more)
    does not cover ``tool``: its level, its image, its egress and secrets; or
    None when it does."""
    if grant is None:
        return f"client '{owner}' no longer holds a register grant in the policy"
    if not tool.safety_level.at_most(grant.max_level):
        return (
            f"client '{owner}' may register tools up to level {grant.max_level.value};"
            f" '{tool.name}' is {tool.safety_level.value}"
        )
    if not grant.allows_image(tool.sandbox.image):
        return (
            f"client '{owner}' may not register tools from image '{tool.sandbox.image}'"
            f" (allowed: {', '.join(grant.images) or 'none'})"
        )
    return egress_refusal(tool, owner, grant, egress)

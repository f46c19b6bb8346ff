"""toolreg's Python API: the one import path users write.

    from registry_server.client import RegistryClient, SafetyLevel, Status

    with RegistryClient.connect("127.0.0.1:50051", token=...) as registry:
        result = registry.execute_tool("word_count", {"text": "one two"})
        if result.status is Status.OK: ...

Everything named here is stable across minor releases (CHANGELOG.md says when it
changes); every other module of the package is internal and may move. The agent
framework adapters are `registry_server.client.adapters.openai_agents` and
`.langchain` (they need their framework's extra installed).

Names are imported when first used, so a process that needs one small piece
(the server image's health probe) does not load the gRPC client with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from registry_server.client.idp_tokens import ClientCredentials, TokenError
    from registry_server.client.registry_client import (
        ApprovalWaitError,
        CallResult,
        RegistryClient,
        StreamEvent,
        describe_rpc_error,
        open_channel,
    )
    from registry_server.domain.models import SafetyLevel, ToolDefinition, parse_definition
    from registry_server.domain.outcome import ApprovalRequestView, Status
    from registry_server.signing.keys import generate_keypair, load_private_key
    from registry_server.signing.tokens import mint, mint_for

# public name -> the module that defines it
_EXPORTS = {
    "RegistryClient": "registry_server.client.registry_client",
    "CallResult": "registry_server.client.registry_client",
    "StreamEvent": "registry_server.client.registry_client",
    "ApprovalWaitError": "registry_server.client.registry_client",
    "describe_rpc_error": "registry_server.client.registry_client",
    "open_channel": "registry_server.client.registry_client",
    "ClientCredentials": "registry_server.client.idp_tokens",
    "TokenError": "registry_server.client.idp_tokens",
    "SafetyLevel": "registry_server.domain.models",
    "ToolDefinition": "registry_server.domain.models",
    "parse_definition": "registry_server.domain.models",
    "Status": "registry_server.domain.outcome",
    "ApprovalRequestView": "registry_server.domain.outcome",
    # approvers' side: keys and approval tokens
    "generate_keypair": "registry_server.signing.keys",
    "load_private_key": "registry_server.signing.keys",
    "mint": "registry_server.signing.tokens",
    "mint_for": "registry_server.signing.tokens",
}
__all__ = [
    "ApprovalRequestView",
    "ApprovalWaitError",
    "CallResult",
    "ClientCredentials",
    "RegistryClient",
    "SafetyLevel",
    "Status",
    "StreamEvent",
    "TokenError",
    "ToolDefinition",
    "describe_rpc_error",
    "generate_keypair",
    "load_private_key",
    "mint",
    "mint_for",
    "open_channel",
    "parse_definition",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'registry_server.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__

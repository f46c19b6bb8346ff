"""toolreg onto the MCP SDK's own objects: the Host/Origin allow-lists of
`toolreg mcp --http` (the SDK's TransportSecuritySettings), its bearer-token
check (the SDK's TokenVerifier and AccessToken), and a result the bridge
hands to MCP hosts. No server, no engine. The settings' checks, which need no
SDK: tests/unit/test_mcp_http_settings.py."""

from __future__ import annotations

import anyio

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.mcp.bridge import result_to_mcp
from registry_server.mcp.http import PolicyTokenVerifier, transport_security
from tests.factories import sha
from tests.unit.test_mcp_http_settings import POLICY, settings


def test_hosts_and_origins_allowed() -> None:
    loopback = transport_security(settings(), 8765)
    assert loopback.enable_dns_rebinding_protection
    assert set(loopback.allowed_hosts) == {"127.0.0.1:8765", "localhost:8765", "[::1]:8765"}
    assert loopback.allowed_origins == []  # browsers only when named

    remote = transport_security(
        settings(
            host="10.0.0.5", tls_cert="c.pem", tls_key="k.pem",
            allowed_hosts=("mcp.example.com",), allowed_origins=("https://app.example.com",),
        ),
        443,
    )  # fmt: skip
    assert set(remote.allowed_hosts) == {"10.0.0.5:443", "10.0.0.5", "mcp.example.com"}
    assert remote.allowed_origins == ["https://app.example.com"]
    assert transport_security(settings(host="fd00::5"), 8443).allowed_hosts == ["[fd00::5]:8443"]


def test_the_token_verifier_names_the_policy_client() -> None:
    verifier = PolicyTokenVerifier(POLICY)

    async def verify(token: str) -> tuple[str, str] | None:
        found = await verifier.verify_token(token)
        return None if found is None else (found.client_id, found.token)

    assert anyio.run(verify, "agent-token") == ("agent", "agent-token")
    assert anyio.run(verify, " viewer-token ") == ("viewer", "viewer-token")
    for wrong in ["", "agent-token2", "AGENT-TOKEN", sha("agent-token"), "CN=cert-only"]:
        assert anyio.run(verify, wrong) is None, wrong


def test_mcp_result_of_an_unknown_status_is_an_error_naming_it() -> None:
    result = result_to_mcp("echo", pb.ToolResult(success=False, status=99, error="new"))  # type: ignore[arg-type]
    assert result.is_error
    assert result.content[0].text == "STATUS_99: new"  # type: ignore[union-attr]

"""The bridge's approval input requests without a server: the console URL and
requestState lifetime settings, the page URL and the message."""

from __future__ import annotations

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.errors import ConfigError
from registry_server.mcp.approvals import ApprovalInputs
from registry_server.mcp.http_settings import check_console_url, check_state_ttl


def test_a_console_url_is_http_without_credentials_query_or_fragment() -> None:
    assert check_console_url("") == ""
    assert check_console_url("https://console.example/") == "https://console.example"
    assert check_console_url("http://127.0.0.1:8443/approvals") == "http://127.0.0.1:8443/approvals"
    for bad in (
        "ftp://console.example", "https://user:pw@console.example", "https://c.example/?t=1",
        "https://c.example/#x", "console.example", "https://" + "a" * 3000 + ".example",
    ):  # fmt: skip
        with pytest.raises(ConfigError, match="--console-url"):
            check_console_url(bad)


def test_the_state_lifetime_is_bounded() -> None:
    assert check_state_ttl(None) == 900.0
    assert check_state_ttl(1) == 1
    for bad in (0, -1, float("nan"), float("inf"), 86_401):
        with pytest.raises(ConfigError, match="--approval-state-ttl-s"):
            check_state_ttl(bad)


def test_the_page_and_the_message_name_the_request_tool_rule_and_approvers() -> None:
    inputs = ApprovalInputs("https://console.example/")
    request = pb.ApprovalRequest(
        id="ab" * 16, approvals_required=2, approved_by=["alice"], approvals_missing=1,
        applied_rules=[pb.AppliedRule(name="deploys", match="tool deploy_note",
                                      approvals_required=2, groups=["security"])],
    )  # fmt: skip
    assert inputs.page(request.id) == f"https://console.example/#/requests/{'ab' * 16}"
    message = inputs.message("deploy_note", request)
    assert "'deploy_note'" in message and "2 approval(s) needed, 1 missing" in message
    assert "rule 'deploys' (tool deploy_note): 2 approval(s) from security" in message

"""What `toolreg mcp --http` accepts before anything listens
(mcp/http_settings.py): the endpoint and the fail-closed refusals. The
Host/Origin allow-lists and the token check, made of the MCP SDK's objects:
tests/adapters/test_mcp_sdk_mapping.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from registry_server.domain.arguments import MAX_ARGUMENTS_BYTES
from registry_server.domain.errors import ConfigError
from registry_server.mcp.http_settings import (
    DEFAULT_MAX_BODY_BYTES,
    HttpSettings,
    OAuthSettings,
    ResumeLimits,
    check_settings,
    oauth_settings,
    resume_limits,
)
from registry_server.policy.clients import Client, Role
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.model import Policy
from registry_server.web.listener import parse_endpoint
from tests.factories import sha

POLICY = Policy(
    audience="test",
    clients=(
        Client("agent", frozenset({Role.EXECUTE}), token_sha256=sha("agent-token")),
        Client("viewer", frozenset({Role.EXECUTE}), token_sha256=sha("viewer-token")),
        Client("cert-only", frozenset({Role.EXECUTE}), mtls_subject="CN=cert-only"),
    ),
)


def settings(**changes: object) -> HttpSettings:
    base = HttpSettings(host="127.0.0.1", port=8765, policy=POLICY)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8765", ("127.0.0.1", 8765)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("mcp.example.com:443", ("mcp.example.com", 443)),
    ],
)
def test_endpoints(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["8765", "localhost", ":8765", "host:http", "host:70000", ""])
def test_bad_endpoints(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_endpoint(text)


def test_a_policy_on_loopback_is_fine() -> None:
    check_settings(settings())


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"policy": None}, "--http needs --policy"),
        ({"policy": None, "insecure_dev": True, "host": "10.0.0.5"}, "loopback only"),
        ({"policy": None, "insecure_dev": True, "host": "0.0.0.0"}, "loopback only"),
        ({"insecure_dev": True}, "exclude each other"),
        ({"host": "10.0.0.5"}, "without TLS"),
        ({"host": "mcp.example.com"}, "without TLS"),
        ({"tls_cert": "cert.pem"}, "go together"),
        (
            {"host": "0.0.0.0", "tls_cert": "c.pem", "tls_key": "k.pem"},
            "needs --allow-host",
        ),
        ({"max_sessions": 0}, "must be positive"),
        ({"max_body_bytes": -1}, "must be positive"),
        (
            {"policy": dataclasses.replace(POLICY, clients=POLICY.clients[2:])},
            "no client has a token_sha256",
        ),
    ],
)
def test_refusals(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        check_settings(settings(**changes))


def test_development_mode_on_loopback_and_tls_beyond_it_are_fine() -> None:
    check_settings(settings(policy=None, insecure_dev=True))
    check_settings(settings(policy=None, insecure_dev=True, host="::1"))
    check_settings(settings(host="10.0.0.5", tls_cert="c.pem", tls_key="k.pem"))


def test_the_body_cap_leaves_room_for_the_largest_arguments() -> None:
    assert DEFAULT_MAX_BODY_BYTES > MAX_ARGUMENTS_BYTES


# ------------------------------------------------------------------ OAuth (--oauth-provider)

IDP = IdentityProvider("corp", "https://idp.example.test", ("https://registry.example.test",))
IDP_POLICY = dataclasses.replace(POLICY, identity_providers=(IDP,))


def oauth(**changes: object) -> OAuthSettings:
    base = OAuthSettings(
        provider=IDP, resource_url="https://mcp.example.test/mcp", scopes=("mcp:tools",),
        client_id="toolreg-mcp", client_secret="s3cret", registry_resource="https://registry.example.test",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_metadata_url_inserts_the_well_known_part_before_the_path() -> None:
    assert oauth().metadata_url == (
        "https://mcp.example.test/.well-known/oauth-protected-resource/mcp"
    )


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"resource_url": "http://mcp.example.test/mcp"}, "must use https"),
        ({"resource_url": "https://mcp.example.test/other"}, "its path is /mcp"),
        ({"resource_url": "https://u:p@mcp.example.test/mcp"}, "must not carry a user"),
        ({"client_id": ""}, "--oauth-client-id"),
        ({"client_secret": ""}, "TOOLREG_OAUTH_CLIENT_SECRET"),
        ({"registry_resource": ""}, "--registry-resource"),
    ],
)
def test_oauth_settings_fail_closed(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        check_settings(settings(policy=IDP_POLICY, oauth=oauth(**changes)))


def test_oauth_settings_from_the_cli_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOOLREG_OAUTH_CLIENT_SECRET", "from-env")
    made = oauth_settings(IDP_POLICY, "corp", resource_url="http://127.0.0.1:9/mcp",
                          client_id="toolreg-mcp")  # fmt: skip
    assert made.client_secret == "from-env"  # plain http to loopback is fine here
    assert made.registry_resource == "https://registry.example.test"  # the provider's audience
    assert "from-env" not in repr(made)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    with pytest.raises(ConfigError, match="not both"):
        oauth_settings(IDP_POLICY, "corp", resource_url="https://m.test/mcp",
                       client_id="c", client_secret_file=secret_file)  # fmt: skip
    monkeypatch.delenv("TOOLREG_OAUTH_CLIENT_SECRET")
    made = oauth_settings(IDP_POLICY, "corp", resource_url="https://m.test/mcp",
                          client_id="c", client_secret_file=secret_file)  # fmt: skip
    assert made.client_secret == "from-file"
    with pytest.raises(ConfigError, match="not in"):
        oauth_settings(IDP_POLICY, "other", resource_url="https://m.test/mcp")
    with pytest.raises(ConfigError, match="needs --policy"):
        oauth_settings(None, "corp", resource_url="https://m.test/mcp")
    with pytest.raises(ConfigError, match="--resource-url"):
        oauth_settings(IDP_POLICY, "corp", resource_url=None)


@pytest.mark.parametrize(
    "limits",
    [
        ResumeLimits(ttl_s=0),
        ResumeLimits(ttl_s=float("inf")),
        ResumeLimits(ttl_s=float("nan")),
        ResumeLimits(events_per_stream=0),
        ResumeLimits(streams=-1),
        ResumeLimits(total_bytes=1024, bytes_per_stream=2048),
    ],
)
def test_resume_limits_refused(limits: ResumeLimits) -> None:
    """Resumable streams are never unbounded (mcp_event_store.py)."""
    assert limits.problems()
    with pytest.raises(ConfigError, match="--resume-"):
        check_settings(settings(resume=limits))


def test_resume_limits_from_the_command_line() -> None:
    assert ResumeLimits().problems() == []
    assert resume_limits(None, None) == ResumeLimits()
    small = resume_limits(30, 1024 * 1024)  # a total below the per-stream default lowers it
    assert (small.ttl_s, small.total_bytes, small.bytes_per_stream) == (
        30,
        1024 * 1024,
        1024 * 1024,
    )
    assert resume_limits(None, 0).problems()  # zero is refused, not read as "no cap"

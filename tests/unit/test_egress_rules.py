"""Egress and secrets, the pure decisions: allow-list entries, addresses the
proxy refuses, definitions, policy grants, the secret store and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry_server.domain.errors import InvalidDefinition
from registry_server.domain.models import SafetyLevel
from registry_server.execution.redaction import Redactor
from registry_server.execution.secrets import SecretStore, SecretUnavailable
from registry_server.policy.clients import UNRESTRICTED, RegisterGrant
from registry_server.policy.egress import egress_refusal
from registry_server.policy.model import EgressPolicy
from sandbox_runner.egress import rules
from tests.factories import manifest, tool


@pytest.mark.parametrize(
    ("entry", "host", "port", "expected"),
    [
        ("api.example.com:443", "api.example.com", 443, True),
        ("api.example.com:443", "api.example.com", 80, False),
        ("api.example.com:443", "x.api.example.com", 443, False),
        ("*.example.org:443", "a.example.org", 443, True),
        ("*.example.org:443", "a.b.example.org", 443, True),
        ("*.example.org:443", "example.org", 443, False),  # not the apex
        ("*.example.org:443", "evilexample.org", 443, False),
    ],
)
def test_entries_match_names_and_ports(entry: str, host: str, port: int, expected: bool) -> None:
    assert rules.parse_entry(entry).matches(host, port) is expected


@pytest.mark.parametrize(
    "text",
    ["1.2.3.4:443", "[::1]:443", "*.1.2.3.4:1", "API.example.com:443", "api:443",
     "api.example.com", "api.example.com:0", "api.example.com:70000", "a..b:1",
     "*.*.example.org:443", "api.example.com:443 ", "x" * 300 + ".com:1"],
)  # fmt: skip
def test_entries_name_hosts_never_addresses_or_junk(text: str) -> None:
    with pytest.raises(ValueError):
        rules.parse_entry(text)


def test_a_grant_covers_only_what_it_allows() -> None:
    grant = rules.parse_entry("*.example.org:443")
    assert grant.covers(rules.parse_entry("a.example.org:443"))
    assert grant.covers(rules.parse_entry("*.a.example.org:443"))
    assert not grant.covers(rules.parse_entry("example.org:443"))
    assert not grant.covers(rules.parse_entry("a.example.org:80"))
    assert not rules.parse_entry("a.example.org:443").covers(rules.parse_entry("*.example.org:443"))


@pytest.mark.parametrize(
    ("address", "reason"),
    [("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"),
     ("169.254.169.254", "metadata"), ("169.254.1.1", "link-local"), ("::1", "loopback"),
     ("::ffff:127.0.0.1", "loopback"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
     ("fd00::1", "private"), ("100.64.0.1", "not public")],
)  # fmt: skip
def test_the_proxy_refuses_every_address_that_is_not_public(address: str, reason: str) -> None:
    refusal = rules.refused_address(address)
    assert refusal is not None and reason in refusal
    assert rules.refused_address("93.184.216.34") is None


def test_the_policy_can_name_a_private_network() -> None:
    nets = rules.parse_networks(["10.20.0.0/16", "169.254.169.254/32"])
    assert rules.refused_address("10.20.3.4", nets) is None
    assert rules.refused_address("169.254.169.254", nets) is None
    assert rules.refused_address("10.21.0.1", nets) is not None


def _egress_tool(**extra: object) -> dict[str, object]:
    return manifest(safety_level="cautious", network={"egress": ["api.example.com:443"]}, **extra)


def test_egress_and_secrets_are_part_of_the_digest_only_when_set() -> None:
    plain = tool()
    assert "network" not in plain.as_manifest() and "secrets" not in plain.as_manifest()
    a = tool(**_egress_tool())
    b = tool(**manifest(safety_level="cautious", network={"egress": ["api.example.com:8443"]}))
    assert len({plain.digest, a.digest, b.digest}) == 3


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"secrets": [{"name": "TOKEN", "inject": {"host": "other.example.com"}}]},
         "secrets.0.inject.host"),
        ({"secrets": [{"name": "TOKEN"}]}, "secrets.0"),
        ({"secrets": [{"name": "token", "deliver": "file"}]}, "secrets.0.name"),
        ({"secrets": [{"name": "T", "inject": {"host": "api.example.com", "header": "Host"}}]},
         "secrets.0.inject.header"),
        ({"secrets": [{"name": "T", "inject": {"host": "api.example.com", "format": "x"}}]},
         "secrets.0.inject.format"),
        ({"secrets": [{"name": "T", "deliver": "file"}] * 2}, "secrets"),
        ({"secrets": [{"name": f"S{i}", "deliver": "file"} for i in range(17)]}, "secrets"),
        ({"warm_pool": 1, "secrets": [{"name": "T", "deliver": "file"}]}, "warm_pool"),
        ({"secrets": [{"name": "T", "inject": {"host": "api.example.com",
                                               "header": "Proxy-Token"}}]},
         "secrets.0.inject.header"),
    ],
)  # fmt: skip
def test_bad_secrets_are_refused_naming_the_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidDefinition) as caught:
        tool(**_egress_tool(**extra))
    assert field in [v.field for v in caught.value.violations]


def test_grants_decide_egress_and_secrets_at_registration_and_before_calls() -> None:
    t = tool(**_egress_tool(secrets=[{"name": "TOKEN", "inject": {"host": "api.example.com"}}]))
    policy = EgressPolicy()
    narrow = RegisterGrant(SafetyLevel.CAUTIOUS, ("*",), egress=("*.example.com:443",),
                           secrets=frozenset({"TOKEN"}))  # fmt: skip
    assert egress_refusal(t, "team", narrow, policy) is None
    assert egress_refusal(t, "[operator]", UNRESTRICTED, policy) is None
    assert "no register grant" in str(egress_refusal(t, "gone", None, policy))
    no_secret = RegisterGrant(SafetyLevel.CAUTIOUS, ("*",), egress=("*.example.com:443",))
    assert "secret TOKEN" in str(egress_refusal(t, "team", no_secret, policy))
    other_host = RegisterGrant(SafetyLevel.CAUTIOUS, ("*",), egress=("api.example.org:443",))
    assert "api.example.com:443" in str(egress_refusal(t, "team", other_host, policy))
    only_dangerous = EgressPolicy(levels=frozenset({SafetyLevel.DANGEROUS}))
    assert "only for dangerous" in str(egress_refusal(t, "team", narrow, only_dangerous))
    dangerous = tool(
        **manifest(safety_level="dangerous", network={"egress": ["api.example.com:443"]})
    )
    assert egress_refusal(dangerous, "ops", UNRESTRICTED, policy) is None  # by default
    only_cautious = EgressPolicy(levels=frozenset({SafetyLevel.CAUTIOUS}))
    assert "only for cautious" in str(egress_refusal(dangerous, "ops", UNRESTRICTED, only_cautious))
    safe = tool(**manifest(network={"egress": ["api.example.com:443"]}))
    assert "only for cautious, dangerous" in str(egress_refusal(safe, "ops", UNRESTRICTED, policy))


def test_secret_files_must_be_private(tmp_path: Path) -> None:
    store = SecretStore(tmp_path, environ={"TOOLREG_SECRET_FROM_ENV": "env-value"})
    (tmp_path / "GOOD").write_text("value\n")
    (tmp_path / "GOOD").chmod(0o600)
    (tmp_path / "OPEN").write_text("value")
    (tmp_path / "OPEN").chmod(0o644)
    (tmp_path / "LINK").symlink_to(tmp_path / "GOOD")
    assert store.value("GOOD") == b"value"
    assert store.value("FROM_ENV") == b"env-value"
    for name, why in (("OPEN", "readable by others"), ("LINK", "cannot open"),
                      ("MISSING", "not configured")):  # fmt: skip
        with pytest.raises(SecretUnavailable) as caught:
            store.value(name)
        assert why in str(caught.value) and "value" not in str(caught.value).split(":")[-1]


def test_redaction_replaces_secrets_even_split_across_chunks() -> None:
    redactor = Redactor({"KEY": b"s3cr3t-value", "SHORT": b"s3cr3t"})
    assert redactor.redact(b"a s3cr3t-value b s3cr3t") == b"a [secret KEY] b [secret SHORT]"
    out: list[bytes] = []
    stream = redactor.stream(lambda _s, chunk: out.append(chunk))
    for piece in (b"xx s3c", b"r3t-va", b"lue yy s3", b"cr3"):
        stream("stdout", piece)
    stream.flush()
    assert b"".join(out) == b"xx [secret KEY] yy s3cr3"
    assert not Redactor({})


def test_the_tool_belt_says_what_a_tool_reaches_and_never_a_value() -> None:
    from registry_server.domain.schemas import tool_belt

    t = tool(**_egress_tool(secrets=[{"name": "TOKEN", "inject": {"host": "api.example.com"}}]))
    belt = tool_belt([t])
    assert "reaches: api.example.com:443" in belt
    assert "TOKEN (header Authorization to api.example.com:443)" in belt

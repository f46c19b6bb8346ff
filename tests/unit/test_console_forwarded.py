"""The console's source address behind trusted reverse proxies
(console/forwarded.py) and its settings: pure logic. The same over real HTTP:
tests/browser/test_console_forwarded_throttle.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from registry_server.console.forwarded import (
    FORWARDED,
    MAX_HOPS,
    MAX_TRUSTED_PROXIES,
    ClientAddresses,
    parse_trusted_proxies,
)
from registry_server.console.settings import ConsoleSettings
from registry_server.domain.errors import ConfigError
from registry_server.signing.keys import generate_keypair
from tests.factories import sha

PROXIES = parse_trusted_proxies(["10.0.0.0/8", "2001:db8:1::/48"])


def test_without_trusted_proxies_every_forwarded_header_is_ignored() -> None:
    addresses = ClientAddresses()
    assert addresses.resolve("192.0.2.9", ["203.0.113.1"]) == "192.0.2.9"
    scope = {"client": ("192.0.2.9", 5000), "headers": [(b"x-forwarded-for", b"203.0.113.1")]}
    assert addresses.of(scope) == "192.0.2.9"


@pytest.mark.parametrize(
    ("peer", "chain", "source"),
    [
        ("10.1.1.1", ["198.51.100.7"], "198.51.100.7"),
        # The client wrote the left-most hop itself: its own address is the rightmost untrusted.
        ("10.1.1.1", ["203.0.113.99, 198.51.100.7"], "198.51.100.7"),
        ("10.1.1.1", ["203.0.113.99", "198.51.100.7, 10.2.2.2"], "198.51.100.7"),  # two proxies
        ("192.0.2.9", ["198.51.100.7"], "192.0.2.9"),  # a peer that is no trusted proxy
        ("10.1.1.1", [], "10.1.1.1"),  # a proxy that forwarded nothing: itself
        ("10.1.1.1", ["not-an-ip"], "10.1.1.1"),  # not what a proxy writes: the proxy's
        ("10.1.1.1", ["198.51.100.7, junk"], "10.1.1.1"),
        ("10.1.1.1", ["10.3.3.3"], "10.3.3.3"),  # every hop trusted: the left-most
        ("10.1.1.1", [", ".join(["10.9.9.9"] * (MAX_HOPS + 5))], "10.1.1.1"),
        ("2001:db8:1::5", ["2001:db8:2::7"], "2001:db8:2::7"),
        ("::ffff:10.1.1.1", ["::ffff:198.51.100.7"], "198.51.100.7"),
    ],
)
def test_the_rightmost_untrusted_hop_of_x_forwarded_for(
    peer: str, chain: list[str], source: str
) -> None:
    assert ClientAddresses(PROXIES).resolve(peer, chain) == source


@pytest.mark.parametrize(
    ("chain", "source"),
    [
        (['for=203.0.113.99, for="198.51.100.7:4711";proto=https'], "198.51.100.7"),
        (['for="[2001:db8:2::7]:80"'], "2001:db8:2::7"),
        (["For=198.51.100.7;by=10.1.1.1"], "198.51.100.7"),
        (["for=unknown"], "10.1.1.1"),
        (["proto=https"], "10.1.1.1"),
    ],
)
def test_the_rightmost_untrusted_hop_of_forwarded(chain: list[str], source: str) -> None:
    addresses = ClientAddresses(PROXIES, FORWARDED)
    assert addresses.resolve("10.1.1.1", chain) == source


def test_only_the_header_the_proxies_set_is_read() -> None:
    """A proxy that appends to X-Forwarded-For passes a client's own Forwarded
    header through untouched: reading it would let the client choose."""
    scope = {
        "client": ("10.1.1.1", 5000),
        "headers": [(b"forwarded", b"for=203.0.113.1"), (b"x-forwarded-for", b"198.51.100.7")],
    }
    assert ClientAddresses(PROXIES).of(scope) == "198.51.100.7"
    assert ClientAddresses(PROXIES, FORWARDED).of(scope) == "203.0.113.1"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["10.0.0.1/8"], "host bits must be zero"),
        (["proxy.example"], "not an address or CIDR network"),
        (["0.0.0.0/0"], "would trust every peer"),
        (["::/0"], "would trust every peer"),
        ([f"10.0.{i}.0/24" for i in range(MAX_TRUSTED_PROXIES + 1)], "at most"),
    ],
)
def test_bad_trusted_proxies_are_refused_naming_the_setting(
    values: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_trusted_proxies(values)
    assert str(caught.value).startswith("--trusted-proxy: ")


def test_console_settings_check_the_proxies_and_the_header(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "toolreg-console-test",
        "approvers": [{"id": "alice", "public_key": generate_keypair()[1]}],
        "clients": [{"id": "alice", "token_sha256": sha("alice-secret"), "roles": ["approve"]}],
    }))  # fmt: skip
    plain = ConsoleSettings.from_options("127.0.0.1:0", policy_file=policy)
    assert plain.trusted_proxies == ()  # the default: no forwarded header is believed
    made = ConsoleSettings.from_options(
        "127.0.0.1:0", policy_file=policy, trusted_proxies=("10.0.0.0/8", "192.0.2.1"),
        forwarded_header="Forwarded",
    )  # fmt: skip
    assert [str(n) for n in made.trusted_proxies] == ["10.0.0.0/8", "192.0.2.1/32"]
    assert made.forwarded_header == "forwarded"
    with pytest.raises(ConfigError, match="--trusted-proxy: 'nope'"):
        ConsoleSettings.from_options("127.0.0.1:0", policy_file=policy, trusted_proxies=("nope",))
    with pytest.raises(ConfigError, match="--forwarded-header: one of x-forwarded-for"):
        ConsoleSettings.from_options(
            "127.0.0.1:0", policy_file=policy, trusted_proxies=("10.0.0.0/8",),
            forwarded_header="x-real-ip",
        )  # fmt: skip
    with pytest.raises(ConfigError, match="--forwarded-header: only with --trusted-proxy"):
        ConsoleSettings.from_options(
            "127.0.0.1:0", policy_file=policy, forwarded_header="forwarded"
        )

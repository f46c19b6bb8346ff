"""Egress allow-list rules: one definition of what a `host:port` entry is,
which hosts it matches, which addresses the proxy refuses, shared by the
server (validation at registration, policy grants) and the proxy (every
connection). Standard library only: the proxy imports it in its container.

An entry names hosts, never addresses: `api.example.com:443` or
`*.example.org:443` (any name below example.org, not example.org itself).
DNS answers change under an IP allow-list; names are what an operator means.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

MAX_HOST_CHARS = 253  # characters of a DNS name (RFC 1035)
MAX_ENTRY_CHARS = 260  # characters of "host:port", a wildcard included
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[0-9]{1,5}$")
# The cloud instance metadata services: credentials of the machine itself.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)


@dataclass(frozen=True, slots=True)
class Entry:
    """One allow-list entry: a host name or `*.` wildcard, and one port."""

    host: str  # lowercase; "*.example.org" for a wildcard
    port: int

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches(self, host: str, port: int) -> bool:
        """Whether a normalized host (``normalize_host``) and port fall under this entry."""
        if port != self.port:
            return False
        if self.wildcard:
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def covers(self, other: Entry) -> bool:
        """Whether every host:port ``other`` allows, this entry allows too
        (a policy grant covering what a tool asks for)."""
        if other.port != self.port:
            return False
        if not other.wildcard:
            return self.matches(other.host, other.port)
        # *.a.example.org is inside *.example.org, never inside a plain name.
        return self.wildcard and (other.host == self.host or other.host.endswith(self.host[1:]))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_entry(text: str) -> Entry:
    """Parse `host:port`; ValueError names the rule broken."""
    if not isinstance(text, str) or not text:
        raise ValueError("must be a non-empty 'host:port'")
    if len(text) > MAX_ENTRY_CHARS:
        raise ValueError(f"at most {MAX_ENTRY_CHARS} characters")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} must be 'host:port', e.g. 'api.example.com:443'")
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if _is_address(name.strip("[]")):
        raise ValueError(f"{text!r} names an IP address; name the host instead")
    normal = normalize_host(name)
    if normal is None or normal != name:
        raise ValueError(
            f"{text!r}: the host must be a lowercase DNS name (a-z, 0-9, '-' and '.'),"
            " optionally starting with '*.'"
        )
    if "." not in normal:
        raise ValueError(f"{text!r}: name a fully qualified host (with a dot)")
    return Entry(f"*.{normal}" if wildcard else normal, int(port_text))


def parse_entries(texts: Iterable[str]) -> tuple[Entry, ...]:
    return tuple(parse_entry(t) for t in texts)


def normalize_host(text: str) -> str | None:
    """A host name as the proxy compares it (lowercase, no trailing dot), or None
    when it is not a DNS name at all (an IP literal, empty, too long, odd characters)."""
    if not isinstance(text, str) or not text or len(text) > MAX_HOST_CHARS + 1:
        return None
    host = text.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > MAX_HOST_CHARS or _is_address(host):
        return None
    if not all(_LABEL.match(label) for label in host.split(".")):
        return None
    return host


def first_match(entries: Iterable[Entry], host: str, port: int) -> Entry | None:
    for entry in entries:
        if entry.matches(host, port):
            return entry
    return None


def parse_networks(
    texts: Iterable[str],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """CIDR networks an operator lets the proxy reach although they are not public."""
    return tuple(ipaddress.ip_network(t, strict=False) for t in texts)


def refused_address(
    address: str,
    allowed_private: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> str | None:
    """Why the proxy must not connect to ``address`` (None: it may). Anything
    not globally routable is refused unless the operator's policy names its
    network; the metadata address likewise."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in allowed_private):
        return None
    if ip in METADATA_ADDRESSES:
        return f"address {ip} is the cloud metadata service"
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return f"address {ip} is {kind.replace('_', '-')}"
    if not ip.is_global:
        return f"address {ip} is not public"
    return None


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True

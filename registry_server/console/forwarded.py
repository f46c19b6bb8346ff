"""Which address a console request comes from, behind reverse proxies the
operator names (docs/how-to/approvals.md, "Behind a reverse proxy"): pure logic.

Without trusted proxies (the default) the source is the TCP peer and every
forwarded header is ignored: anyone can write one. When the peer is one of
the trusted proxies, the source is the rightmost hop of the forwarded chain
(``X-Forwarded-For``, or RFC 7239 ``Forwarded``: the one header the operator
says its proxies set) that is not itself a trusted proxy. Each proxy appends
the address it heard from, so hops to the right of the client are written by
trusted proxies and that hop by the last of them; hops to its left are the
client's own words (a forged left-most hop buys it nothing). A chain the
proxies could not have written (an unparsable hop where the client's should
be, or more trusted hops than MAX_HOPS) falls back to the peer: all such
requests count as the proxy's, as they did before proxies were trusted.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Any

X_FORWARDED_FOR = "x-forwarded-for"
FORWARDED = "forwarded"
FORWARDED_HEADERS = (X_FORWARDED_FOR, FORWARDED)
MAX_TRUSTED_PROXIES = 64  # networks --trusted-proxy may name
MAX_HOPS = 16  # hops read from the right of a forwarded chain
MAX_HEADER_CHARS = 8_192  # characters of the forwarded headers read (their right end)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# RFC 7239 for= value: a token or a quoted string; an IPv6 address in brackets, maybe a port.
_FOR = re.compile(r'(?i)(?:^|;)\s*for\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]*)')


def parse_trusted_proxies(
    values: Iterable[str], what: str = "--trusted-proxy"
) -> tuple[Network, ...]:
    """CIDRs (or single addresses) of the reverse proxies whose forwarded
    headers are believed; ValueError naming ``what`` and the rule."""
    networks: list[Network] = []
    for value in values:
        text = value.strip()
        try:
            network = ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            raise ValueError(
                f"{what}: {text[:64]!r} is not an address or CIDR network"
                f" (as 10.0.0.0/8 or 2001:db8::/32; host bits must be zero): {exc}"
            ) from None
        if network.prefixlen == 0:
            raise ValueError(
                f"{what}: {text!r} would trust every peer's forwarded header (anyone could"
                " choose its own address); name the proxies' networks"
            )
        networks.append(network)
    if len(networks) > MAX_TRUSTED_PROXIES:
        raise ValueError(f"{what}: at most {MAX_TRUSTED_PROXIES} networks, not {len(networks)}")
    return tuple(dict.fromkeys(networks))


def _address(text: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _forwarded_for(value: str) -> str:
    """The address of one RFC 7239 for= value ('"[2001:db8::1]:80"', '192.0.2.1')."""
    text = value.strip()
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        text = text[1:-1]
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else ""
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def hops(header: str, values: Sequence[str]) -> list[str]:
    """The chain's hops, left to right (only its right end: MAX_HEADER_CHARS)."""
    joined = ",".join(values)[-MAX_HEADER_CHARS:]
    if header == X_FORWARDED_FOR:
        return [hop.strip() for hop in joined.split(",")]
    found: list[str] = []
    for element in joined.split(","):
        match = _FOR.search(element)
        found.append(_forwarded_for(match.group(1)) if match else "")
    return found


class ClientAddresses:
    """The source address of a request, as the throttle and the log count it."""

    def __init__(self, trusted: Sequence[Network] = (), header: str = X_FORWARDED_FOR) -> None:
        if header not in FORWARDED_HEADERS:
            raise ValueError(f"forwarded header must be one of {', '.join(FORWARDED_HEADERS)}")
        self.trusted = tuple(trusted)
        self.header = header
        self._raw_header = header.encode("latin-1")

    def _trusted(self, ip: Address) -> bool:
        return any(ip.version == n.version and ip in n for n in self.trusted)

    def resolve(self, peer: str, values: Sequence[str]) -> str:
        """``peer``: the TCP peer's address; ``values``: the forwarded header's
        values, in the order they came."""
        peer_ip = _address(peer)
        if peer_ip is None or not self.trusted or not self._trusted(peer_ip):
            return peer[:64]
        chain = hops(self.header, values) if values else []
        last = peer_ip
        for hop in reversed(chain[-MAX_HOPS:]):
            ip = _address(hop)
            if ip is None:
                return str(last)  # not what a trusted proxy writes: the proxy's
            if not self._trusted(ip):
                return str(ip)
            last = ip
        return str(last) if len(chain) < MAX_HOPS else str(peer_ip)

    def of(self, scope: Any) -> str:
        """The source of an ASGI request (``scope``): its peer, or its client."""
        client = scope.get("client")
        peer = str(client[0]) if client else "unknown"
        if not self.trusted:
            return peer[:64]
        values = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == self._raw_header]
        return self.resolve(peer, values)

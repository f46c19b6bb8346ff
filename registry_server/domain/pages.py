"""Pages of a listing (AIP-158): page sizes and page tokens.

A listing answers a page at a time, sorted by a key (a tool's name; an
approval request's creation time and id), and the next page starts strictly
after the last key of this one (keyset pagination). So while items come and
go between pages, every item present from the first page to the last is
listed exactly once; items added or removed meanwhile may or may not be.

A page token carries that last key, for one query: the kind of listing and
its filters (a token is refused with other filters; only ``page_size`` may
change from page to page). It is base64url (no padding) of a small JSON object
followed by its HMAC-SHA256 under a key every server on the store shares
(``PageTokens``; ``api/app.py`` reads it from the store), so a page of a
listing may be asked of any server behind a load balancer. A token that was
altered, truncated or made up fails the HMAC and is refused before its JSON is
read. The MAC makes tokens tamper-evident, not secret: the JSON is readable and
holds nothing the client has not seen. Tokens do not expire: a key stays valid
for as long as the listing has items after it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from registry_server.domain.errors import InvalidArgument, Violation

MAX_PAGE_TOKEN_CHARS = 512  # characters of a page token; a longer one is refused undecoded
PAGE_KEY_BYTES = 32  # bytes of the key that signs page tokens (HMAC-SHA256)
TOKEN_VERSION = 1  # the "v" of the token's JSON; another version is refused
_MAC_BYTES = 32  # HMAC-SHA256
_QUERY_DIGEST_CHARS = 32  # hex characters of the query's sha256 held in a token
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_-]+")  # base64url, no padding
_FIELD = "page_token"

T = TypeVar("T")
# The last key of a page: (name,) for tools, (created_at, id) for approval requests.
PageKey = tuple[str | float, ...]


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing and the token of the next ("" on the last page)."""

    items: list[T]
    next_page_token: str = ""


@dataclass(frozen=True)
class PageQuery:
    """What a token is good for: a kind of listing and its filters."""

    kind: str  # "tools", "schemas", "approvals"
    filters: str  # canonical JSON of the filters (``PageQuery.of`` makes it)

    @classmethod
    def of(cls, kind: str, **filters: object) -> PageQuery:
        """``filters`` must be JSON values (strings, numbers, lists of them)."""
        return cls(kind, json.dumps(filters, sort_keys=True, separators=(",", ":")))

    @property
    def digest(self) -> str:
        text = f"{self.kind}\n{self.filters}".encode()
        return hashlib.sha256(text).hexdigest()[:_QUERY_DIGEST_CHARS]


def page_size(requested: int, default: int, maximum: int, field: str = "page_size") -> int:
    """The size of a page: ``default`` for 0, at most ``maximum``; negative is
    INVALID_ARGUMENT naming ``field``."""
    if requested < 0:
        raise InvalidArgument(
            f"{field}: must not be negative", [Violation(field, "must not be negative")]
        )
    return min(requested or default, maximum)


def _refused(reason: str) -> InvalidArgument:
    return InvalidArgument(f"{_FIELD}: {reason}", [Violation(_FIELD, reason)])


_FORGED = (
    "not a page token this registry issued (altered, truncated or made up);"
    " list again without page_token"
)
_OTHER_QUERY = (
    "issued for another query; send the same filters as for the first page (only"
    " page_size may change), or list again without page_token"
)


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class PageTokens:
    """Issues and reads page tokens under one key (``PAGE_KEY_BYTES`` bytes)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < PAGE_KEY_BYTES:
            raise ValueError(f"a page token key needs at least {PAGE_KEY_BYTES} bytes")
        self._key = key

    @classmethod
    def ephemeral(cls) -> PageTokens:
        """A key of this process only (tests; a servicer built without a store):
        another server would refuse its tokens."""
        return cls(secrets.token_bytes(PAGE_KEY_BYTES))

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def issue(self, query: PageQuery, last: PageKey) -> str:
        """The token of the page that starts after ``last``."""
        body = {"v": TOKEN_VERSION, "k": query.kind, "q": query.digest, "a": list(last)}
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode()
        return _b64encode(payload + self._mac(payload))

    def read(self, token: str, query: PageQuery, shape: Sequence[type]) -> PageKey | None:
        """The key the page starts after (None for "", the first page). ``shape``
        gives the type of each part of the key (``str`` or ``float``).
        INVALID_ARGUMENT naming page_token for anything this server did not
        issue for ``query``."""
        if not token:
            return None
        if len(token) > MAX_PAGE_TOKEN_CHARS:
            raise _refused(f"longer than {MAX_PAGE_TOKEN_CHARS} characters")
        if not _TOKEN_CHARS.fullmatch(token):
            raise _refused(_FORGED)
        try:
            raw = _b64decode(token)
        except (binascii.Error, ValueError):
            raise _refused(_FORGED) from None
        # Only the one spelling this server writes: base64 lets the unused low
        # bits of the last character vary, and a token must not.
        if len(raw) <= _MAC_BYTES or _b64encode(raw) != token:
            raise _refused(_FORGED)
        payload, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise _refused(_FORGED)
        # Authentic from here on: this key made it. Still checked field by field.
        try:
            body = json.loads(payload)
        except ValueError:
            raise _refused(_FORGED) from None
        if not isinstance(body, dict) or body.get("v") != TOKEN_VERSION:
            raise _refused(_FORGED)
        if body.get("k") != query.kind or body.get("q") != query.digest:
            raise _refused(_OTHER_QUERY)
        return _key(body.get("a"), shape)


def _key(value: object, shape: Sequence[type]) -> PageKey:
    if not isinstance(value, list) or len(value) != len(shape):
        raise _refused(_FORGED)
    parts: list[str | float] = []
    for part, kind in zip(value, shape, strict=True):
        text = kind is str and isinstance(part, str)
        number = (
            kind is float
            and isinstance(part, int | float)
            and not isinstance(part, bool)
            and math.isfinite(part)
        )
        if not (text or number):
            raise _refused(_FORGED)
        parts.append(part)
    return tuple(parts)

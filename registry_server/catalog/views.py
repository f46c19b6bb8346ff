"""Listing answers, built once per registry version, a page at a time.

An agent fetches the same tool list and schemas before nearly every turn,
while definitions change rarely; converting 1,000 definitions to messages or
schema JSON on every call cost more than the call itself. So each filtered
listing is converted once per registry version and kept whole, sorted by
name (``Listing``). A page is a slice of it that starts after the last name
of the page before (keyset pagination, domain/pages.py), and the answers of
the pages asked for are kept as well. A registration makes both stale at
once. They are kept apart, so a client paging through thousands of small
pages cannot push the listings out.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from registry_server.catalog.registry import Registry
from registry_server.domain.pages import PageQuery, PageTokens, page_size

DEFAULT_TOOLS_PAGE = 100  # tools (or schemas) per page when a request names no page_size
MAX_TOOLS_PAGE = 1_000  # tools (or schemas) per page at most; a larger page_size is cut to it
MAX_CACHED_LISTINGS = 64  # distinct (filter, format) listings kept for the current version
MAX_CACHED_ANSWERS = 64  # distinct answers (a page of a listing) kept for the current version

T = TypeVar("T")
A = TypeVar("A")


@dataclass(frozen=True)
class Listing(Generic[T]):
    """A filtered listing, converted: ``items[i]`` is the tool ``names[i]``,
    sorted by name."""

    names: tuple[str, ...]
    items: tuple[T, ...]

    @classmethod
    def of(cls, named: Sequence[tuple[str, T]]) -> Listing[T]:
        return cls(tuple(n for n, _ in named), tuple(item for _, item in named))

    def page(self, after: str | None, size: int) -> tuple[Sequence[T], str | None]:
        """The first ``size`` items named after ``after`` (from the start for
        None), and the last of their names when more follow (else None)."""
        start = 0 if after is None else bisect.bisect_right(self.names, after)
        end = start + size
        more = end < len(self.names)
        return self.items[start:end], self.names[end - 1] if more else None


class _Cache:
    """Values per key for the registry's current version, least recently used
    dropped beyond ``capacity``."""

    def __init__(self, registry: Registry, capacity: int) -> None:
        self._registry = registry
        self._capacity = capacity
        self._lock = threading.Lock()
        self._version = -1
        self._values: OrderedDict[Hashable, object] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        version = self._registry.version
        with self._lock:
            if version != self._version:
                self._values.clear()
                self._version = version
            elif key in self._values:
                self._values.move_to_end(key)
                return self._values[key]  # type: ignore[return-value]
        value = build()
        with self._lock:
            if self._version == version:
                self._values[key] = value
                while len(self._values) > self._capacity:
                    self._values.popitem(last=False)
        return value


class RegistryViews:
    def __init__(self, registry: Registry, tokens: PageTokens | None = None) -> None:
        self._tokens = tokens or PageTokens.ephemeral()
        self._listings = _Cache(registry, MAX_CACHED_LISTINGS)
        self._answers = _Cache(registry, MAX_CACHED_ANSWERS)

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The answer for ``key`` at the current registry version; ``build`` makes
        it on a miss. Callers must treat the answer as read-only."""
        return self._answers.get(key, build)

    def page(
        self,
        query: PageQuery,
        requested_size: int,
        page_token: str,
        listing: Callable[[], Sequence[tuple[str, T]]],
        answer: Callable[[Sequence[T], str], A],
    ) -> A:
        """One page of the listing ``query`` names: ``listing`` gives it whole as
        (name, item) pairs sorted by name, ``answer`` makes the reply of a page
        from its items and the next page's token ("" on the last). Raises
        InvalidArgument for a negative size or a token not issued for ``query``.
        Callers must treat the answer as read-only."""
        size = page_size(requested_size, DEFAULT_TOOLS_PAGE, MAX_TOOLS_PAGE)
        after = self._tokens.read(page_token, query, (str,))
        start = None if after is None else str(after[0])

        def build() -> A:
            whole: Listing[T] = self._listings.get(query, lambda: Listing.of(listing()))
            items, last = whole.page(start, size)
            return answer(items, "" if last is None else self._tokens.issue(query, (last,)))

        return self._answers.get((query, start, size), build)

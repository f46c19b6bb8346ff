"""Listing answers, built once per registry version.

An agent fetches the same tool list and schemas before nearly every turn,
while definitions change rarely; converting 1,000 definitions to messages or
schema JSON on every call cost more than the call itself. Answers are kept per
(registry version, request), so a registration makes them stale at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

from registry_server.catalog.registry import Registry

MAX_CACHED_ANSWERS = 64  # distinct (filter, format) answers kept for the current version

T = TypeVar("T")


class RegistryViews:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._version = -1
        self._answers: OrderedDict[Hashable, object] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The answer for ``key`` at the current registry version; ``build`` makes
        it on a miss. Callers must treat the answer as read-only."""
        version = self._registry.version
        with self._lock:
            if version != self._version:
                self._answers.clear()
                self._version = version
            elif key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]  # type: ignore[return-value]
        answer = build()
        with self._lock:
            if self._version == version:
                self._answers[key] = answer
                while len(self._answers) > MAX_CACHED_ANSWERS:
                    self._answers.popitem(last=False)
        return answer

"""The registry of tool definitions: validation happens before it (see
``models.parse_definition``); here live the rules of names, ownership,
replacement and filtering, and the durable write that precedes every change
in memory.

A tool belongs to the client that registered it. Only that client, or one
with the admin role, may replace it: a team that registers tools must not be
able to turn another team's safe tool into its own code, or re-declare a
dangerous tool as safe. What a client may register at all (the highest level,
which images) is its ``RegisterGrant`` from the policy.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from registry_server.domain import strict_json
from registry_server.domain.errors import (
    AlreadyExists,
    InvalidDefinition,
    NotFound,
    PermissionDenied,
)
from registry_server.domain.models import (
    OPERATOR_OWNER,
    SafetyLevel,
    ToolDefinition,
    parse_definition,
)
from registry_server.policy.egress import egress_refusal
from registry_server.policy.model import UNRESTRICTED, EgressPolicy, RegisterGrant
from registry_server.store import audit_chain
from registry_server.store.base import Store, StoredTool

log = logging.getLogger(__name__)


class RegisterOutcome(enum.Enum):
    CREATED = "created"
    UNCHANGED = "unchanged"  # same name, identical definition: idempotent
    REPLACED = "replaced"


ChangeListener = Callable[[ToolDefinition | None, ToolDefinition], None]
# Raises when a definition's image may not be used (e.g. it declares a VOLUME).
ImageCheck = Callable[[ToolDefinition], None]


@dataclass(frozen=True)
class Registrant:
    """Who registers: the owner-to-be, whether it may replace anyone's tool,
    and what it may register."""

    id: str
    admin: bool = False
    grant: RegisterGrant = UNRESTRICTED


OPERATOR = Registrant(OPERATOR_OWNER, admin=True)  # --tools at start: trusted


class Registry:
    """Thread-safe. Readers see an immutable snapshot; writers are serialised,
    write the store first and only then publish the new snapshot, so a failed
    write changes nothing."""

    def __init__(
        self,
        store: Store,
        image_check: ImageCheck | None = None,
        egress: EgressPolicy | None = None,
    ) -> None:
        self._store = store
        self._image_check = image_check
        self._egress = egress or EgressPolicy()  # the policy's, or the built-in default
        self._write_lock = threading.Lock()
        self._tools: dict[str, ToolDefinition] = {}
        self._version = 0
        self._listeners: list[ChangeListener] = []
        self._load(store)

    def _load(self, store: Store) -> None:
        with store.reading() as reads:
            stored = reads.tools()
        for row in stored:
            tool = self._parse(row)
            if tool is not None:
                self._tools[tool.name] = tool

    @staticmethod
    def _parse(row: StoredTool) -> ToolDefinition | None:
        try:
            tool = parse_definition(strict_json.loads(row.manifest_json, "manifest"))
        except InvalidDefinition as exc:
            # Kept in the store untouched; an operator can fix or replace it.
            log.error("stored tool %r no longer validates and is not served: %s", row.name, exc)
            return None
        return dataclasses.replace(tool, owner=row.owner)

    def reload(self, name: str | None = None) -> None:
        """Another server stored tool ``name`` (None: perhaps any): serve what the
        store holds now, and tell the listeners (cached listings, warm pools)."""
        changed: list[tuple[ToolDefinition | None, ToolDefinition]] = []
        # Read under the write lock: a registration here cannot interleave and
        # be overwritten by the older row read just before it.
        with self._write_lock:
            with self._store.reading() as reads:
                if name is None:
                    rows = reads.tools()
                else:  # one row per notification, not every manifest
                    row = reads.tool(name)
                    rows = [] if row is None else [row]
            tools = dict(self._tools)
            for row in rows:
                current = tools.get(row.name)
                if current is not None and (current.digest, current.owner) == (
                    row.digest,
                    row.owner,
                ):
                    continue
                tool = self._parse(row)
                if tool is None:
                    continue
                tools[tool.name] = tool
                changed.append((current, tool))
            if not changed:
                return
            self._tools = tools
            self._version += 1
        for old, new in changed:
            log.info("tool %s %s by another server", new.name, "replaced" if old else "created")
            for listener in self._listeners:
                listener(old, new)

    @property
    def version(self) -> int:
        """Changes whenever the set of definitions changes (for caches)."""
        return self._version

    def add_listener(self, listener: ChangeListener) -> None:
        """Called after a definition is created or replaced: (old or None, new)."""
        self._listeners.append(listener)

    def register(
        self,
        tool: ToolDefinition,
        *,
        replace: bool = False,
        by: Registrant = OPERATOR,
        check_image: bool = True,
    ) -> RegisterOutcome:
        """Store ``tool`` as ``by``'s. Raises PermissionDenied when the grant
        or ownership forbids it, AlreadyExists without ``replace``, and what
        the image check raises (the image declares a VOLUME, no engine)."""
        _check_grant(tool, by, self._egress)
        if check_image and self._image_check is not None:
            self._image_check(tool)  # engine I/O: outside the write lock
        tool = dataclasses.replace(tool, owner=by.id)
        with self._write_lock:
            current = self._tools.get(tool.name)
            if current is not None and current.digest == tool.digest:
                return RegisterOutcome.UNCHANGED
            if current is not None and current.owner != by.id and not by.admin:
                raise PermissionDenied(
                    f"tool '{tool.name}' belongs to '{current.owner}': only its owner or an"
                    " admin may replace it"
                )
            if current is not None and not replace:
                raise AlreadyExists(
                    f"tool '{tool.name}' already exists with a different definition"
                    f" (digest {current.digest[:12]}); pass replace to overwrite it"
                )
            record: dict[str, object] = {
                "event": "replaced" if current else "created",
                "tool": tool.name,
                "digest": tool.digest,
                "previous_digest": current.digest if current else None,
                "level": tool.safety_level.value,
                "image": tool.sandbox.image,
                "by": by.id,
                "previous_owner": current.owner if current else None,
            }
            manifest = strict_json.dumps(tool.as_manifest())
            with self._store.unit_of_work() as uow:
                audit_chain.append(uow, "registration", record)
                uow.put_tool(StoredTool(tool.name, manifest, tool.digest, by.id), time.time())
            tools = dict(self._tools)
            tools[tool.name] = tool
            self._tools = tools  # publish: one reference swap, atomic for readers
            self._version += 1
        for listener in self._listeners:
            listener(current, tool)
        return RegisterOutcome.CREATED if current is None else RegisterOutcome.REPLACED

    def get(self, name: str) -> ToolDefinition:
        tool = self._tools.get(name)
        if tool is None:
            raise NotFound(f"Tool '{name}' not found")
        return tool

    def find(self, name: str) -> ToolDefinition | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def list(
        self, max_level: SafetyLevel | None = None, categories: Iterable[str] = ()
    ) -> list[ToolDefinition]:
        """Tools at or below ``max_level`` AND in any of ``categories``, by name."""
        wanted = frozenset(categories)
        snapshot = self._tools
        return [
            tool
            for name, tool in sorted(snapshot.items())
            if (max_level is None or tool.safety_level.at_most(max_level))
            and (not wanted or not wanted.isdisjoint(tool.categories))
        ]


def _check_grant(tool: ToolDefinition, by: Registrant, egress: EgressPolicy) -> None:
    grant = by.grant
    if not tool.safety_level.at_most(grant.max_level):
        raise PermissionDenied(
            f"client '{by.id}' may register tools up to level {grant.max_level.value};"
            f" '{tool.name}' is {tool.safety_level.value}"
        )
    if not grant.allows_image(tool.sandbox.image):
        raise PermissionDenied(
            f"client '{by.id}' may not register tools from image '{tool.sandbox.image}'"
            f" (allowed: {', '.join(grant.images) or 'none'})"
        )
    refusal = egress_refusal(tool, by.id, grant, egress)
    if refusal is not None:
        raise PermissionDenied(refusal)

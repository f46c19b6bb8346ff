"""The registry of tool definitions: validation happens before it (see
``models.parse_definition``); here live the rules of names, ownership,
replacement and filtering, and the durable write that precedes every change
in memory.

A tool belongs to the client that registered it. Only that client, or one
with the admin role, may replace it: a team that registers tools must not be
able to turn another team's safe tool into its own code, or re-declare a
dangerous tool as safe. What a client may register at all (the highest level,
which images) is its ``RegisterGrant`` from the policy.

The kill switch (docs/how-to/deploying.md, "Incident response"): its owner or an
admin deletes a tool, an admin disables it (it stays listed, its calls are
refused) or enables it again. Either is written to the store with its audit
entry and whatever the retire hooks write (the tool's open approval requests
voided) in one unit of work, then every listener (cached listings, warm
pools) hears it; other servers on the store follow through ``reload``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from registry_server.catalog.guards import check_guards
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
from registry_server.domain.text import checked_reason
from registry_server.policy.clients import UNRESTRICTED, RegisterGrant
from registry_server.policy.grants import grant_refusal
from registry_server.policy.model import EgressPolicy
from registry_server.store import audit_chain
from registry_server.store.base import Store, StoredTool, UnitOfWork

log = logging.getLogger(__name__)


class RegisterOutcome(enum.Enum):
    CREATED = "created"
    UNCHANGED = "unchanged"  # same name, identical definition: idempotent
    REPLACED = "replaced"


# Called after a change: (the tool before or None, after or None). A tool
# deleted is (old, None); disabled or enabled, (old, new) with new.disabled.
ChangeListener = Callable[[ToolDefinition | None, ToolDefinition | None], None]
# Runs inside the unit of work that deletes or disables a tool, after its audit
# entry, with (uow, the tool as it was, why in words, who): what it writes
# commits with the change or not at all.
RetireHook = Callable[[UnitOfWork, ToolDefinition, str, str], object]
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
        egress: EgressPolicy | Callable[[], EgressPolicy] | None = None,
    ) -> None:
        self._store = store
        self._image_check = image_check
        # The policy's (read at each registration: a reload changes it), or the
        # built-in default.
        fixed = egress or EgressPolicy()
        self._egress = fixed if callable(fixed) else (lambda: fixed)
        self._write_lock = threading.Lock()
        self._tools: dict[str, ToolDefinition] = {}
        self._version = 0
        self._listeners: list[ChangeListener] = []
        self._retire_hooks: list[RetireHook] = []
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
            # Its guards compiled when it was registered; one that no longer
            # does (a stricter cost limit, a CEL runtime that changed) could
            # not be checked at its calls, and a guard that is not checked is
            # a refusal silently dropped. So the tool is not served, as any
            # stored definition that no longer validates (its calls are
            # TOOL_NOT_FOUND until an operator fixes or replaces it), rather
            # than served with the guard skipped or failing every call, and
            # the server still starts with the rest.
            check_guards(tool, source=f"stored tool '{row.name}'")
        except InvalidDefinition as exc:
            # Kept in the store untouched; an operator can fix or replace it.
            log.error("stored tool %r no longer validates and is not served: %s", row.name, exc)
            return None
        return dataclasses.replace(
            tool, owner=row.owner, disabled=row.disabled, disabled_reason=row.disabled_reason,
            tokens_not_before=row.tokens_not_before,
        )  # fmt: skip

    def reload(self, name: str | None = None) -> None:
        """Another server changed tool ``name`` (None: perhaps any): serve what
        the store holds now (a name it no longer holds was deleted), and tell
        the listeners (cached listings, warm pools)."""
        changed: list[tuple[ToolDefinition | None, ToolDefinition | None]] = []
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
            stored = {row.name for row in rows}
            gone = [n for n in tools if n not in stored] if name is None else [name]
            for removed in gone:
                if removed in tools and removed not in stored:
                    changed.append((tools.pop(removed), None))
            for row in rows:
                current = tools.get(row.name)
                if current is not None and _state(current) == (
                    row.digest, row.owner, row.disabled, row.disabled_reason,
                    row.tokens_not_before,
                ):  # fmt: skip
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
            shown = new or old
            assert shown is not None
            log.info("tool %s %s by another server", shown.name, _change(old, new))
            for listener in self._listeners:
                listener(old, new)

    @property
    def version(self) -> int:
        """Changes whenever the set of definitions changes (for caches)."""
        return self._version

    def add_listener(self, listener: ChangeListener) -> None:
        """Called after a tool is created, replaced, deleted, disabled or
        enabled: (old or None, new or None)."""
        self._listeners.append(listener)

    def add_retire_hook(self, hook: RetireHook) -> None:
        """Run inside the unit of work of every deletion and disabling."""
        self._retire_hooks.append(hook)

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
        the image check raises (the image declares a VOLUME, no engine), and
        InvalidDefinition when a guard does not compile: every way a
        definition is registered passes here, so none skips that check."""
        check_guards(tool, source=f"definition of tool '{tool.name}'")
        _check_grant(tool, by, self._egress())
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
                row = uow.tool(tool.name)
            if row is not None:  # the kill switch as stored (kept by a replacement)
                tool = dataclasses.replace(
                    tool, disabled=row.disabled, disabled_reason=row.disabled_reason,
                    tokens_not_before=row.tokens_not_before,
                )  # fmt: skip
            tools = dict(self._tools)
            tools[tool.name] = tool
            self._tools = tools  # publish: one reference swap, atomic for readers
            self._version += 1
        for listener in self._listeners:
            listener(current, tool)
        return RegisterOutcome.CREATED if current is None else RegisterOutcome.REPLACED

    def delete(self, name: str, *, reason: str = "", by: Registrant = OPERATOR) -> ToolDefinition:
        """Remove tool ``name`` (its owner or an admin; a disabled tool only an
        admin: the kill switch is the operator's), with ``reason`` (optional)
        in the audit log and the voided requests. Returns the tool as it was.
        Raises NotFound, PermissionDenied, InvalidArgument (a bad reason)."""
        reason = checked_reason(reason, required=False)
        why = f"tool '{name}' was deleted" + (f": {reason}" if reason else "")
        with self._write_lock:
            current = self.get(name)
            with self._store.unit_of_work() as uow:
                row = uow.tool(name)  # the store's word: another server may have changed it
                if row is None:
                    raise NotFound(f"Tool '{name}' not found")
                if not by.admin and row.owner != by.id:
                    raise PermissionDenied(
                        f"tool '{name}' belongs to '{row.owner}': only its owner or an admin"
                        " may delete it"
                    )
                if not by.admin and row.disabled:
                    raise PermissionDenied(
                        f"tool '{name}' was disabled by an admin: only an admin may delete it"
                    )
                uow.delete_tool(name, time.time())
                audit_chain.append(uow, "registration", {
                    "event": "deleted", "tool": name, "digest": row.digest, "by": by.id,
                    "owner": row.owner, "reason": reason,
                })  # fmt: skip
                for hook in self._retire_hooks:
                    hook(uow, current, why, by.id)
            tools = dict(self._tools)
            del tools[name]
            self._tools = tools
            self._version += 1
        for listener in self._listeners:
            listener(current, None)
        return current

    def set_enabled(
        self, name: str, enabled: bool, *, reason: str = "", by: Registrant = OPERATOR
    ) -> ToolDefinition:
        """The kill switch (admins only): disable tool ``name`` for ``reason``
        (required: refused calls and voided requests show it), or enable it
        again. Returns the tool as it is now. Raises NotFound,
        PermissionDenied, InvalidArgument (a bad or missing reason)."""
        if not by.admin:
            raise PermissionDenied(
                f"client '{by.id}' lacks the admin role: only an admin may disable or enable a tool"
            )
        reason = checked_reason(reason, required=not enabled)
        with self._write_lock:
            current = self.get(name)
            if (not current.disabled) if enabled else current.disabled_reason == reason:
                return current  # already so: nothing to write
            with self._store.unit_of_work() as uow:
                if not uow.set_tool_disabled(name, not enabled, reason, time.time()):
                    raise NotFound(f"Tool '{name}' not found")
                row = uow.tool(name)
                assert row is not None
                audit_chain.append(uow, "registration", {
                    "event": "enabled" if enabled else "disabled", "tool": name,
                    "digest": row.digest, "by": by.id, "owner": row.owner, "reason": reason,
                })  # fmt: skip
                if not enabled:
                    why = f"tool '{name}' was disabled: {reason}"
                    for hook in self._retire_hooks:
                        hook(uow, current, why, by.id)
            updated = self._parse(row) or dataclasses.replace(
                current, disabled=row.disabled, disabled_reason=row.disabled_reason,
                tokens_not_before=row.tokens_not_before,
            )  # fmt: skip
            tools = dict(self._tools)
            tools[name] = updated
            self._tools = tools
            self._version += 1
        for listener in self._listeners:
            listener(current, updated)
        return updated

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


def _state(tool: ToolDefinition) -> tuple[str, str, bool, str, float]:
    """What a stored row says of a tool besides its definition (and digest)."""
    return (tool.digest, tool.owner, tool.disabled, tool.disabled_reason, tool.tokens_not_before)


def _change(old: ToolDefinition | None, new: ToolDefinition | None) -> str:
    if new is None:
        return "deleted"
    if old is None:
        return "created"
    if old.disabled != new.disabled:
        return "disabled" if new.disabled else "enabled"
    return "replaced"


def _check_grant(tool: ToolDefinition, by: Registrant, egress: EgressPolicy) -> None:
    refusal = grant_refusal(tool, by.id, by.grant, egress)
    if refusal is not None:
        raise PermissionDenied(refusal)

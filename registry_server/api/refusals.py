"""Every refused request on the record (docs/how-to/audit.md, "Refused requests").

The one door every RPC passes is AuthInterceptor (api/auth/): it opens a
``CallScope`` for each call (the method, the peer's address, the credential's
kind, the tool the request names) and records its own refusals through it
(UNAUTHENTICATED, PERMISSION_DENIED for a role). What domain code refuses
later in the call (PERMISSION_DENIED, UNAUTHENTICATED, and RESOURCE_EXHAUSTED
from a quota, the admission queue or another capacity) reaches the client
through the one error table (api/grpc_errors.py), which reports it here with
``note``. One piece, one record format (domain/refusals.py), every kind.

Refusals the executor already records as an execution attempt (the kill
switch's TOOL_DISABLED, a deny rule's POLICY_DENIED, ...) are results, not
errors: they never pass through here, so nothing is recorded twice.
"""

from __future__ import annotations

import contextvars
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Final

from registry_server.domain.errors import (
    AtCapacity,
    PermissionDenied,
    QuotaExceeded,
    ToolregError,
    Unauthenticated,
)
from registry_server.domain.models import valid_tool_name
from registry_server.domain.refusals import Refusal
from registry_server.execution.refusal_log import RefusalLog

MAX_PEER_CHARS: Final = 128  # characters of a peer address kept (gRPC reports it; still bounded)

UNAUTHENTICATED: Final = "UNAUTHENTICATED"
PERMISSION_DENIED: Final = "PERMISSION_DENIED"
RESOURCE_EXHAUSTED: Final = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class CallScope:
    """One RPC as its refusals describe it. ``describe`` gives the peer's
    address (without its port), the kind of credential presented and the
    tool the request names: read only when the call is refused, so an
    admitted call pays nothing for them."""

    log: RefusalLog
    method: str  # the RPC's name, e.g. ExecuteTool
    describe: Callable[[], tuple[str, str, str]]  # (peer, credential kind, tool)
    client: str = ""  # the client, once its credential is known

    def refuse(self, status: str, code: str, text: str, *, provider: str = "") -> None:
        peer, credential, tool = self.describe()
        refusal = Refusal(
            status=status, code=code, text=text, method=self.method, client=self.client,
            credential=credential, peer=peer, tool=tool, provider=provider,
        )  # fmt: skip
        self.log.refuse(refusal)

    def of(self, client: str) -> CallScope:
        return replace(self, client=client)


_scope: contextvars.ContextVar[CallScope | None] = contextvars.ContextVar(
    "toolreg_refusal_scope", default=None
)


@contextmanager
def entered(scope: CallScope | None) -> Iterator[None]:
    """``scope`` is the current call's while the block runs."""
    token = _scope.set(scope)
    try:
        yield
    finally:
        _scope.reset(token)


def note(exc: ToolregError) -> None:
    """Record ``exc`` when it refuses the current call (grpc_errors.py calls
    this for every domain error it answers with)."""
    scope = _scope.get()
    reason = reason_of(exc)
    if scope is not None and reason is not None:
        status, code = reason
        scope.refuse(status, code, exc.message)


def reason_of(exc: ToolregError) -> tuple[str, str] | None:
    """(gRPC status, stable reason code) of a refusing error, else None."""
    if isinstance(exc, QuotaExceeded):
        # "quota_rate", "quota_max_queued", ... a client's share; "server_max_queued": the queue
        where = "server" if exc.subject == "server" else "quota"
        return RESOURCE_EXHAUSTED, f"{where}_{exc.limit}"
    if isinstance(exc, AtCapacity):
        return RESOURCE_EXHAUSTED, "at_capacity"
    if isinstance(exc, PermissionDenied):
        return PERMISSION_DENIED, "permission_denied"
    if isinstance(exc, Unauthenticated):
        return UNAUTHENTICATED, "unauthenticated"
    return None


def peer_host(peer: str) -> str:
    """gRPC's peer ("ipv4:10.0.0.7:51234", "ipv6:%5B::1%5D:51234", "unix:...")
    without the port: one source however many connections it opens."""
    scheme, _, rest = peer.partition(":")
    rest = urllib.parse.unquote(rest)  # gRPC writes peers as URIs: ipv6 brackets escaped
    if scheme == "ipv4":
        rest = rest.rpartition(":")[0] or rest
    elif scheme == "ipv6":
        rest = rest.rpartition(":")[0].removeprefix("[").removesuffix("]") or rest
    else:
        rest = peer
    return rest[:MAX_PEER_CHARS]


def tool_of(request: Any) -> str:
    """The tool a request names (``name``, or ``tool.name`` for RegisterTool),
    when it is a tool name: anything else stays out of the record."""
    name = getattr(request, "name", None)
    if not isinstance(name, str):
        name = getattr(getattr(request, "tool", None), "name", None)
    return name if isinstance(name, str) and valid_tool_name(name) else ""

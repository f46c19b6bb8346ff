"""Resumable SSE streams for ``toolreg mcp --http``: the SDK's session manager
with one event store view per session (``event_store.py``), and the check
that answers a resume which cannot be served in full with an HTTP error.

Why the session manager is subclassed: the SDK gives every session's transport
the same event store and names streams by JSON-RPC request id, so a store could
not tell sessions apart (see event_store.py). The two hooks used are the
manager's ``_admit_session`` (a session is made, with the principal that opened
it) and ``_discard_session`` (it ended). They are private to the SDK, so their
presence is checked when the manager is made: a changed SDK stops the bridge at
start rather than serving streams unbound to their sessions.

Why a resume is refused before the SDK sees it: for an unknown id the SDK
replays nothing and ends the stream, and its own client then reconnects with
the same id again and again. A 410 with a JSON-RPC error says at once that the
events are gone; the client gives up the call with an error.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.streamable_http import (
    LAST_EVENT_ID_HEADER,
    MCP_SESSION_ID_HEADER,
    StreamableHTTPServerTransport,
)
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.types import INVALID_REQUEST, ErrorData, JSONRPCError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from registry_server.mcp.event_store import Owner, ResumableEvents

log = logging.getLogger("toolreg.mcp")

_HOOKS = ("_admit_session", "_discard_session")


def owner_of(scope: Scope) -> Owner:
    """The principal of a request, as the SDK compares it with the session's
    creator (None without authentication)."""
    user = scope.get("user")
    return authorization_context(user) if isinstance(user, AuthenticatedUser) else None


class ResumableSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, each session's transport storing its SSE
    events in its own view of ``events`` (bound to the session and its owner)."""

    def __init__(self, *, events: ResumableEvents, **kwargs: Any) -> None:
        missing = [
            h for h in _HOOKS if not callable(getattr(StreamableHTTPSessionManager, h, None))
        ]
        if missing:
            raise RuntimeError(
                f"the installed MCP SDK has no {', '.join(missing)}: resumable streams cannot be"
                " bound to their sessions (toolreg's resume.py needs updating)"
            )
        super().__init__(event_store=None, **kwargs)  # set per session below instead
        self.events = events

    def _admit_session(self, requestor: Any) -> StreamableHTTPServerTransport | None:
        transport = super()._admit_session(requestor)
        if transport is None:
            return None
        session_id = transport.mcp_session_id
        if session_id is None or not hasattr(transport, "_event_store"):
            raise RuntimeError("the MCP SDK's transport changed: cannot give it an event store")
        # Before the transport serves anything: its first store comes with the
        # opening request, which the manager handles after this returns.
        transport._event_store = self.events.for_session(session_id, requestor)
        return transport

    async def _discard_session(
        self, session_id: str, transport: StreamableHTTPServerTransport
    ) -> None:
        self.events.forget_session(session_id)
        await super()._discard_session(session_id, transport)


class ResumeGuard:
    """ASGI: a GET with ``Last-Event-ID`` in an open session of the caller's
    own, whose events after that id are not all held, gets 410. Anything else
    (no such session, someone else's, a bad Host) goes on to the SDK, which
    answers as it does for any request; its replay finds nothing there either."""

    def __init__(
        self, app: ASGIApp, events: ResumableEvents, security: TransportSecuritySettings
    ) -> None:
        self._app = app
        self._events = events
        self._security = TransportSecurityMiddleware(security)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            request = Request(scope, receive)
            last_event_id = request.headers.get(LAST_EVENT_ID_HEADER)
            session_id = request.headers.get(MCP_SESSION_ID_HEADER)
            owner = owner_of(scope)
            if (
                last_event_id
                and session_id
                and self._events.knows_session(session_id, owner)
                and await self._security.validate_request(request, is_post=False) is None
            ):
                if not self._events.can_resume(session_id, owner, last_event_id):
                    log.info("resume refused: the events after its Last-Event-ID are not held")
                    await gone(session_id)(scope, receive, send)
                    return
                log.info("resuming a stream from its Last-Event-ID")
        await self._app(scope, receive, send)


def gone(session_id: str) -> Response:
    """410 with a JSON-RPC error (no request id) in the SDK's own form."""
    error = JSONRPCError(
        jsonrpc="2.0",
        id=None,
        error=ErrorData(
            code=INVALID_REQUEST,
            message="Last-Event-ID: the events after it are not held (unknown id, or dropped by"
            " the bridge's time or memory bounds); call the tool again",
        ),
    )
    return Response(
        error.model_dump_json(by_alias=True, exclude_unset=True),
        status_code=HTTPStatus.GONE,
        headers={MCP_SESSION_ID_HEADER: session_id},
        media_type="application/json",
    )

"""The console's first and last word on every request: security headers on
every answer (errors included), and the Host, Origin and fetch-site checks
that run before any route (DNS rebinding and cross-site requests), as
``toolreg mcp --http`` checks Host and Origin for the MCP endpoint.

A browser sends ``Origin`` with every cross-origin request and with every
same-origin change (POST), so a change without one did not come from the
console's page and is refused; reads without one (a navigation, the page's
own GETs) pass. ``Sec-Fetch-Site`` (sent by browsers, not forgeable by a
page) keeps the API to the console's own page.

Each refusal is also reported (``refused``: the console logs it, within its
log budget) with the header that failed, capped and escaped by ``shown``:
what a client sends never reaches a log line whole or raw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        # No string ever becomes HTML or script: innerHTML and friends throw.
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
    "cache-control": "no-store",  # approval requests and sessions are never cached
}
SAFE_METHODS = frozenset({"GET", "HEAD"})
MAX_SHOWN_CHARS = 100  # characters of a client's text (a header, a path) a log line shows

# A refusal as reported: the scope, the fixed reason, and what the client sent.
Refused = Callable[[Scope, str, str], None]


class Refusal(NamedTuple):
    status: int
    message: str  # what the client is told
    reason: str  # what the log says: a fixed text
    detail: str  # the header the client sent, shown()


def shown(text: str | None, cap: int = MAX_SHOWN_CHARS) -> str:
    """A client's text for a log line: at most ``cap`` characters, quoted,
    every control, format or non-printable character escaped (``repr``)."""
    if text is None:
        return "(none)"
    return repr(text[:cap]) + (f"... ({len(text)} characters)" if len(text) > cap else "")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class Guard:
    """Security headers on every answer; Host, Origin and fetch-site checks
    before any route runs (the DNS rebinding and cross-site request guards)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        hosts: frozenset[str],
        origins: frozenset[str],
        refused: Refused = lambda scope, reason, detail: None,
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        refusal = self._refusal(scope["method"], scope["path"], Headers(scope=scope))
        if refusal is not None:
            self.refused(scope, refusal.reason, refusal.detail)
            await error(refusal.status, refusal.message)(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)

    def _refusal(self, method: str, path: str, headers: Headers) -> Refusal | None:
        host = headers.get("host")
        if host not in self.hosts:
            return Refusal(
                421,
                "this console does not answer to that Host",
                "Host not this console's",
                f"Host {shown(host)}",
            )
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            return Refusal(
                403,
                "requests from other origins are refused",
                "Origin not this console's",
                f"Origin {shown(origin)}",
            )
        if origin is None and method not in SAFE_METHODS:
            return Refusal(
                403,
                "a change must come from the console's own page (Origin header)",
                "a change without Origin",
                f"{method} {shown(path)}",
            )
        # Browsers say where a request comes from; the API answers its own page only.
        site = headers.get("sec-fetch-site")
        if path.startswith("/api/") and site is not None and site != "same-origin":
            return Refusal(
                403,
                "the console's API answers its own page only",
                "API request not same-origin",
                f"Sec-Fetch-Site {shown(site)}",
            )
        return None

"""The approval console's HTTP side (``toolreg console``): the page, its
assets, and the small JSON API the page calls (docs/how-to/approvals.md, "The
approval console"). It follows the rules of ``toolreg mcp --http``
(``mcp_http``), for a browser:

* **Who.** An approver signs in by presenting its policy client token once
  (``Authorization: Bearer``, checked by the policy's own constant-time
  ``client_by_token``), or, when SSO is set up, through the organization's
  identity provider (``sso``: OpenID Connect, code flow with PKCE; the ID
  token's claims make the client as the registry maps an access token's).
  Only clients with the approve role and an approver identity may. The token
  (or the person's own access token for the registry, refreshed) then becomes
  that client's registry bearer (one registry connection per policy client,
  as the MCP bridge makes them), and the browser gets a session: an
  ``HttpOnly; SameSite=Strict`` cookie (``Secure`` under TLS) plus a CSRF
  token the page keeps in memory. Every change (approve, reject, sign out)
  needs the cookie, the CSRF header and the console's own Origin. A client's
  credential is dropped when its last session ends.
* **What.** The page lists, live, what the approver may approve (an event
  stream fed by WatchApprovalRequests under its own bearer, ``feed``) and
  reads each request in full through GetApprovalRequest; both digests are
  checked here (``views``), a mismatch disables signing, and every text is
  escaped before it leaves. The page signs in the browser with WebCrypto and
  posts only the token; this side checks the request once more and calls
  SubmitApproval. Private keys never reach this process.
* **Where.** The page loads nothing from elsewhere and runs under a strict
  Content-Security-Policy (Trusted Types included, so no HTML is ever parsed
  from strings); Host must name this listener (DNS rebinding), an Origin
  other than this console's is refused, and so is a change without one.
* **How much.** Request bodies are capped (413), sessions are capped (503
  beyond) and end when idle, event streams per session are capped (429).
  Wrong sign-ins are throttled per source address and overall (429 with
  ``Retry-After``, before the token is looked at: ``throttle``).
* **Told.** Every refused sign-in, Host/Origin/fetch-site refusal and CSRF
  refusal is logged (``toolreg.console``: source address, reason, what the
  client sent capped and escaped, never a token), one by one up to a budget
  per minute and summed up beyond it, so a flood cannot flood the log.

Order of checks on a request: Host (421), Origin and fetch site (403), then
the session (401), the CSRF header (403), and the body: its type (415), size
(413) and shape (400). A sign-in: the throttle (429), then the token (401)
and the approver (403). An SSO callback: the throttle, the state and its
browser, the provider's answer, the code exchange, the ID token, the approver;
any refusal sends the browser back to the page with a fixed reason key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Scope

from registry_server.api import logs
from registry_server.client.registry_client import (
    RegistryClient,
    TokenProvider,
    describe_rpc_error,
)
from registry_server.client.terminal import escape
from registry_server.console import views
from registry_server.console.feed import Feeds, Page
from registry_server.console.forwarded import ClientAddresses
from registry_server.console.guard import Guard, error, shown
from registry_server.console.passkey_routes import PasskeyRoutes, signer_of
from registry_server.console.sessions import Session, Sessions, SessionsFull
from registry_server.console.settings import (
    CALLBACK_PATH,
    ConsoleSettings,
    is_approver,
    may_sign_in,
)
from registry_server.console.sso import (
    FULL,
    IDP,
    LOGIN_PATH,
    PENDING_TTL_S,
    OidcClient,
    PendingLogins,
    SsoBearer,
    SsoRefused,
    identity,
)
from registry_server.console.throttle import OVERALL, LogBudget, SignInThrottle
from registry_server.domain.errors import ConfigError
from registry_server.policy.clients import Client
from registry_server.signing.tokens import MAX_TOKEN_CHARS
from registry_server.web.listener import (
    ListenerServer,
    bind,
    listener_hosts,
    shown_url,
    uvicorn_config,
)
from registry_server.wire import convert

log = logging.getLogger("toolreg.console")

COOKIE = "toolreg_console"
TLS_COOKIE = "__Host-toolreg_console"  # the prefix binds it to this host, path / and HTTPS
# A pending SSO sign-in's browser binding: SameSite=Lax, since the provider's
# redirect back is a cross-site navigation (a Strict cookie would stay home).
SSO_COOKIE = "toolreg_sso"
TLS_SSO_COOKIE = "__Host-toolreg_sso"
IDP_ERROR = re.compile(r"^[a-z_]{1,64}$")  # an OAuth error code, as the log may show it
CSRF_HEADER = "x-toolreg-csrf"
MAX_STREAMS_PER_SESSION = 4  # open event streams (tabs) per session; the next gets 429
HEARTBEAT_S = 15.0  # seconds between keep-alive comments on an idle event stream
SWEEP_S = 5.0  # seconds between sweeps for idle sessions (at most a quarter of the idle time)
RECONNECT_MS = 3000  # milliseconds the browser waits before reopening a dropped stream
# Request ids are 32 hex characters; anything else never reaches the registry.
REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
STATIC_FILES = {  # path -> (file in static/, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}
# How the registry's refusals reach the page; anything else is a bad gateway.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ENDS_STREAM = frozenset({"signed-out", "resync"})  # page messages after which a stream closes
# Kinds of refusal the log tells of (each with its own log budget)
SIGN_IN, GUARD, CSRF = "sign-in", "Host/Origin", "CSRF"


def rpc_refusal(err: grpc.RpcError) -> JSONResponse:
    """The registry's refusal as the page shows it: its code and reason, escaped."""
    code = err.code() if isinstance(err, grpc.Call) else None
    status = HTTP_STATUS.get(code, 502) if code is not None else 502
    return error(status, escape(describe_rpc_error(err), keep_newlines=True))


Bearer = str | SsoBearer  # a policy client token, or a person's SSO access tokens


class Connections:
    """One registry connection per policy client, made when it first signs
    in: never more than clients have signed in. Its bearer is asked per call
    and is that client's latest credential: its policy token, or the access
    token of its latest SSO sign-in (refreshed). A credential is forgotten
    when its client's last session ends; calls then go without one."""

    def __init__(self, connect: Callable[[TokenProvider], RegistryClient]) -> None:
        self._connect = connect
        self._by_client: dict[str, RegistryClient] = {}
        self._bearers: dict[str, Bearer] = {}

    def ensure(self, client_id: str, bearer: Bearer) -> None:
        self.forget(client_id)
        self._bearers[client_id] = bearer
        if client_id not in self._by_client:
            self._by_client[client_id] = self._connect(functools.partial(self.bearer, client_id))

    def bearer(self, client_id: str) -> str:
        """The token to send now (called on gRPC's threads): "" once forgotten."""
        bearer = self._bearers.get(client_id, "")
        return bearer if isinstance(bearer, str) else bearer()

    def forget(self, client_id: str) -> None:
        bearer = self._bearers.pop(client_id, None)
        if isinstance(bearer, SsoBearer):
            bearer.forget()

    def __call__(self, client_id: str) -> RegistryClient:
        return self._by_client[client_id]  # a session exists only after ensure()

    def close(self) -> None:
        for client in self._by_client.values():
            client.close()
        self._by_client.clear()
        for client_id in list(self._bearers):
            self.forget(client_id)


class Console:
    """The page's API over the registry, for the approvers of one policy."""

    def __init__(
        self,
        settings: ConsoleSettings,
        connect: Callable[[TokenProvider], RegistryClient],
        port: int,
        oidc: OidcClient | None = None,
    ) -> None:
        self.settings = settings
        self.port = port
        self.policy = settings.policy
        self.cookie = TLS_COOKIE if settings.tls else COOKIE
        self.sso_cookie = TLS_SSO_COOKIE if settings.tls else SSO_COOKIE
        self.sessions = Sessions(
            max_sessions=settings.max_sessions,
            idle_s=settings.session_idle_s,
            on_end=self._session_ended,
        )
        self.pending = PendingLogins()
        self.oidc = oidc
        if oidc is None and settings.sso is not None:
            redirect = settings.sso.redirect_uri or shown_url(
                settings.host, port, tls=settings.tls, path=CALLBACK_PATH
            )
            self.oidc = OidcClient.from_settings(settings.sso, redirect)
        self.throttle = SignInThrottle(window_s=settings.signin_window_s)
        # The source the throttle and the log count: the peer, unless it is a trusted proxy.
        self.sources = ClientAddresses(settings.trusted_proxies, settings.forwarded_header)
        self.log_budget = LogBudget()
        self.connections = Connections(connect)
        self.feeds = Feeds(self.connections)
        self._loop: asyncio.AbstractEventLoop | None = None
        package = resources.files(__package__ or "registry_server.console")
        self._static = {
            path: ((package / "static" / name).read_bytes(), kind)
            for path, (name, kind) in STATIC_FILES.items()
        }

    def app(self) -> ASGIApp:
        hosts = listener_hosts(self.settings.host, self.port, tls=self.settings.tls)
        hosts += self.settings.allowed_hosts
        scheme = "https" if self.settings.tls else "http"
        if self.oidc is not None:
            redirect_host = self.oidc.redirect_uri.split("/")[2]
            if redirect_host not in hosts:
                raise ConfigError(f"--sso-redirect-uri: {redirect_host} is not a Host this console"
                                  " answers to (--allow-host)")  # fmt: skip
        routes = [
            *(Route(path, self.static, methods=["GET"]) for path in STATIC_FILES),
            Route(LOGIN_PATH, self.sso_login, methods=["GET"]),
            Route(CALLBACK_PATH, self.sso_callback, methods=["GET"]),
            Route("/api/session", self.whoami, methods=["GET"]),
            Route("/api/session", self.sign_in, methods=["POST"]),
            Route("/api/session/end", self.sign_out, methods=["POST"]),
            Route("/api/events", self.events, methods=["GET"]),
            Route("/api/requests/{request_id}", self.detail, methods=["GET"]),
            Route("/api/requests/{request_id}/approve", self.approve, methods=["POST"]),
            Route("/api/requests/{request_id}/reject", self.reject, methods=["POST"]),
            *PasskeyRoutes(self, rpc_refusal).routes(),
        ]
        app = Starlette(routes=routes, lifespan=self._lifespan)
        guarded = Guard(
            app,
            hosts=frozenset(hosts),
            origins=frozenset(f"{scheme}://{h}" for h in hosts),
            refused=self._guard_refused,
        )
        # Starlette's own answers (404, 405) pass through the guard too.
        return guarded

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        sweeper = asyncio.create_task(self._sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            self.sessions.end_all("the console stopped")
            self.feeds.stop_all()
            for summary in self.log_budget.summaries(all_now=True):
                log.warning("console: %s", summary)

    async def _sweep(self) -> None:
        interval = min(SWEEP_S, self.settings.session_idle_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.sessions.expire_idle()
            for summary in self.log_budget.summaries():
                log.warning("console: %s", summary)

    def _guard_refused(self, scope: Scope, reason: str, detail: str) -> None:
        self.refused(GUARD, self.sources.of(scope), reason,
                     f"{scope['method']} {shown(scope['path'])}, {detail}")  # fmt: skip

    def refused(self, kind: str, source: str, reason: str, detail: str = "") -> None:
        """Log a refusal within the log budget: ``reason`` is a fixed text,
        ``detail`` what the client sent, already capped and escaped."""
        one_by_one, summary = self.log_budget.note(kind, source, reason)
        if summary is not None:
            log.warning("console: %s", summary)
        if one_by_one:
            log.warning("console: %s refused from %s: %s%s", kind, source, reason,
                        f" ({detail})" if detail else "")  # fmt: skip

    def stopping(self) -> None:
        """SIGTERM/SIGINT: end every open stream now rather than after the grace period."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.sessions.end_all, "the console is stopping")

    def close(self) -> None:
        self.feeds.stop_all()
        self.connections.close()
        if self.oidc is not None:
            self.oidc.close()

    # ------------------------------------------------------------ the page

    async def static(self, request: Request) -> Response:
        content, kind = self._static[request.url.path]
        return Response(content, media_type=kind)

    # ------------------------------------------------------------ sessions

    def _session(self, request: Request) -> Session | None:
        return self.sessions.use(request.cookies.get(self.cookie))

    def _changing(self, request: Request) -> Session | Response:
        """The session of a change: signed in, and the page's CSRF token sent."""
        session = self._session(request)
        if session is None:
            return error(401, "not signed in (or the session ended); sign in again")
        if not session.csrf_matches(request.headers.get(CSRF_HEADER)):
            reason = "wrong CSRF token" if CSRF_HEADER in request.headers else "no CSRF token"
            self.refused(CSRF, self.sources.of(request.scope), reason,
                         f"client {escape(session.client_id)}, {request.method}"
                         f" {shown(request.url.path)}")  # fmt: skip
            return error(403, "missing or wrong CSRF token; reload the page")
        return session

    def _cookie(
        self, value: str, *, clear: bool = False, name: str | None = None,
        same_site: str = "Strict", max_age: int | None = None,
    ) -> str:  # fmt: skip
        parts = [f"{name or self.cookie}={value}", "Path=/", "HttpOnly", f"SameSite={same_site}"]
        if clear:
            parts.append("Max-Age=0")
        elif max_age is not None:
            parts.append(f"Max-Age={max_age}")
        if self.settings.tls:
            parts.append("Secure")
        return "; ".join(parts)

    def _session_ended(self, session: Session) -> None:
        # Nobody of this client is signed in: the console holds no credential of theirs.
        if not self.sessions.of_client(session.client_id):
            self.connections.forget(session.client_id)

    def _whoami(self, session: Session) -> dict[str, Any]:
        return {"client": escape(session.client_id), "approver": escape(session.approver),
                "csrf": session.csrf, "sso": self.oidc is not None}  # fmt: skip

    async def whoami(self, request: Request) -> Response:
        session = self._session(request)
        if session is None:
            return JSONResponse({"error": "not signed in", "sso": self.oidc is not None},
                                status_code=401)  # fmt: skip
        return JSONResponse(self._whoami(session))

    async def sign_in(self, request: Request) -> Response:
        source = self.sources.of(request.scope)
        # Before the token is looked at: a throttled source learns nothing, right token or not.
        throttled = self.throttle.check(source)
        if throttled is not None:
            self.refused(SIGN_IN, source, f"throttled ({throttled.limit})")
            whose = "all sources" if throttled.limit == OVERALL else "your address"
            return error(429, f"too many failed sign-ins from {whose}; try again in"
                         f" {throttled.retry_after_s} s",
                         {"retry-after": str(throttled.retry_after_s)})  # fmt: skip
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()  # as the server reads "Bearer  T"
        client = self.policy.client_by_token(token) if scheme.lower() == "bearer" else None
        if client is None:
            self.throttle.failed(source)
            reason = "unknown token" if scheme.lower() == "bearer" else "no bearer token"
            self.refused(SIGN_IN, source, reason)
            return error(401, "unknown token: sign in with your client token from the policy",
                          {"www-authenticate": "Bearer"})  # fmt: skip
        approver = self.policy.approver_identity(client)
        if approver is None or not may_sign_in(self.policy, client):
            self.refused(SIGN_IN, source, "not an approver", f"client {escape(client.id)}")
            return error(403, f"client {client.id} is no approver: the console is for clients"
                          " with the approve role and an approver key in the policy")  # fmt: skip
        opened = self._open_session(request, source, client, approver, token)
        if isinstance(opened, str):
            return error(503, f"{opened}; try again when one ends")
        session_id, session = opened
        response = JSONResponse(self._whoami(session))
        response.headers.append("set-cookie", self._cookie(session_id))
        return response

    def _open_session(
        self, request: Request, source: str, client: Client, approver: str, bearer: Bearer,
        how: str = "",
    ) -> tuple[str, Session] | str:  # fmt: skip
        """A session for an approver whose credential was just proven: its id
        and itself, or why not (every slot taken). The browser's old session ends."""
        self.sessions.end(request.cookies.get(self.cookie), "signed in again")
        self.connections.ensure(client.id, bearer)
        try:
            opened = self.sessions.open(client.id, approver)
        except SessionsFull as exc:
            self.refused(SIGN_IN, source, "sessions full", f"client {escape(client.id)}")
            if not self.sessions.of_client(client.id):
                self.connections.forget(client.id)
            return str(exc)
        log.info("%s signed in to the console%s", client.id, how)
        return opened

    # ------------------------------------------------------------ SSO

    def _back_to_page(self, reason_key: str | None = None) -> RedirectResponse:
        """To the page; with ``reason_key`` (a fixed key the page has a text
        for) when the sign-in did not go through."""
        url = "/" if reason_key is None else f"/#sso-error={reason_key}"
        return RedirectResponse(url, status_code=303)

    def _sso_throttled(self, source: str) -> Response | None:
        throttled = self.throttle.check(source)
        if throttled is None:
            return None
        self.refused(SIGN_IN, source, f"SSO: throttled ({throttled.limit})")
        response = self._back_to_page("throttled")
        response.headers["retry-after"] = str(throttled.retry_after_s)
        return response

    def _sso_refused(self, source: str, refused: SsoRefused, detail: str = "") -> Response:
        if refused.failure:
            self.throttle.failed(source)
        self.refused(SIGN_IN, source, f"SSO: {refused.reason}", detail)
        return self._back_to_page(refused.kind)

    def _sso_gate(self, request: Request) -> tuple[str, OidcClient] | Response:
        """Where an SSO step comes from and the provider's client, unless SSO
        is off (404) or the source is throttled (before anything is read)."""
        source = self.sources.of(request.scope)
        if self.oidc is None:
            return error(404, "single sign-on is not set up on this console")
        throttled = self._sso_throttled(source)
        return throttled if throttled is not None else (source, self.oidc)

    async def sso_login(self, request: Request) -> Response:
        """Start a sign-in at the provider: a pending login bound to this
        browser, and the browser sent to the authorization endpoint."""
        gate = self._sso_gate(request)
        if isinstance(gate, Response):
            return gate
        source, oidc = gate
        try:
            started = self.pending.begin(source)
            url = await run_in_threadpool(oidc.authorization_url, started)
        except SsoRefused as refused:
            return self._sso_refused(source, refused)
        response = RedirectResponse(url, status_code=303)
        response.headers.append("set-cookie", self._cookie(
            started.browser, name=self.sso_cookie, same_site="Lax", max_age=int(PENDING_TTL_S)
        ))  # fmt: skip
        return response

    async def sso_callback(self, request: Request) -> Response:
        gate = self._sso_gate(request)
        if isinstance(gate, Response):
            return gate
        response = await self._sso_finish(request, *gate)
        # The pending login is over, whichever way it went.
        response.headers.append("set-cookie", self._cookie("", clear=True, name=self.sso_cookie,
                                                           same_site="Lax"))  # fmt: skip
        return response

    async def _sso_finish(self, request: Request, source: str, oidc: OidcClient) -> Response:
        query = request.query_params
        try:
            login = self.pending.take(query.get("state"), request.cookies.get(self.sso_cookie))
            issuer = query.get("iss")
            if issuer is not None and issuer != oidc.provider.issuer:  # RFC 9207: mix-up
                raise SsoRefused(IDP, "the callback names another issuer")
            if "error" in query or not query.get("code"):
                code = query.get("error", "")
                raise SsoRefused(IDP, "the provider answered "
                                 + (code if IDP_ERROR.match(code) else "an error"))  # fmt: skip
            tokens = await run_in_threadpool(oidc.exchange, query["code"], login)
            claims = await run_in_threadpool(oidc.verify_id_token, tokens, login)
            client = identity(self.policy, oidc.provider, claims)
        except SsoRefused as refused:
            return self._sso_refused(source, refused)
        approver = self.policy.approver_identity(client)
        if approver is None or not is_approver(self.policy, client):
            # As a bearer sign-in: a refusal, logged, not a failed guess.
            self.refused(SIGN_IN, source, "SSO: not an approver", f"client {escape(client.id)}")
            return self._back_to_page("not-approver")
        bearer = SsoBearer(oidc, tokens, on_lost=functools.partial(self._sso_lost, client.id))
        opened = self._open_session(request, source, client, approver, bearer, " (SSO)")
        if isinstance(opened, str):
            return self._back_to_page(FULL)
        response = self._back_to_page()
        response.headers.append("set-cookie", self._cookie(opened[0]))
        return response

    def _sso_lost(self, client_id: str) -> None:
        """A person's access token can no longer be refreshed (a gRPC thread
        says so): their sessions end, and their pages say why."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(
                    self.sessions.end_client, client_id,
                    "your single sign-on expired; sign in again",
                )  # fmt: skip

    async def sign_out(self, request: Request) -> Response:
        session = self._changing(request)
        if isinstance(session, Response):
            return session
        self.sessions.end(request.cookies.get(self.cookie))
        log.info("%s signed out of the console", session.client_id)
        response = JSONResponse({"signed_out": True})
        response.headers.append("set-cookie", self._cookie("", clear=True))
        return response

    # ------------------------------------------------------- live requests

    async def events(self, request: Request) -> Response:
        session = self._session(request)
        if session is None:
            return error(401, "not signed in")
        if len(session.streams) >= MAX_STREAMS_PER_SESSION:
            return error(429, f"{MAX_STREAMS_PER_SESSION} pages of this session are open;"
                          " close one")  # fmt: skip
        feed = self.feeds.of(session.client_id)
        page = Page()
        key = id(page)
        session.streams[key] = lambda reason: page.last_word(
            {"kind": "signed-out", "reason": escape(reason)}
        )
        feed.join(page)

        async def stream() -> AsyncIterator[str]:
            try:
                yield f"retry: {RECONNECT_MS}\n\n"
                while True:
                    try:
                        item = await asyncio.wait_for(page.queue.get(), HEARTBEAT_S)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"data: {json.dumps(item)}\n\n"  # ASCII, one line: valid SSE data
                    if item["kind"] in ENDS_STREAM:
                        return
            finally:
                feed.leave(page)
                session.streams.pop(key, None)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"}
        )

    # ------------------------------------------------------------- actions

    async def detail(self, request: Request) -> Response:
        session = self._session(request)
        if session is None:
            return error(401, "not signed in")
        request_id = request.path_params["request_id"]
        if not REQUEST_ID.match(request_id):
            return error(404, "no such approval request")
        client = self.connections(session.client_id)
        try:
            req = await run_in_threadpool(client.approval_request, request_id)
        except grpc.RpcError as err:
            return rpc_refusal(err)
        return JSONResponse(views.detail(req, session.approver))

    async def approve(self, request: Request) -> Response:
        return await self._act(request, "token", self._submit)

    async def reject(self, request: Request) -> Response:
        return await self._act(request, "reason", self._reject)

    async def _act(
        self,
        request: Request,
        field: str,
        action: Callable[[Session, RegistryClient, str, str], Awaitable[Response]],
    ) -> Response:
        """A change: session and CSRF, the request id, a capped JSON body whose
        ``field`` is a string, then ``action``; the registry's refusals as 4xx."""
        session = self._changing(request)
        if isinstance(session, Response):
            return session
        request_id = request.path_params["request_id"]
        if not REQUEST_ID.match(request_id):
            return error(404, "no such approval request")
        body = await self._json_body(request)
        if isinstance(body, Response):
            return body
        value = body.get(field)
        if not isinstance(value, str) or not value:
            return error(400, f"the body needs {field!r}: a non-empty string")
        try:
            return await action(session, self.connections(session.client_id), request_id, value)
        except grpc.RpcError as err:
            return rpc_refusal(err)

    async def _submit(
        self, session: Session, client: RegistryClient, request_id: str, token: str
    ) -> Response:
        if len(token) > MAX_TOKEN_CHARS:
            return error(400, f"the token is longer than {MAX_TOKEN_CHARS} characters")
        if signer_of(self.policy, token) != session.approver:
            # A console user signs as itself; a token of someone else is not theirs to hand in.
            return error(403, f"the token is not signed as {escape(session.approver)},"
                          " the approver you are signed in as")  # fmt: skip
        # Checked again at submission, not only when shown: the request may have changed.
        req = await run_in_threadpool(client.approval_request, request_id)
        refusal = views.why_not_signable(req, session.approver, views.checks_of(req))
        if refusal is not None:
            return error(409, refusal)
        updated = await run_in_threadpool(client.submit_approval, request_id, token)
        log.info("%s approved request %s in the console", session.client_id, request_id)
        return JSONResponse({"request": views.summary(convert.approval_request_from_pb(updated))})

    async def _reject(
        self, session: Session, client: RegistryClient, request_id: str, reason: str
    ) -> Response:
        updated = await run_in_threadpool(client.reject_approval_request, request_id, reason)
        log.info("%s rejected request %s in the console", session.client_id, request_id)
        return JSONResponse({"request": views.summary(updated)})

    async def _json_body(self, request: Request) -> dict[str, Any] | Response:
        """The body as a JSON object, read only up to the cap."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return error(415, "the body must be application/json")
        cap = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            return error(413, f"the body is larger than {cap} bytes")
        received = bytearray()
        async for chunk in request.stream():
            received += chunk
            if len(received) > cap:
                return error(413, f"the body is larger than {cap} bytes")
        try:
            value = json.loads(received)
        except ValueError:
            return error(400, "the body is not JSON")
        if not isinstance(value, dict):
            return error(400, "the body must be a JSON object")
        return value


class _ConsoleServer(ListenerServer):
    def __init__(self, config: Any, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()


def serve_console(
    connect: Callable[[TokenProvider], RegistryClient],
    settings: ConsoleSettings,
    *,
    address: str,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve the console until SIGINT/SIGTERM (blocking). ``connect(bearer)``
    opens a registry client that asks ``bearer`` for its token on every call;
    ``announce`` gets the URL once the socket listens (default: a line on stderr)."""
    logs.quiet_http_clients()  # no request URL (a credential, some are) in this process's log
    settings.check()
    sock = bind(settings.host, settings.port)
    port = int(sock.getsockname()[1])
    console = Console(settings, connect, port)
    config = uvicorn_config(console.app(), tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    server = _ConsoleServer(config, console.stopping)
    log.info(
        "approval console for toolreg at %s (approvers of %s)", address, settings.policy.source
    )
    (announce or _announce)(shown_url(settings.host, port, tls=settings.tls, path="/"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        console.close()


def _announce(url: str) -> None:
    print(f"toolreg console: serving the approval console on {url}", file=sys.stderr, flush=True)

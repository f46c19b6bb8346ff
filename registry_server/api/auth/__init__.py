"""Who is calling, and may they? One interceptor for every RPC.

With a policy, a caller is a client of the policy, known by a bearer token
(`authorization: Bearer ...`, compared by sha256), by an access token of an
identity provider the policy trusts (a JWT, ``access_tokens``; the policy's
mapping makes it a client like any other), or by the subject of a verified
mTLS client certificate. Unknown or missing credentials get
UNAUTHENTICATED; a missing role gets PERMISSION_DENIED. Without a policy
(development mode, loopback only) every caller is the anonymous developer.
Health and reflection stay open: they reveal nothing a port scan would not.
Everything fails closed: a method in neither table is refused, and domain code
asking who calls outside an admitted RPC gets UNAUTHENTICATED, never the
developer. Every refusal, here or later in the call, goes on the record
(api/refusals.py): each call runs in a refusal scope opened here.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from registry_server.api import refusals
from registry_server.api.auth.access_tokens import AccessTokens, TokenRefused, looks_like_jwt
from registry_server.api.handlers import refuse, rewrap
from registry_server.api.refusals import CallScope
from registry_server.domain.errors import Unauthenticated
from registry_server.domain.models import SafetyLevel
from registry_server.domain.refusals import BEARER, IDP_JWT, MALFORMED, MTLS, NO_CREDENTIAL
from registry_server.execution.refusal_log import RefusalLog
from registry_server.policy.clients import UNRESTRICTED, Client, RegisterGrant, Role
from registry_server.policy.live import PolicySource, source_of
from registry_server.policy.model import Policy

SERVICE = "/toolregistry.v1.ToolRegistry/"
ANY_CLIENT: frozenset[Role] = frozenset()  # authenticated, no particular role
# The roles that open each method (any one of them suffices).
METHOD_ROLES: dict[str, frozenset[Role]] = {
    SERVICE + "RegisterTool": frozenset({Role.REGISTER}),
    SERVICE + "GetTool": ANY_CLIENT,
    SERVICE + "ListTools": ANY_CLIENT,
    SERVICE + "GetToolSchemas": ANY_CLIENT,
    SERVICE + "ExecuteTool": frozenset({Role.EXECUTE}),
    SERVICE + "StreamExecuteTool": frozenset({Role.EXECUTE}),
    # only the call's own client: the domain checks (execution/call_log.py)
    SERVICE + "AttachExecution": frozenset({Role.EXECUTE}),
    # the call's own client or an admin: the domain checks which (call_log.py)
    SERVICE + "CancelExecution": frozenset({Role.EXECUTE, Role.ADMIN}),
    SERVICE + "ListApprovalRequests": frozenset({Role.APPROVE}),
    # callers poll their own request while they wait for approvers
    SERVICE + "GetApprovalRequest": frozenset({Role.APPROVE, Role.EXECUTE}),
    SERVICE + "SubmitApproval": frozenset({Role.APPROVE}),
    SERVICE + "RejectApprovalRequest": frozenset({Role.APPROVE}),
    # approvers watch what they may approve; agents wait for their own requests
    SERVICE + "WatchApprovalRequests": frozenset({Role.APPROVE, Role.EXECUTE}),
    # a tool's owner (register) or an admin; the domain checks which
    SERVICE + "DeleteTool": frozenset({Role.REGISTER, Role.ADMIN}),
    # the kill switch and the policy are the operator's
    SERVICE + "SetToolEnabled": frozenset({Role.ADMIN}),
    SERVICE + "ReloadPolicy": frozenset({Role.ADMIN}),
    SERVICE + "GetServerInfo": ANY_CLIENT,
}
# Open to anyone who can connect: they reveal nothing a port scan would not.
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
DEVELOPER_ID = "developer"


@dataclass(frozen=True)
class Principal:
    id: str
    roles: frozenset[Role]
    max_level: SafetyLevel | None  # for execute; None = any level
    register: RegisterGrant = UNRESTRICTED  # what it may register (with the role)
    approver: str | None = None  # the policy's approver this client is, if any
    # who acts for this client (an IdP token's act claim: a bridge acting for a person)
    actor: str | None = None
    # an IdP access token's verified claims (empty for other credentials)
    claims: Mapping[str, Any] = field(default_factory=dict)

    @property
    def admin(self) -> bool:
        return Role.ADMIN in self.roles


DEVELOPER = Principal(DEVELOPER_ID, frozenset(Role), None, UNRESTRICTED)
_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("toolreg_principal")


def current_principal() -> Principal:
    """The caller of the RPC being served (set by AuthInterceptor). Outside an
    admitted RPC there is no caller: refuse rather than guess."""
    principal = _current.get(None)
    if principal is None:
        raise Unauthenticated("no authenticated caller for this call")
    return principal


class AuthError(Exception):
    """A refusal at the door: ``reason`` is its stable code for the record
    (api/refusals.py), ``client`` the caller when its credential was known."""

    def __init__(
        self, code: grpc.StatusCode, message: str, reason: str, *, client: str = "",
        provider: str = "",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.client = client
        self.provider = provider


class Authenticator:
    def __init__(
        self, policy: Policy | PolicySource | None, access_tokens: AccessTokens | None = None
    ) -> None:
        # None: development mode; else the policy in force, read per call
        self._policy = None if policy is None else source_of(policy)
        self.access_tokens = access_tokens or AccessTokens()

    def identify(
        self, metadata: tuple[tuple[str, Any], ...], auth_context: Mapping[str, Any]
    ) -> Principal:
        if self._policy is None:
            return DEVELOPER
        policy = self._policy()
        client = None
        actor = None
        claims: Mapping[str, Any] = {}
        bearer = [str(v) for k, v in metadata if k == "authorization"]
        if bearer:
            scheme, _, token = bearer[0].partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED, "authorization must be 'Bearer <token>'",
                    "malformed_authorization",
                )  # fmt: skip
            token = token.strip()
            client = policy.client_by_token(token)
            if client is None and policy.identity_providers and looks_like_jwt(token):
                client, actor, claims = self._from_access_token(policy, token)
            if client is None:
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token", "unknown_bearer_token"
                )
        else:
            for subject in _subjects(auth_context):
                client = policy.client_by_subject(subject)
                if client is not None:
                    break
            if client is None:
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no known credential: send 'authorization: Bearer <token>'"
                    " or a client certificate",
                    "unknown_certificate" if _subjects(auth_context) else "no_credential",
                )
        return Principal(
            client.id, client.roles, client.max_safety_level, client.register,
            policy.approver_identity(client), actor, claims,
        )  # fmt: skip

    def _from_access_token(
        self, policy: Policy, token: str
    ) -> tuple[Client, str | None, Mapping[str, Any]]:
        try:
            verified = self.access_tokens.verify(policy, token)
        except TokenRefused as refused:
            code = "idp_token_expired" if refused.reason == "expired" else "idp_token_invalid"
            # The precise reason (never token content: access_tokens.py) goes on the record.
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED, refused.answer, code,
                provider=refused.provider if refused.provider != "-" else "",
            ) from None  # fmt: skip
        client = verified.client
        if not client.roles:
            # Known to the provider, granted nothing here: fail closed on every method.
            raise AuthError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"client '{client.id}' has no role in this policy (none of its groups is mapped)",
                "no_role_mapped", client=client.id, provider=verified.provider,
            )  # fmt: skip
        return client, verified.actor, verified.claims


def credential_kind(metadata: tuple[tuple[str, Any], ...], auth_context: Mapping[str, Any]) -> str:
    """What kind of credential a call presents, for the record: never the
    credential, nor any part of it."""
    bearer = [str(v) for k, v in metadata if k == "authorization"]
    if bearer:
        scheme, _, token = bearer[0].partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MALFORMED
        return IDP_JWT if looks_like_jwt(token.strip()) else BEARER
    return MTLS if _subjects(auth_context) else NO_CREDENTIAL


def _subjects(auth_context: Mapping[str, Any]) -> list[str]:
    """The verified certificate's whole subject ("CN=agent-1,O=Acme"). Only the
    whole subject matches a policy entry: a certificate for "CN=agent-1,O=Evil"
    from the same CA is another client, not agent-1."""
    if auth_context.get("transport_security_type") != [b"ssl"]:
        return []
    return [v.decode("utf-8", "replace") for v in auth_context.get("x509_subject", [])]


def authorize(principal: Principal, method: str) -> None:
    needed = METHOD_ROLES[method]
    if needed and not needed & principal.roles:
        names = " or ".join(sorted(r.value for r in needed))
        raise AuthError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"client '{principal.id}' lacks the {names} role for {method.removeprefix(SERVICE)}",
            "missing_role", client=principal.id,
        )  # fmt: skip


class AuthInterceptor(grpc.ServerInterceptor):
    """``refusals``: where refused calls are recorded (None: not recorded,
    for servers without a store of their own in tests)."""

    def __init__(self, authenticator: Authenticator, refusals: RefusalLog | None = None) -> None:
        self._auth = authenticator
        self._refusals = refusals

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        method = details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        if method not in METHOD_ROLES:
            # A method someone added without deciding who may call it.
            message = "method not open to clients"

            def record(request: Any, context: grpc.ServicerContext) -> None:
                scope = self._scope(request, context, method)
                if scope is not None:
                    scope.refuse(refusals.PERMISSION_DENIED, "method_not_open", message)

            return refuse(handler, grpc.StatusCode.PERMISSION_DENIED, message, before=record)
        return rewrap(handler, lambda b: self._unary(b, method), lambda b: self._stream(b, method))

    def _scope(self, request: Any, context: grpc.ServicerContext, method: str) -> CallScope | None:
        if self._refusals is None:
            return None

        def describe() -> tuple[str, str, str]:
            metadata, auth_context = context.invocation_metadata(), context.auth_context()
            return (
                refusals.peer_host(context.peer()),
                credential_kind(metadata, auth_context),
                refusals.tool_of(request),
            )

        return CallScope(self._refusals, method.removeprefix(SERVICE), describe)

    def _admit(
        self, request: Any, context: grpc.ServicerContext, method: str
    ) -> tuple[Principal, CallScope | None]:
        """Who calls, once known to be allowed this method; refused (and on
        the record) otherwise. The scope records what the call refuses later."""
        scope = self._scope(request, context, method)
        try:
            principal = self._auth.identify(context.invocation_metadata(), context.auth_context())
            authorize(principal, method)
        except AuthError as exc:
            if scope is not None:
                scope.of(exc.client).refuse(
                    exc.code.name, exc.reason, exc.message, provider=exc.provider
                )
            context.abort(exc.code, exc.message)
        return principal, scope.of(principal.id) if scope is not None else None

    def _unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            principal, scope = self._admit(request, context, method)
            token = _current.set(principal)
            try:
                with refusals.entered(scope):
                    return behavior(request, context)
            finally:
                _current.reset(token)

        return run

    def _stream(
        self, behavior: Callable[..., Iterator[Any]], method: str
    ) -> Callable[..., Iterator[Any]]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            principal, scope = self._admit(request, context, method)
            items = behavior(request, context)
            while True:
                # A generator's body runs at each next(): the caller (and the
                # refusal scope) must be known there, not only when it was made.
                token = _current.set(principal)
                try:
                    with refusals.entered(scope):
                        item = next(items)
                except StopIteration:
                    return
                finally:
                    _current.reset(token)
                yield item

        return run

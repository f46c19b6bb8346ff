"""Who may call which RPC (api/auth.py): the role table method by method, the
open methods, bearer tokens and whole mTLS subjects, fail-closed answers for
missing, malformed or unknown credentials and for methods nobody decided on,
and development mode. The decision functions are called directly, the
interceptor only with a stand-in context; no server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest

from registry_server.api.auth import (
    DEVELOPER,
    METHOD_ROLES,
    OPEN_METHODS,
    SERVICE,
    Authenticator,
    AuthError,
    AuthInterceptor,
    Principal,
    authorize,
)
from registry_server.domain.models import SafetyLevel
from registry_server.policy.clients import UNRESTRICTED, RegisterGrant, Role
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy
from registry_server.signing.keys import generate_keypair
from tests.factories import sha

REGISTER, EXECUTE, APPROVE, ADMIN = Role.REGISTER, Role.EXECUTE, Role.APPROVE, Role.ADMIN
SSL = {"transport_security_type": [b"ssl"]}


POLICY = f"""\
audience: toolreg-test
approvers:
  - id: alice
    public_key: "{generate_keypair()[1]}"
clients:
  - id: agent-1
    token_sha256: "{sha("agent-secret")}"
    mtls_subject: "CN=agent-1,O=Acme"
    roles: [execute, register]
    max_safety_level: cautious
  - id: alice
    token_sha256: "{sha("alice-secret")}"
    roles: [approve]
  - id: viewer
    mtls_subject: "CN=viewer,O=Acme"
    roles: []
  - id: ops-admin
    mtls_subject: "CN=ops-admin,O=Acme"
    roles: [admin]
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    path: Path = tmp_path_factory.mktemp("auth") / "policy.yaml"
    path.write_text(POLICY)
    return load_policy(path)


@pytest.fixture(scope="module")
def auth(policy: Policy) -> Authenticator:
    return Authenticator(policy)


def bearer(value: str) -> tuple[tuple[str, Any], ...]:
    return (("authorization", value),)


def cert(subject: str) -> dict[str, Any]:
    return {**SSL, "x509_subject": [subject.encode()]}


def principal(*roles: Role) -> Principal:
    return Principal("c", frozenset(roles), SafetyLevel.SAFE)


# ------------------------------------------------------------------ the role table

# The table as the design states it, written out independently of METHOD_ROLES:
# any one of the listed roles opens the method; an empty set means any client.
EXPECTED_TABLE: dict[str, frozenset[Role]] = {
    "RegisterTool": frozenset({REGISTER}),
    "GetTool": frozenset(),
    "ListTools": frozenset(),
    "GetToolSchemas": frozenset(),
    "ExecuteTool": frozenset({EXECUTE}),
    "StreamExecuteTool": frozenset({EXECUTE}),
    "AttachExecution": frozenset({EXECUTE}),
    "CancelExecution": frozenset({EXECUTE, ADMIN}),
    "ListApprovalRequests": frozenset({APPROVE}),
    "GetApprovalRequest": frozenset({APPROVE, EXECUTE}),
    "SubmitApproval": frozenset({APPROVE}),
    "RejectApprovalRequest": frozenset({APPROVE}),
    "WatchApprovalRequests": frozenset({APPROVE, EXECUTE}),
    "DeleteTool": frozenset({REGISTER, ADMIN}),
    "SetToolEnabled": frozenset({ADMIN}),
    "ReloadPolicy": frozenset({ADMIN}),
    "GetServerInfo": frozenset(),
}
# What the admin role alone opens: the operator's own switches.
ADMIN_METHODS = {"DeleteTool", "SetToolEnabled", "ReloadPolicy", "CancelExecution"}
ROLE_SETS: list[frozenset[Role]] = [
    frozenset(),
    frozenset({REGISTER}),
    frozenset({EXECUTE}),
    frozenset({APPROVE}),
    frozenset({ADMIN}),
    frozenset({EXECUTE, REGISTER}),
    frozenset(Role),
]
TABLE_CASES = [
    pytest.param(
        method,
        roles,
        not needed or bool(needed & roles),
        id=f"{method}-{'+'.join(sorted(r.value for r in roles)) or 'none'}",
    )
    for method, needed in EXPECTED_TABLE.items()
    for roles in ROLE_SETS
]


def test_a_client_is_the_approver_of_its_id_or_the_one_it_names(auth: Authenticator) -> None:
    alice = auth.identify(bearer("Bearer alice-secret"), {})
    agent = auth.identify(bearer("Bearer agent-secret"), {})
    assert (alice.approver, agent.approver) == ("alice", None)


def test_the_table_names_exactly_the_services_methods() -> None:
    assert set(METHOD_ROLES) == {SERVICE + m for m in EXPECTED_TABLE}
    assert {m: METHOD_ROLES[SERVICE + m] for m in EXPECTED_TABLE} == EXPECTED_TABLE


@pytest.mark.parametrize(("method", "roles", "allowed"), TABLE_CASES)
def test_role_table(method: str, roles: frozenset[Role], allowed: bool) -> None:
    caller = Principal("c", roles, SafetyLevel.SAFE)
    if allowed:
        authorize(caller, SERVICE + method)
        return
    with pytest.raises(AuthError) as info:
        authorize(caller, SERVICE + method)
    assert info.value.code is grpc.StatusCode.PERMISSION_DENIED
    names = " or ".join(sorted(r.value for r in EXPECTED_TABLE[method]))
    assert info.value.message == f"client 'c' lacks the {names} role for {method}"


def test_the_denial_names_every_role_that_would_open_the_method() -> None:
    with pytest.raises(AuthError) as info:
        authorize(principal(REGISTER), SERVICE + "GetApprovalRequest")
    assert info.value.message == (
        "client 'c' lacks the approve or execute role for GetApprovalRequest"
    )


def test_admin_alone_opens_only_the_operators_switches() -> None:
    """admin widens what register may do, and opens the kill switch, deletion,
    the policy reload and cancelling any running call; no other role-gated method."""
    for method, needed in EXPECTED_TABLE.items():
        if needed and method in ADMIN_METHODS:
            authorize(principal(ADMIN), SERVICE + method)
        elif needed:
            with pytest.raises(AuthError):
                authorize(principal(ADMIN), SERVICE + method)


@pytest.mark.parametrize(
    "method",
    [
        "/toolregistry.v1.ToolRegistry/DropTool",
        "/toolregistry.v1.ToolRegistry/registertool",  # case matters
        "/toolregistry.v2.ToolRegistry/RegisterTool",
        "RegisterTool",
        "",
    ],
)
def test_authorize_never_admits_a_method_outside_the_table(method: str) -> None:
    with pytest.raises(KeyError):
        authorize(principal(*Role), method)


def test_open_methods_are_health_and_reflection_only() -> None:
    assert {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    } == OPEN_METHODS
    assert not OPEN_METHODS & set(METHOD_ROLES)
    assert all(not m.startswith(SERVICE) for m in OPEN_METHODS)


# ------------------------------------------------------------------ credentials


@pytest.mark.parametrize(
    ("metadata", "auth_context", "client_id"),
    [
        pytest.param(bearer("Bearer agent-secret"), {}, "agent-1", id="bearer"),
        pytest.param(bearer("bearer agent-secret"), {}, "agent-1", id="scheme any case"),
        pytest.param(bearer("BEARER  agent-secret "), {}, "agent-1", id="spaces around token"),
        pytest.param(bearer("Bearer alice-secret"), {}, "alice", id="another bearer"),
        pytest.param((), cert("CN=agent-1,O=Acme"), "agent-1", id="mtls subject"),
        pytest.param((), cert("CN=viewer,O=Acme"), "viewer", id="mtls, no roles"),
        pytest.param(
            (("x-other", "1"),),
            {**SSL, "x509_subject": [b"CN=unknown", b"CN=viewer,O=Acme"]},
            "viewer",
            id="second subject known",
        ),
    ],
)
def test_known_credentials_identify_their_client(
    auth: Authenticator,
    metadata: tuple[tuple[str, Any], ...],
    auth_context: dict[str, Any],
    client_id: str,
) -> None:
    assert auth.identify(metadata, auth_context).id == client_id


NO_CREDENTIAL = "no known credential: send 'authorization: Bearer <token>' or a client certificate"
MALFORMED = "authorization must be 'Bearer <token>'"


@pytest.mark.parametrize(
    ("metadata", "auth_context", "message"),
    [
        pytest.param((), {}, NO_CREDENTIAL, id="nothing"),
        pytest.param((("x-api-key", "agent-secret"),), {}, NO_CREDENTIAL, id="other header"),
        pytest.param(bearer("Bearer nope"), {}, "unknown bearer token", id="unknown token"),
        pytest.param(bearer("Bearer"), {}, MALFORMED, id="no token"),
        pytest.param(bearer("Bearer    "), {}, MALFORMED, id="blank token"),
        pytest.param(bearer(""), {}, MALFORMED, id="empty header"),
        pytest.param(bearer("agent-secret"), {}, MALFORMED, id="no scheme"),
        pytest.param(bearer("Basic agent-secret"), {}, MALFORMED, id="basic scheme"),
        pytest.param(
            bearer("Bearer " + sha("agent-secret")),
            {},
            "unknown bearer token",
            id="the stored hash is not the token",
        ),
        pytest.param(
            bearer("Bearer agent-secretx"), {}, "unknown bearer token", id="token plus a char"
        ),
        pytest.param((), cert("CN=agent-1"), NO_CREDENTIAL, id="subject prefix"),
        pytest.param((), cert("CN=agent-1,O=Acme,OU=x"), NO_CREDENTIAL, id="subject longer"),
        pytest.param((), cert("CN=agent-1,O=Evil"), NO_CREDENTIAL, id="same CN, other O"),
        pytest.param((), cert("cn=agent-1,o=acme"), NO_CREDENTIAL, id="subject other case"),
        pytest.param((), cert(" CN=agent-1,O=Acme"), NO_CREDENTIAL, id="subject leading space"),
        pytest.param(
            (),
            {"transport_security_type": [b"insecure"], "x509_subject": [b"CN=agent-1,O=Acme"]},
            NO_CREDENTIAL,
            id="subject without TLS",
        ),
        pytest.param(
            (), {"x509_subject": [b"CN=agent-1,O=Acme"]}, NO_CREDENTIAL, id="no transport type"
        ),
        pytest.param(
            bearer("Bearer nope"),
            cert("CN=agent-1,O=Acme"),
            "unknown bearer token",
            id="a bad token is not rescued by a good certificate",
        ),
    ],
)
def test_missing_or_unknown_credentials_are_unauthenticated(
    auth: Authenticator,
    metadata: tuple[tuple[str, Any], ...],
    auth_context: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(AuthError) as info:
        auth.identify(metadata, auth_context)
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert info.value.message == message


def test_only_the_first_authorization_header_counts(auth: Authenticator) -> None:
    metadata = (("authorization", "Bearer nope"), ("authorization", "Bearer agent-secret"))
    with pytest.raises(AuthError) as info:
        auth.identify(metadata, {})
    assert info.value.message == "unknown bearer token"


def test_the_principal_carries_the_clients_policy(auth: Authenticator) -> None:
    agent = auth.identify(bearer("Bearer agent-secret"), {})
    assert agent == Principal(
        "agent-1", frozenset({EXECUTE, REGISTER}), SafetyLevel.CAUTIOUS, RegisterGrant()
    )
    assert not agent.admin
    admin = auth.identify((), cert("CN=ops-admin,O=Acme"))
    assert admin.admin and admin.register == UNRESTRICTED
    assert admin.max_level is SafetyLevel.SAFE  # admin does not raise the execute level


@pytest.mark.parametrize(
    ("metadata", "auth_context", "method", "allowed"),
    [
        (bearer("Bearer agent-secret"), {}, "ExecuteTool", True),
        (bearer("Bearer agent-secret"), {}, "SubmitApproval", False),
        (bearer("Bearer alice-secret"), {}, "SubmitApproval", True),
        (bearer("Bearer alice-secret"), {}, "ExecuteTool", False),
        ((), cert("CN=viewer,O=Acme"), "ListTools", True),
        ((), cert("CN=viewer,O=Acme"), "GetApprovalRequest", False),
        ((), cert("CN=ops-admin,O=Acme"), "RegisterTool", False),
    ],
)
def test_identify_then_authorize(
    auth: Authenticator,
    metadata: tuple[tuple[str, Any], ...],
    auth_context: dict[str, Any],
    method: str,
    allowed: bool,
) -> None:
    caller = auth.identify(metadata, auth_context)
    if allowed:
        authorize(caller, SERVICE + method)
    else:
        with pytest.raises(AuthError) as info:
            authorize(caller, SERVICE + method)
        assert info.value.code is grpc.StatusCode.PERMISSION_DENIED


# ------------------------------------------------------------ development mode


@pytest.mark.parametrize(
    ("metadata", "auth_context"),
    [
        ((), {}),
        (bearer("Bearer whatever"), {}),
        (bearer("Basic garbage"), {}),
        ((), cert("CN=anyone")),
    ],
)
def test_development_mode_lets_every_local_caller_in_as_the_developer(
    metadata: tuple[tuple[str, Any], ...], auth_context: dict[str, Any]
) -> None:
    caller = Authenticator(None).identify(metadata, auth_context)
    assert caller is DEVELOPER
    assert (caller.id, caller.roles, caller.max_level) == ("developer", frozenset(Role), None)
    assert caller.register == UNRESTRICTED and caller.admin
    for method in METHOD_ROLES:
        authorize(caller, method)


# --------------------------------------------------------------- the interceptor


class _Abort(Exception):
    pass


class _Context:
    """Just what the interceptor reads from a servicer context."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...] = (), auth: Any = None) -> None:
        self._metadata = metadata
        self._auth = auth or {}
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return self._auth

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Abort(details)


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # subscriptable for mypy only


def _intercept(auth: Authenticator, method: str, handler: Handler) -> Handler:
    wrapped = AuthInterceptor(auth).intercept_service(
        lambda details: handler,
        _Details(method),  # type: ignore[arg-type]
    )
    assert wrapped is not None and wrapped.unary_unary is not None
    return wrapped


def _serve(handler: Handler, context: _Context) -> Any:
    behaviour = handler.unary_unary
    assert behaviour is not None
    return behaviour(b"", context)  # type: ignore[arg-type]


def _served() -> Handler:
    handler: Handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "served")
    return handler


@pytest.mark.parametrize("method", sorted(OPEN_METHODS))
def test_open_methods_pass_untouched_even_with_a_policy(auth: Authenticator, method: str) -> None:
    handler = _served()
    wrapped = _intercept(auth, method, handler)
    assert wrapped is handler
    assert _serve(wrapped, _Context()) == "served"  # no credential at all


def test_a_method_outside_the_table_is_refused_to_every_client(auth: Authenticator) -> None:
    wrapped = _intercept(auth, SERVICE + "DropTool", _served())
    context = _Context(bearer("Bearer agent-secret"))
    with pytest.raises(_Abort):
        _serve(wrapped, context)
    assert (context.code, context.details) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "method not open to clients",
    )


@pytest.mark.parametrize(
    ("metadata", "code", "details"),
    [
        ((), grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIAL),
        (bearer("Bearer nope"), grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"),
        (
            bearer("Bearer alice-secret"),
            grpc.StatusCode.PERMISSION_DENIED,
            "client 'alice' lacks the execute role for ExecuteTool",
        ),
        (bearer("Bearer agent-secret"), None, ""),
    ],
)
def test_the_interceptor_aborts_before_the_method_runs(
    auth: Authenticator,
    metadata: tuple[tuple[str, Any], ...],
    code: grpc.StatusCode | None,
    details: str,
) -> None:
    ran: list[str] = []

    def behaviour(request: Any, context: Any) -> str:
        ran.append("ran")
        return "served"

    wrapped = _intercept(
        auth, SERVICE + "ExecuteTool", grpc.unary_unary_rpc_method_handler(behaviour)
    )
    context = _Context(metadata)
    if code is None:
        assert _serve(wrapped, context) == "served"
        assert ran == ["ran"]
        return
    with pytest.raises(_Abort):
        _serve(wrapped, context)
    assert (context.code, context.details) == (code, details)
    assert ran == []

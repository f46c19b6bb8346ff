"""The pure decisions behind the trust boundaries: ownership and register
grants, the sandbox budget with warm reservations, the role table, and what
an approver's terminal shows."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from registry_server.api.auth import METHOD_ROLES, OPEN_METHODS, Authenticator, AuthInterceptor
from registry_server.catalog.registry import OPERATOR, RegisterOutcome, Registrant, Registry
from registry_server.client.terminal import escape
from registry_server.domain.errors import AtCapacity, PermissionDenied, Unauthenticated
from registry_server.domain.models import OPERATOR_OWNER, ToolDefinition, parse_definition
from registry_server.execution.admission import Admission, Cancelled
from registry_server.policy.clients import UNRESTRICTED, RegisterGrant
from registry_server.store.memory import MemoryStore


def tool(
    name: str = "t", level: str = "safe", image: str = "toolreg/base", **more: Any
) -> ToolDefinition:
    return parse_definition(
        {
            "name": name,
            "description": "d",
            "parameters": {"type": "object"},
            "safety_level": level,
            "sandbox": {"image": image, "command": ["cat"]},
            **more,
        }
    )


TEAM_A = Registrant("team_a", grant=RegisterGrant())
TEAM_B = Registrant("team_b", grant=RegisterGrant())
ADMIN = Registrant("admin", admin=True, grant=UNRESTRICTED)

# ------------------------------------------------------------------ ownership


def test_a_tool_belongs_to_its_registrant() -> None:
    registry = Registry(MemoryStore())
    registry.register(tool(), by=TEAM_A)
    assert registry.get("t").owner == "team_a"
    # identical again, by anyone: idempotent, and the owner stays
    assert registry.register(tool(), by=TEAM_B) is RegisterOutcome.UNCHANGED
    assert registry.get("t").owner == "team_a"


def test_only_the_owner_or_an_admin_replaces() -> None:
    registry = Registry(MemoryStore())
    registry.register(tool(), by=TEAM_A)
    changed = tool(description="other")
    with pytest.raises(PermissionDenied, match="belongs to 'team_a'"):
        registry.register(changed, replace=True, by=TEAM_B)
    assert registry.register(changed, replace=True, by=TEAM_A) is RegisterOutcome.REPLACED
    again = tool(description="admin's")
    assert registry.register(again, replace=True, by=ADMIN) is RegisterOutcome.REPLACED
    assert registry.get("t").owner == "admin"


def test_operator_tools_need_an_admin() -> None:
    registry = Registry(MemoryStore())
    registry.register(tool("echo"), by=OPERATOR)
    assert registry.get("echo").owner == OPERATOR_OWNER
    with pytest.raises(PermissionDenied, match=r"belongs to '\[operator\]'"):
        registry.register(tool("echo", description="pwned"), replace=True, by=TEAM_A)


@pytest.mark.parametrize(
    ("grant", "definition", "allowed"),
    [
        (RegisterGrant(), tool(level="cautious"), False),  # default: safe only
        (RegisterGrant(), tool(image="alpine:3"), False),  # default: the project's images
        (RegisterGrant(), tool(image="toolreg/python:latest"), True),
        (RegisterGrant(images=("registry.local/*",)), tool(image="registry.local/a/b:1"), True),
        (RegisterGrant(images=("registry.local/*",)), tool(image="toolreg/base"), False),
        (UNRESTRICTED, tool(level="dangerous", image="anything:1"), True),
    ],
)
def test_register_grant(grant: RegisterGrant, definition: ToolDefinition, allowed: bool) -> None:
    registry = Registry(MemoryStore())
    who = Registrant("c", grant=grant)
    if allowed:
        registry.register(definition, by=who)
    else:
        with pytest.raises(PermissionDenied):
            registry.register(definition, by=who)
        assert registry.find("t") is None


def test_the_grant_is_checked_before_the_image() -> None:
    checked: list[str] = []
    registry = Registry(MemoryStore(), image_check=lambda t: checked.append(t.name))
    with pytest.raises(PermissionDenied):
        registry.register(tool(level="dangerous"), by=TEAM_A)
    assert checked == []  # no engine work for a refused client
    registry.register(tool(), by=TEAM_A)
    assert checked == ["t"]


# -------------------------------------------------------------- the sandbox budget


def test_reservations_share_the_budget_with_calls() -> None:
    admission = Admission(max_running=2, max_waiting=0, memory_budget_mb=1000)
    first = admission.reserve(100)
    second = admission.reserve(100)
    assert first is not None and second is not None
    assert admission.reserve(100) is None  # two containers at most, warm or running
    with admission.claim(first):
        assert (admission.running, admission.reserved) == (1, 1)
    assert (admission.running, admission.reserved) == (0, 1)
    admission.release(second)
    admission.release(second)  # twice is harmless
    assert (admission.reserved, admission.memory_mb) == (0, 0)


def test_memory_budget() -> None:
    admission = Admission(max_running=8, max_waiting=0, memory_budget_mb=300)
    with admission.slot(memory_mb=200):
        assert admission.reserve(200) is None
        with pytest.raises(AtCapacity), admission.slot(memory_mb=200):
            pass
    with (
        pytest.raises(AtCapacity, match="larger than this server's whole"),
        admission.slot(memory_mb=301),
    ):
        pass


def test_a_waiting_call_gets_room_from_a_warm_container() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    held = admission.reserve(10)
    assert held is not None
    reclaimed: list[bool] = []

    def reclaim() -> bool:
        if admission.reserved == 0:
            return False
        admission.release(held)
        reclaimed.append(True)
        return True

    admission.on_pressure(reclaim)
    with admission.slot(memory_mb=10):
        assert admission.running == 1 and reclaimed == [True]


def test_no_reservation_while_calls_wait() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    entered = threading.Event()
    cancel = threading.Event()

    def waiter() -> None:
        entered.set()
        with pytest.raises(Cancelled), admission.slot(cancel):
            pass

    with admission.slot():
        thread = threading.Thread(target=waiter)
        thread.start()
        entered.wait(5)
        deadline = time.monotonic() + 5
        while admission.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert admission.waiting == 1 and admission.reserve(0) is None
        cancel.set()
        thread.join(5)
    assert admission.waiting == 0 and admission.running == 0


# ----------------------------------------------------------------- the role table


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class _Abort(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        raise _Abort(message)


def test_a_method_missing_from_the_role_table_is_refused() -> None:
    interceptor = AuthInterceptor(Authenticator(None))  # even in development mode
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "secret")
    wrapped = interceptor.intercept_service(lambda d: handler, _Details("/x.Y/Leak"))  # type: ignore[arg-type]
    assert wrapped is not None and wrapped.unary_unary is not None
    context = _Context()
    with pytest.raises(_Abort):
        wrapped.unary_unary(b"", context)  # type: ignore[arg-type]
    assert context.code is grpc.StatusCode.PERMISSION_DENIED
    assert "/grpc.health.v1.Health/Check" in OPEN_METHODS
    assert not OPEN_METHODS & set(METHOD_ROLES)


def test_no_caller_outside_an_rpc() -> None:
    from registry_server.api.auth import current_principal

    with pytest.raises(Unauthenticated):
        current_principal()


# ------------------------------------------------------------------ the terminal


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain ascii", "plain ascii"),
        ("héllo wörld", "héllo wörld"),
        ("a\u202eexe.txt", "a\\u202eexe.txt"),  # right-to-left override
        ("\x1b[2Jclear", "\\u001b[2Jclear"),  # terminal escape sequence
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("bell\x07", "bell\\u0007"),
        ("c1\x9b", "c1\\u009b"),  # an 8-bit CSI
        ("line\u2028sep", "line\\u2028sep"),
    ],
)
def test_escape(text: str, shown: str) -> None:
    assert escape(text) == shown


def test_escape_keeps_newlines_when_asked() -> None:
    assert escape("a\nb") == "a\\u000ab"
    assert escape("a\nb\r", keep_newlines=True) == "a\nb\\u000d"


def test_a_ceiling_larger_than_the_memory_budget_stops_the_server(tmp_path: Any) -> None:
    from registry_server.api.app import _ceilings
    from registry_server.api.config import ServerConfig
    from registry_server.domain.errors import ConfigError
    from registry_server.policy.model import development_policy

    policy = development_policy(audience="x", approvers={})
    with pytest.raises(ConfigError, match="TOOLREG_SANDBOX_MEMORY_MB=200"):
        _ceilings(ServerConfig(data_dir=tmp_path, sandbox_memory_mb=200), policy)
    assert _ceilings(ServerConfig(data_dir=tmp_path), policy)

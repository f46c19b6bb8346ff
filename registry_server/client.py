"""A small typed client over the generated stub, used by the CLI and tests."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from registry_server import convert
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.config import DEFAULT_HOST, DEFAULT_PORT
from registry_server.models import SafetyLevel, ToolDefinition
from registry_server.schemas import SchemaFormat

ADDRESS_ENV = "TOOLREG_ADDRESS"
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_TIMEOUT_S = 30.0  # seconds for registry calls; executions get their own

_LEVEL_PB = {
    None: pb.SAFETY_LEVEL_UNSPECIFIED,
    SafetyLevel.SAFE: pb.SAFETY_LEVEL_SAFE,
    SafetyLevel.CAUTIOUS: pb.SAFETY_LEVEL_CAUTIOUS,
    SafetyLevel.DANGEROUS: pb.SAFETY_LEVEL_DANGEROUS,
}
_FORMAT_PB = {
    SchemaFormat.OPENAI: pb.SCHEMA_FORMAT_OPENAI,
    SchemaFormat.ANTHROPIC: pb.SCHEMA_FORMAT_ANTHROPIC,
    SchemaFormat.MCP: pb.SCHEMA_FORMAT_MCP,
}


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def describe_rpc_error(err: grpc.RpcError) -> str:
    """One readable line (plus field violations) for an RPC error."""
    code = err.code() if isinstance(err, grpc.Call) else None
    message = err.details() if isinstance(err, grpc.Call) else str(err)
    name = code.name if code is not None else "ERROR"
    lines = [f"{name}: {message}"]
    status = rpc_status.from_call(err) if isinstance(err, grpc.Call) else None
    details: list[Any] = list(status.details) if status else []
    for detail in details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            lines += [f"  - {v.field}: {v.description}" for v in bad.field_violations]
    return "\n".join(lines)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def open_channel(
    address: str,
    *,
    token: str | None = None,
    tls_ca: bytes | None = None,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    tls: bool = False,
) -> grpc.Channel:
    """A channel to the server: TLS when any TLS option is given (the CA
    defaults to the system's), mTLS with a client certificate and key."""
    if tls or tls_ca or tls_cert:
        creds = grpc.ssl_channel_credentials(tls_ca, tls_key, tls_cert)
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


class RegistryClient:
    def __init__(
        self,
        address: str | None = None,
        *,
        channel: grpc.Channel | None = None,
        token: str | None = None,
    ) -> None:
        self.address = address or default_address()
        self._channel = channel or open_channel(self.address, token=token)
        self.stub = pb_grpc.ToolRegistryStub(self._channel)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def register(self, tool: ToolDefinition, *, replace: bool = False) -> pb.Tool:
        request = pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=replace)
        result: pb.Tool = self.stub.RegisterTool(request, timeout=DEFAULT_TIMEOUT_S)
        return result

    def get(self, name: str) -> pb.Tool:
        result: pb.Tool = self.stub.GetTool(pb.GetToolRequest(name=name), timeout=DEFAULT_TIMEOUT_S)
        return result

    def list_tools(
        self, max_level: SafetyLevel | None = None, categories: Iterable[str] = ()
    ) -> list[pb.Tool]:
        request = pb.ListToolsRequest(
            max_safety_level=_LEVEL_PB[max_level], categories=list(categories)
        )
        return list(self.stub.ListTools(request, timeout=DEFAULT_TIMEOUT_S).tools)

    def schemas(
        self,
        fmt: SchemaFormat,
        max_level: SafetyLevel | None = None,
        categories: Iterable[str] = (),
    ) -> str:
        request = pb.GetToolSchemasRequest(
            format=_FORMAT_PB[fmt],
            max_safety_level=_LEVEL_PB[max_level],
            categories=list(categories),
        )
        result: str = self.stub.GetToolSchemas(request, timeout=DEFAULT_TIMEOUT_S).schemas_json
        return result

    def execute(
        self,
        name: str,
        arguments: str = "{}",
        *,
        tokens: Iterable[str] = (),
        request_id: str = "",
        timeout: float | None = None,
    ) -> pb.ToolResult:
        request = pb.ExecuteToolRequest(
            name=name,
            arguments_json=arguments,
            approval_tokens=list(tokens),
            approval_request_id=request_id,
        )
        result: pb.ToolResult = self.stub.ExecuteTool(request, timeout=timeout)
        return result

    def approval_request(self, request_id: str) -> pb.ApprovalRequest:
        result: pb.ApprovalRequest = self.stub.GetApprovalRequest(
            pb.GetApprovalRequestRequest(id=request_id), timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def approval_requests(self, state: str = "", limit: int = 0) -> list[pb.ApprovalRequest]:
        request = pb.ListApprovalRequestsRequest(state=state, limit=limit)
        return list(self.stub.ListApprovalRequests(request, timeout=DEFAULT_TIMEOUT_S).requests)

    def submit_approval(self, request_id: str, token: str) -> pb.ApprovalRequest:
        result: pb.ApprovalRequest = self.stub.SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request_id, token=token), timeout=DEFAULT_TIMEOUT_S
        )
        return result

    def stream(
        self,
        name: str,
        arguments: str = "{}",
        *,
        tokens: Iterable[str] = (),
        request_id: str = "",
        timeout: float | None = None,
    ) -> Iterator[pb.ExecutionEvent]:
        request = pb.ExecuteToolRequest(
            name=name, arguments_json=arguments, approval_tokens=list(tokens),
            approval_request_id=request_id,
        )  # fmt: skip
        yield from self.stub.StreamExecuteTool(request, timeout=timeout)


def tool_from_message(msg: pb.Tool) -> ToolDefinition:
    """The domain form of a Tool the server sent (re-validated)."""
    return convert.tool_from_pb(msg)


__all__ = ["RegistryClient", "default_address", "describe_rpc_error", "tool_from_message"]

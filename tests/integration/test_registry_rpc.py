"""The registry half of the service over real gRPC on loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.wire import convert
from tests.factories import tool
from tests.integration.conftest import Running, StartServer


def tool_pb(**overrides: object) -> pb.Tool:
    return convert.tool_to_pb(tool(**overrides))


def rpc_error(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def field_violations(err: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "INVALID_ARGUMENT must carry google.rpc details"
    out: dict[str, str] = {}
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        out.update({v.field: v.description for v in bad.field_violations})
    return out


def test_register_get_roundtrip_sets_digest(server: Running) -> None:
    stored = server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb()))
    assert stored.digest == tool().digest
    got = server.stub.GetTool(pb.GetToolRequest(name="echo"))
    assert got == stored
    assert json.loads(got.parameters_json) == tool().parameters


def test_unspecified_level_registers_as_safe(server: Running) -> None:
    msg = tool_pb()
    msg.safety_level = pb.SAFETY_LEVEL_UNSPECIFIED
    assert (
        server.stub.RegisterTool(pb.RegisterToolRequest(tool=msg)).safety_level
        == pb.SAFETY_LEVEL_SAFE
    )


def test_idempotent_and_duplicate_and_replace(server: Running) -> None:
    first = server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb()))
    again = server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb()))
    assert first == again
    err = rpc_error(
        lambda: server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb(description="v2")))
    )
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already exists" in err.details()
    replaced = server.stub.RegisterTool(
        pb.RegisterToolRequest(tool=tool_pb(description="v2"), replace=True)
    )
    assert replaced.description == "v2" and replaced.digest != first.digest


def test_invalid_definition_names_each_field_and_keeps_serving(server: Running) -> None:
    bad = pb.Tool(
        name="Bad Name",
        description="",
        parameters_json='{"type":"object","required":["x"]}',
        sandbox=pb.SandboxSpec(image="", command=[]),
    )
    err = rpc_error(lambda: server.stub.RegisterTool(pb.RegisterToolRequest(tool=bad)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = field_violations(err)
    assert set(found) == {
        "name",
        "description",
        "parameters_json",
        "sandbox.image",
        "sandbox.command",
    }
    assert "snake_case" in found["name"] and "['x']" in found["parameters_json"]
    # Nothing stored, still serving.
    assert server.stub.ListTools(pb.ListToolsRequest()).tools == []
    assert server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb())).name == "echo"


@pytest.mark.parametrize(
    ("params_json", "rule"),
    [
        ("", "not valid JSON"),
        ("{", "not valid JSON"),
        ('{"type":"object","type":"object"}', "duplicate key"),
        ("[]", "must be a mapping"),
        ('{"type":"object","properties":{"a":{"maximum":NaN}}}', "NaN"),
    ],
)
def test_bad_parameters_json(server: Running, params_json: str, rule: str) -> None:
    msg = tool_pb()
    msg.parameters_json = params_json
    err = rpc_error(lambda: server.stub.RegisterTool(pb.RegisterToolRequest(tool=msg)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rule in field_violations(err)["parameters_json"]


def test_missing_tool_and_unknown_enum_values(server: Running) -> None:
    err = rpc_error(lambda: server.stub.RegisterTool(pb.RegisterToolRequest()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool" in field_violations(err)
    msg = tool_pb()
    msg.safety_level = 42  # type: ignore[assignment]
    err = rpc_error(lambda: server.stub.RegisterTool(pb.RegisterToolRequest(tool=msg)))
    assert "safety_level" in field_violations(err)
    err = rpc_error(lambda: server.stub.ListTools(pb.ListToolsRequest(max_safety_level=9)))  # type: ignore[arg-type]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(lambda: server.stub.GetToolSchemas(pb.GetToolSchemasRequest(format=7)))  # type: ignore[arg-type]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_missing_and_empty_name(server: Running) -> None:
    err = rpc_error(lambda: server.stub.GetTool(pb.GetToolRequest(name="nope")))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == "Tool 'nope' not found"
    err = rpc_error(lambda: server.stub.GetTool(pb.GetToolRequest(name="")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_list_filters_over_grpc(server: Running) -> None:
    for name, level, cats in [
        ("a_safe", "safe", ["files"]),
        ("b_caut", "cautious", ["files", "code"]),
        ("c_dang", "dangerous", ["files"]),
        ("d_safe", "safe", ["math"]),
    ]:
        server.stub.RegisterTool(
            pb.RegisterToolRequest(tool=tool_pb(name=name, safety_level=level, categories=cats))
        )

    def names(level: int, cats: list[str]) -> list[str]:
        req = pb.ListToolsRequest(max_safety_level=level, categories=cats)  # type: ignore[arg-type]
        return [t.name for t in server.stub.ListTools(req).tools]

    assert names(pb.SAFETY_LEVEL_UNSPECIFIED, []) == ["a_safe", "b_caut", "c_dang", "d_safe"]
    assert names(pb.SAFETY_LEVEL_CAUTIOUS, ["files"]) == ["a_safe", "b_caut"]
    assert names(pb.SAFETY_LEVEL_SAFE, ["code"]) == []
    assert names(pb.SAFETY_LEVEL_DANGEROUS, ["math", "code"]) == ["b_caut", "d_safe"]


@pytest.mark.parametrize(
    ("fmt", "key"),
    [
        (pb.SCHEMA_FORMAT_UNSPECIFIED, "function"),
        (pb.SCHEMA_FORMAT_OPENAI, "function"),
        (pb.SCHEMA_FORMAT_ANTHROPIC, "input_schema"),
        (pb.SCHEMA_FORMAT_MCP, "inputSchema"),
    ],
)
def test_schemas_each_format(server: Running, fmt: int, key: str) -> None:
    req = pb.GetToolSchemasRequest(format=fmt)  # type: ignore[arg-type]
    assert server.stub.GetToolSchemas(req).schemas_json == "[]"
    server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb()))
    server.stub.RegisterTool(
        pb.RegisterToolRequest(tool=tool_pb(name="risky", safety_level="dangerous"))
    )
    (only,) = json.loads(
        server.stub.GetToolSchemas(
            pb.GetToolSchemasRequest(format=fmt, max_safety_level=pb.SAFETY_LEVEL_SAFE)  # type: ignore[arg-type]
        ).schemas_json
    )
    assert key in only
    body = only.get("function", only)
    assert body["name"] == "echo"


def test_execute_unknown_tool_is_a_result_not_an_error(server: Running) -> None:
    result = server.stub.ExecuteTool(pb.ExecuteToolRequest(name="ghost", arguments_json="{}"))
    assert not result.success
    assert result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    assert result.error == "Tool 'ghost' not found"
    (event,) = list(server.stub.StreamExecuteTool(pb.ExecuteToolRequest(name="ghost")))
    assert event.result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND


def test_tools_survive_a_restart(start_server: StartServer, tmp_path: Path) -> None:
    data = tmp_path / "persist"
    first = start_server(data_dir=data)
    stored = first.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb(categories=["a", "b"])))
    first.stop()
    second = start_server(data_dir=data)
    assert second.stub.GetTool(pb.GetToolRequest(name="echo")) == stored


def test_concurrent_registration_from_many_threads(server: Running) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(10):
                n = (i * 10 + j) % 60
                server.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb(name=f"tool_{n}")))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tools = server.stub.ListTools(pb.ListToolsRequest()).tools
    assert sorted(t.name for t in tools) == sorted(f"tool_{n}" for n in range(60))


def test_failed_store_write_changes_nothing(start_server: StartServer, tmp_path: Path) -> None:
    from registry_server.store.sqlite import SqliteStore
    from tests import store_file

    data = tmp_path / "locked"
    r = start_server(data_dir=data)
    r.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb()))
    # Swap in a store with a short busy timeout, then hold the write lock from
    # another connection: the registration must fail cleanly and store nothing.
    r.app.registry._store = SqliteStore(data / "toolreg.db", busy_timeout_ms=200)
    blocker = store_file.connect(data)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        err = rpc_error(
            lambda: r.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb(name="other")))
        )
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "locked" in err.details()
        assert [t.name for t in r.stub.ListTools(pb.ListToolsRequest()).tools] == ["echo"]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert r.stub.RegisterTool(pb.RegisterToolRequest(tool=tool_pb(name="other"))).name == "other"


def test_start_up_loads_manifest_directory(start_server: StartServer) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples" / "tools"
    r = start_server(tools_dir=examples)
    names = [t.name for t in r.stub.ListTools(pb.ListToolsRequest()).tools]
    assert {"echo", "word_count", "run_python", "write_file"} <= set(names)

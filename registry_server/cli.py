"""The ``toolreg`` command: the server, and client verbs that talk to it over gRPC.

User mistakes (bad manifest, unknown tool, server not running) print one
clear line and exit non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import grpc
import typer

from registry_server import client as client_mod
from registry_server.client import RegistryClient, describe_rpc_error
from registry_server.errors import ToolregError
from registry_server.models import SafetyLevel
from registry_server.schemas import SchemaFormat, tool_belt

app = typer.Typer(
    name="toolreg",
    help="A tool registry for LLM agents that runs every call in a fresh sandbox.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tools_app = typer.Typer(help="Register, list and export tools.", no_args_is_help=True)
app.add_typer(tools_app, name="tools")

AddressOpt = Annotated[
    str | None,
    typer.Option("--address", envvar=client_mod.ADDRESS_ENV, help="Server HOST:PORT."),
]
LevelOpt = Annotated[
    str | None,
    typer.Option("--max-level", help="Only tools at or below: safe, cautious, dangerous."),
]
CategoryOpt = Annotated[
    list[str] | None, typer.Option("--category", help="Only tools in any of these (repeatable).")
]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"toolreg: {message}", err=True)
    raise typer.Exit(code)


def _level(text: str | None) -> SafetyLevel | None:
    if text is None:
        return None
    try:
        return SafetyLevel.parse(text)
    except ValueError as exc:
        fail(f"--max-level: {exc}", 2)


def _client(address: str | None) -> RegistryClient:
    return RegistryClient(address)


def _rpc_failed(err: grpc.RpcError, address: str) -> NoReturn:
    if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE:
        fail(
            f"cannot reach the toolreg server at {address} ({err.details()});"
            " is `toolreg serve` running?"
        )
    fail(describe_rpc_error(err))


# ------------------------------------------------------------------ server


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port (0 = any free port).")] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Where the store lives.")
    ] = None,
    tools: Annotated[
        Path | None,
        typer.Option("--tools", help="Register the manifests of this directory at start."),
    ] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Policy file (YAML).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
) -> None:
    """Run the gRPC server in the foreground until SIGTERM/SIGINT."""
    from pydantic import ValidationError

    from registry_server.config import ServerConfig
    from registry_server.server import serve as run_server

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "data_dir": data_dir,
            "tools_dir": tools,
            "policy_file": policy,
        }.items()
        if v is not None
    }
    try:
        config = ServerConfig(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        fail(f"invalid configuration: {problems}", 2)
    try:
        run_server(config)
    except ToolregError as exc:
        fail(exc.message)
    except OSError as exc:
        fail(str(exc))


# ------------------------------------------------------------------- tools


@tools_app.command("register")
def tools_register(
    path: Annotated[Path, typer.Argument(help="A manifest file or a directory of them.")],
    replace: Annotated[
        bool, typer.Option("--replace", help="Overwrite different definitions.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Register tools from YAML manifests."""
    from registry_server.manifests import load_manifests

    if not path.exists():
        fail(f"{path}: no such file or directory", 2)
    try:
        tools = load_manifests(path)
    except ToolregError as exc:
        fail(exc.message, 2)
    if not tools:
        fail(f"{path}: no manifests (*.yaml, *.yml) found", 2)
    with _client(address) as client:
        for tool in tools:
            try:
                stored = client.register(tool, replace=replace)
            except grpc.RpcError as err:
                _rpc_failed(err, client.address)
            typer.echo(f"registered {stored.name} ({stored.digest[:12]})")


@tools_app.command("list")
def tools_list(
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    address: AddressOpt = None,
) -> None:
    """List registered tools."""
    level = _level(max_level)
    with _client(address) as client:
        try:
            tools = [client_mod.tool_from_message(t) for t in client.list(level, category or ())]
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    if as_json:
        typer.echo(json.dumps([t.as_manifest() | {"digest": t.digest} for t in tools], indent=2))
        return
    if not tools:
        typer.echo("no tools")
        return
    width = max(len(t.name) for t in tools)
    for t in tools:
        cats = ",".join(t.categories) or "-"
        summary = t.description.splitlines()[0]
        typer.echo(f"{t.name:<{width}}  {t.safety_level.value:<9}  {cats:<20}  {summary}")


@tools_app.command("get")
def tools_get(name: str, address: AddressOpt = None) -> None:
    """Show one tool's definition (JSON)."""
    with _client(address) as client:
        try:
            tool = client_mod.tool_from_message(client.get(name))
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(
        json.dumps(tool.as_manifest() | {"digest": tool.digest}, indent=2, ensure_ascii=False)
    )


@tools_app.command("schemas")
def tools_schemas(
    fmt: Annotated[
        str,
        typer.Option(
            "--format", help="openai, anthropic, mcp, or text (a tool belt for a prompt)."
        ),
    ] = "openai",
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    address: AddressOpt = None,
) -> None:
    """Export tool schemas for an LLM API."""
    level = _level(max_level)
    with _client(address) as client:
        try:
            if fmt.strip().lower() == "text":
                tools = [
                    client_mod.tool_from_message(t) for t in client.list(level, category or ())
                ]
                typer.echo(tool_belt(tools), nl=False)
                return
            try:
                schema_format = SchemaFormat.parse(fmt)
            except ValueError as exc:
                fail(f"--format: {exc}", 2)
            text = client.schemas(schema_format, level, category or ())
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    typer.echo(json.dumps(json.loads(text), indent=2, ensure_ascii=False))


# --------------------------------------------------------------- execution


@app.command("exec")
def exec_tool(
    name: Annotated[str, typer.Argument(help="The tool to run.")],
    args: Annotated[str, typer.Option("--args", help="Arguments as a JSON object.")] = "{}",
    stream: Annotated[bool, typer.Option("--stream", help="Print output as it arrives.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole ToolResult as JSON.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Run a tool once and print its result. Exit status 0 only on success."""
    from google.protobuf import json_format

    with _client(address) as client:
        try:
            if stream:
                result = None
                for event in client.stream(name, args):
                    kind = event.WhichOneof("event")
                    if kind == "stdout":
                        sys.stdout.buffer.write(event.stdout)
                        sys.stdout.flush()
                    elif kind == "stderr":
                        sys.stderr.buffer.write(event.stderr)
                        sys.stderr.flush()
                    else:
                        result = event.result
                if result is None:
                    fail("the server ended the stream without a result")
            else:
                result = client.execute(name, args)
        except grpc.RpcError as err:
            _rpc_failed(err, client.address)
    if as_json:
        typer.echo(json_format.MessageToJson(result, preserving_proto_field_name=True))
    elif not stream and result.content:
        typer.echo(result.content, nl=not result.content.endswith("\n"))
    if not result.success:
        status = pb_status_name(result.status)
        fail(f"{status}: {result.error}" if result.error else status)


def pb_status_name(value: int) -> str:
    from registry_server._proto.toolregistry.v1 import registry_pb2 as pb

    return pb.ExecutionStatus.Name(value).removeprefix("EXECUTION_STATUS_")  # type: ignore[arg-type]


@app.command()
def reap(
    docker_url: Annotated[
        str | None,
        typer.Option("--docker-url", envvar="TOOLREG_DOCKER_URL", help="Engine address."),
    ] = None,
) -> None:
    """Remove sandbox containers left behind by toolreg servers that are gone.
    Containers of running servers are never touched."""
    import uuid

    from sandbox_runner import SandboxError
    from sandbox_runner.docker_backend import DockerRunner

    runner = DockerRunner(instance_id=f"reaper-{uuid.uuid4().hex[:12]}", base_url=docker_url)
    try:
        removed = runner.reap()
    except SandboxError as exc:
        fail(str(exc))
    finally:
        runner.close()
    typer.echo(f"removed {removed} leftover container{'s' if removed != 1 else ''}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

"""`toolreg tools`: register, list, show, export, delete and switch tools."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer

from registry_server.cli.common import (
    AddressOpt,
    CategoryOpt,
    LevelOpt,
    PageSizeOpt,
    connect,
    fail,
    parse_level,
    rpc_failed,
)
from registry_server.client import registry_client as client_mod
from registry_server.client.registry_client import RegistryClient
from registry_server.client.terminal import escape
from registry_server.domain.errors import ToolregError
from registry_server.domain.models import ToolDefinition
from registry_server.domain.schemas import SchemaFormat, tool_belt

tools_app = typer.Typer(help="Register, list and export tools.", no_args_is_help=True)


@tools_app.command("register")
def tools_register(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="A manifest file or a directory of them.")],
    replace: Annotated[
        bool, typer.Option("--replace", help="Overwrite different definitions.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Register tools from YAML manifests."""
    from registry_server.domain.manifests import load_manifests

    if not path.exists():
        fail(f"{path}: no such file or directory", 2)
    try:
        tools = load_manifests(path)
    except ToolregError as exc:
        fail(exc.message, 2)
    if not tools:
        fail(f"{path}: no manifests (*.yaml, *.yml) found", 2)
    with connect(ctx, address) as client:
        for tool in tools:
            try:
                stored = client.register(tool, replace=replace)
            except grpc.RpcError as err:
                rpc_failed(err, client.address)
            typer.echo(f"registered {stored.name} ({stored.digest[:12]})")


@tools_app.command("list")
def tools_list(
    ctx: typer.Context,
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """List registered tools (all of them, a page at a time)."""
    level = parse_level(max_level)
    with connect(ctx, address) as client:
        try:
            tools = [
                client_mod.tool_from_message(t)
                for t in client.list_tools(level, category or (), page_size)
            ]
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    if as_json:
        typer.echo(json.dumps([_shown_tool(t) for t in tools], indent=2))
        return
    if not tools:
        typer.echo("no tools")
        return
    width = max(len(t.name) for t in tools)
    for t in tools:
        cats = ",".join(t.categories) or "-"
        summary = t.description.splitlines()[0]
        line = f"{t.name:<{width}}  {t.safety_level.value:<9}  {cats:<20}  {t.owner:<12}  {summary}"
        if t.disabled:
            line += f"  [DISABLED: {t.disabled_reason}]"
        typer.echo(escape(line))


@tools_app.command("get")
def tools_get(ctx: typer.Context, name: str, address: AddressOpt = None) -> None:
    """Show one tool's definition (JSON)."""
    with connect(ctx, address) as client:
        try:
            tool = client_mod.tool_from_message(client.get(name))
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    shown = _shown_tool(tool)
    typer.echo(escape(json.dumps(shown, indent=2, ensure_ascii=False), keep_newlines=True))


def _shown_tool(tool: ToolDefinition) -> dict[str, Any]:
    """A tool as `tools get` and `tools list --json` print it: the manifest,
    its digest and owner, and the kill switch when it is set."""
    shown = tool.as_manifest() | {"digest": tool.digest, "owner": tool.owner}
    if tool.disabled:
        shown |= {"disabled": True, "disabled_reason": tool.disabled_reason}
    return shown


ReasonOpt = Annotated[
    str,
    typer.Option("--reason", help="Why: for the audit log and the voided approval requests."),
]


@tools_app.command("delete")
def tools_delete(
    ctx: typer.Context, name: str, reason: ReasonOpt = "", address: AddressOpt = None
) -> None:
    """Delete a tool (its owner or an admin). Its open approval requests are
    voided; a call already running finishes; the name may be registered again."""

    def delete(client: RegistryClient) -> str:
        client.delete_tool(name, reason)
        return f"deleted {name}"

    _switch(ctx, address, delete)


@tools_app.command("disable")
def tools_disable(
    ctx: typer.Context,
    name: str,
    reason: Annotated[
        str,
        typer.Option(
            "--reason", help="Why: every refused call and voided request says it (required)."
        ),
    ],
    address: AddressOpt = None,
) -> None:
    """The kill switch (admins): every call of the tool is refused with
    TOOL_DISABLED, on every server within a second; it stays listed, its warm
    containers go and its open approval requests are voided."""

    def disable(client: RegistryClient) -> str:
        tool = client.set_tool_enabled(name, False, reason)
        return f"disabled {tool.name}: {tool.disabled_reason}"

    _switch(ctx, address, disable)


@tools_app.command("enable")
def tools_enable(
    ctx: typer.Context, name: str, reason: ReasonOpt = "", address: AddressOpt = None
) -> None:
    """Make a disabled tool callable again (admins); approvals must be asked for again."""

    def enable(client: RegistryClient) -> str:
        return f"enabled {client.set_tool_enabled(name, True, reason).name}"

    _switch(ctx, address, enable)


def _switch(ctx: typer.Context, address: str | None, act: Callable[[RegistryClient], str]) -> None:
    """One kill-switch call; prints the line ``act`` returns."""
    with connect(ctx, address) as client:
        try:
            done = act(client)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(escape(done))


@tools_app.command("schemas")
def tools_schemas(
    ctx: typer.Context,
    fmt: Annotated[
        str,
        typer.Option(
            "--format", help="openai, anthropic, mcp, or text (a tool belt for a prompt)."
        ),
    ] = "openai",
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """Export tool schemas for an LLM API (all of them, a page at a time)."""
    level = parse_level(max_level)
    with connect(ctx, address) as client:
        try:
            if fmt.strip().lower() == "text":
                tools = [
                    client_mod.tool_from_message(t)
                    for t in client.list_tools(level, category or (), page_size)
                ]
                # as GetToolSchemas: a disabled tool is not offered to the model
                typer.echo(tool_belt([t for t in tools if not t.disabled]), nl=False)
                return
            try:
                schema_format = SchemaFormat.parse(fmt)
            except ValueError as exc:
                fail(f"--format: {exc}", 2)
            text = client.schemas(schema_format, level, category or (), page_size)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(json.dumps(json.loads(text), indent=2, ensure_ascii=False))

"""`toolreg exec`: run a tool once."""

from __future__ import annotations

import sys
from typing import Annotated

import grpc
import typer

from registry_server.cli.common import AddressOpt, connect, fail, rpc_failed
from registry_server.wire import convert


def exec_tool(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The tool to run.")],
    args: Annotated[str, typer.Option("--args", help="Arguments as a JSON object.")] = "{}",
    stream: Annotated[bool, typer.Option("--stream", help="Print output as it arrives.")] = False,
    reattach: Annotated[
        bool,
        typer.Option(
            "--reattach",
            help="With --stream: a dropped connection re-attaches and the call runs on"
            " meanwhile; Ctrl-C then stops reading, not the tool (it ends at its timeout)."
            " Without it Ctrl-C stops the tool.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole ToolResult as JSON.")
    ] = False,
    approval_request: Annotated[
        str, typer.Option("--approval-request", help="Run with the approvals of this request.")
    ] = "",
    token: Annotated[
        list[str] | None,
        typer.Option("--approval-token", help="A signed approval token (repeatable)."),
    ] = None,
    address: AddressOpt = None,
) -> None:
    """Run a tool once and print its result. Exit status 0 only on success."""
    from google.protobuf import json_format

    with connect(ctx, address) as client:
        try:
            if stream:
                result = None
                # At a terminal Ctrl-C means "stop the tool", and the server cannot
                # tell it from a dropped connection: re-attachment is asked for.
                for event in client.stream(
                    name, args, tokens=token or (), request_id=approval_request,
                    reattach=reattach,
                ):  # fmt: skip
                    kind = event.WhichOneof("event")
                    if kind == "stdout":
                        sys.stdout.buffer.write(event.stdout)
                        sys.stdout.flush()
                    elif kind == "stderr":
                        sys.stderr.buffer.write(event.stderr)
                        sys.stderr.flush()
                    elif kind == "result":
                        result = event.result
                if result is None:
                    fail("the server ended the stream without a result")
            else:
                result = client.execute(name, args, tokens=token or (), request_id=approval_request)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    if as_json:
        typer.echo(json_format.MessageToJson(result, preserving_proto_field_name=True))
    elif not stream and result.content:
        typer.echo(result.content, nl=not result.content.endswith("\n"))
    if result.HasField("approval_request") and result.approval_request.id:
        req = result.approval_request
        typer.echo(
            f"approval request {req.id}: {len(req.approved_by)} of {req.approvals_required}"
            " approvals;"
            f" approvers run `toolreg approvals approve {req.id} --key KEY`, then run this again"
            f" with --approval-request {req.id}",
            err=True,
        )
    if not result.success:
        status = convert.status_name(result.status)
        fail(f"{status}: {result.error}" if result.error else status)

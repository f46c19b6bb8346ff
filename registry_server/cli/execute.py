"""`toolreg exec`: run a tool once."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated

import grpc
import typer

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.common import AddressOpt, connect, fail, rpc_failed
from registry_server.client.registry_client import RegistryClient, describe_rpc_error
from registry_server.wire import convert

CANCEL_REASON = "Ctrl-C at the terminal (toolreg exec --stream)"
CANCEL_TIMEOUT_S = 10.0  # seconds the CLI waits for CancelExecution's answer
INTERRUPTED = 130  # exit status after Ctrl-C, as a shell's


def print_stream(
    client: RegistryClient, events: Iterator[pb.ExecutionEvent], *, cancel_on_interrupt: bool
) -> pb.ToolResult | None:
    """Print a stream's output as it comes; its result (None: none came).

    Ctrl-C: a call streamed with re-attachment outlives its stream, so it is
    cancelled (CancelExecution) once it has an execution id; without one, or
    without re-attachment, ending the stream stops it (the server cancels a
    call whose stream ends before it started or was not re-attachable)."""
    execution_id = ""
    result = None
    try:
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "started":
                execution_id = event.started.execution_id
            elif kind == "stdout":
                sys.stdout.buffer.write(event.stdout)
                sys.stdout.flush()
            elif kind == "stderr":
                sys.stderr.buffer.write(event.stderr)
                sys.stderr.flush()
            elif kind == "result":
                result = event.result
    except KeyboardInterrupt:
        if cancel_on_interrupt and execution_id:
            _cancel(client, execution_id)
        else:
            typer.echo("interrupted: the call is stopped with its stream", err=True)
        close = getattr(events, "close", None)
        if close is not None:
            close()
        raise typer.Exit(INTERRUPTED) from None
    return result


def _cancel(client: RegistryClient, execution_id: str) -> None:
    try:
        client.cancel(execution_id, CANCEL_REASON, timeout=CANCEL_TIMEOUT_S)
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.Call) else None
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            typer.echo(f"interrupted: call {execution_id} had already ended", err=True)
        else:
            typer.echo(
                f"interrupted: could not cancel call {execution_id} ({describe_rpc_error(err)});"
                " it runs on to its timeout",
                err=True,
            )
        return
    typer.echo(f"interrupted: call {execution_id} cancelled", err=True)


def exec_tool(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The tool to run.")],
    args: Annotated[str, typer.Option("--args", help="Arguments as a JSON object.")] = "{}",
    stream: Annotated[bool, typer.Option("--stream", help="Print output as it arrives.")] = False,
    reattach: Annotated[
        bool,
        typer.Option(
            "--reattach/--no-reattach",
            help="With --stream: a dropped connection re-attaches and the call runs on"
            " meanwhile, and Ctrl-C cancels the call (CancelExecution). --no-reattach:"
            " a dropped connection ends the call, as Ctrl-C does.",
        ),
    ] = True,
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
                events = client.stream(
                    name, args, tokens=token or (), request_id=approval_request,
                    reattach=reattach,
                )  # fmt: skip
                result = print_stream(client, events, cancel_on_interrupt=reattach)
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

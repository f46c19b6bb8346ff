"""`toolreg approvals`: see, sign, reject and watch approval requests."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer

from registry_server.cli.common import AddressOpt, PageSizeOpt, connect, fail, rpc_failed
from registry_server.cli.keys import read_signing_key
from registry_server.client import approval_view
from registry_server.client.terminal import escape

approvals_app = typer.Typer(help="See and sign approval requests.", no_args_is_help=True)


def request_lines(req: Any) -> list[str]:
    """What an approver reads before signing: every client-supplied text escaped."""
    fields = [f"{label:<9} {value}" for label, value in approval_view.request_fields(req)]
    needs = [f"{'needs':<9} {line}" for line in rule_lines(req)]
    heading = escape(f"arguments (digest {req.arguments_digest}):")
    return [*fields, *needs, heading, approval_view.shown_arguments(req)]


def rule_lines(req: Any) -> list[str]:
    """Each approval rule that applies to the request's call, one line each.
    None from a server that does not say (an older one, or a request whose
    tool is gone)."""
    return [approval_view.rule_line(rule) for rule in req.applied_rules]


@approvals_app.command("list")
def approvals_list(
    ctx: typer.Context,
    state: Annotated[
        str,
        typer.Option("--state", help="PENDING, APPROVED, CONSUMED, REJECTED, VOIDED or EXPIRED."),
    ] = "",
    page_size: PageSizeOpt = 0,
    address: AddressOpt = None,
) -> None:
    """List approval requests, newest first (all you may see, a page at a time)."""
    with connect(ctx, address) as client:
        try:
            found = client.approval_requests(state, page_size=page_size)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    if not found:
        typer.echo("no approval requests")
    for req in found:
        have = f"{len(req.approved_by)}/{req.approvals_required}"
        image = f"  image {req.tool.sandbox.image}" if req.HasField("tool") else ""
        line = f"{req.id}  {req.state:<9} {have:>5}  {req.tool_name}  by {req.requested_by}{image}"
        typer.echo(escape(line))


@approvals_app.command("show")
def approvals_show(ctx: typer.Context, request_id: str, address: AddressOpt = None) -> None:
    """Show one request with its arguments in full."""
    with connect(ctx, address) as client:
        try:
            req = client.approval_request(request_id)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo("\n".join(request_lines(req)))


@approvals_app.command("approve")
def approvals_approve(
    ctx: typer.Context,
    request_id: str,
    key: Annotated[
        Path,
        typer.Option(
            "--key",
            help="Your Ed25519 private key (PEM). An encrypted one takes its passphrase from"
            " TOOLREG_KEY_PASSPHRASE, else asks on the terminal.",
        ),
    ],
    approver: Annotated[
        str | None, typer.Option("--as", help="Your approver id (default: the key file's name).")
    ] = None,
    ttl: Annotated[
        int | None,
        typer.Option("--ttl", help="Token lifetime, seconds (default: the policy maximum)."),
    ] = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the token instead of submitting it.")
    ] = False,
    address: AddressOpt = None,
) -> None:
    """Sign exactly this request (tool digest + arguments digest) with your key.
    The key never leaves this process."""
    from registry_server.signing.tokens import mint_for

    private_key = read_signing_key(key)
    issuer = approver or key.name.split(".")[0]
    with connect(ctx, address) as client:
        try:
            req = client.approval_request(request_id)
            if req.state in ("CONSUMED", "REJECTED", "EXPIRED"):
                fail(f"request {request_id} is {req.state.lower()}; nothing to approve")
            if req.HasField("tool") and not approval_view.definition_matches(req):
                fail(f"request {request_id}: the definition shown does not match tool_digest;"
                     " refusing to sign")  # fmt: skip
            token = mint_for(
                private_key, issuer=issuer, request=req, ttl_s=ttl, bind_request=True,
            )  # fmt: skip
            if print_only:
                typer.echo(token)
                return
            updated = client.submit_approval(request_id, token)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(
        f"approved {request_id} as {issuer}: {len(updated.approved_by)} of"
        f" {updated.approvals_required} approvals, state {updated.state}"
    )


@approvals_app.command("reject")
def approvals_reject(
    ctx: typer.Context,
    request_id: str,
    reason: Annotated[
        str, typer.Option("--reason", help="Why (the agent is told; the audit keeps it).")
    ],
    address: AddressOpt = None,
) -> None:
    """Refuse a request for good: the agent's call gets APPROVAL_DENIED with your reason."""
    with connect(ctx, address) as client:
        try:
            rejected = client.reject_approval_request(request_id, reason)
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(f"rejected {request_id} as {rejected.rejected_by}")


def _event_line(event: Any) -> str:
    """One line per watch event; every client-supplied text escaped."""
    if event.type == "SYNCED":
        return "-- up to date; watching for changes (Ctrl-C to stop)"
    req = event.request
    at = (event.at or datetime.now(UTC)).strftime("%H:%M:%S")
    have = f"{len(req.approved_by)}/{req.approvals_required}"
    who = f" by {event.actor}" if event.actor else ""
    why = f": {event.reason}" if event.reason else ""
    return escape(
        f"{at} {event.type:<14} {req.id}  {req.state:<9} {have:>5}  {req.tool_name}"
        f"  asked by {req.requested_by}{who}{why}"
    )


@approvals_app.command("watch")
def approvals_watch(
    ctx: typer.Context,
    request_id: Annotated[
        str, typer.Option("--request", help="Only this request (e.g. your own call's).")
    ] = "",
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Stop after this many seconds.")
    ] = None,
    address: AddressOpt = None,
) -> None:
    """Print the open requests you may see, then every change as it happens."""
    with connect(ctx, address) as client:
        try:
            for event in client.watch_approval_requests(request_id, timeout_s=timeout):
                typer.echo(_event_line(event))
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                rpc_failed(err, client.address)
        except KeyboardInterrupt:
            pass

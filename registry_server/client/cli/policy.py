"""`toolreg policy`: check a policy file offline; reload and show the server's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import typer

from registry_server.client.cli.common import AddressOpt, connect, fail, rpc_failed

policy_app = typer.Typer(help="Check, reload and show the policy.", no_args_is_help=True)


def _info_line(info: Any) -> str:
    if not info.policy_digest:
        return "development mode (no policy file)"
    loaded = info.policy_loaded_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
    return f"policy {info.policy_source} digest {info.policy_digest} loaded {loaded} UTC"


@policy_app.command("check")
def policy_check(file: Path) -> None:
    """Validate a policy file offline, as the server would load it (exit 2 when not)."""
    from registry_server.policy.loader import load_policy
    from registry_server.policy.model import PolicyError

    try:
        policy = load_policy(file)
    except PolicyError as exc:
        fail("\n".join(exc.problems), 2)
    typer.echo(
        f"{file}: ok, digest {policy.digest}; {len(policy.clients)} client(s),"
        f" {len(policy.approvers)} approver(s), {len(policy.rules)} rule(s)"
    )


@policy_app.command("reload")
def policy_reload(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Make the server, and every server on its store, re-read its policy
    file (admins). A file that does not load is refused; the old policy stays."""
    with connect(ctx, address) as client:
        try:
            info = client.reload_policy()
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(f"reloaded: {_info_line(info)}")


@policy_app.command("show")
def policy_show(ctx: typer.Context, address: AddressOpt = None) -> None:
    """Which policy the server enforces (compare digests across servers)."""
    with connect(ctx, address) as client:
        try:
            info = client.server_info()
        except grpc.RpcError as err:
            rpc_failed(err, client.address)
    typer.echo(_info_line(info))

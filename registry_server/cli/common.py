"""What every verb module shares: how client verbs reach the server, the common
options, and the one-line failure that ends a command."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import grpc
import typer

from registry_server.client import registry_client as client_mod
from registry_server.client.idp_tokens import StoredLoginTokens, TokenError
from registry_server.client.registry_client import RegistryClient, describe_rpc_error, open_channel
from registry_server.client.token_store import TokenStore
from registry_server.domain.errors import ToolregError
from registry_server.domain.files import read_credential
from registry_server.domain.models import SafetyLevel


@dataclass(frozen=True)
class Connection:
    """How client verbs reach the server (root options, before the verb)."""

    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls: bool = False


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
PageSizeOpt = Annotated[
    int,
    typer.Option(
        "--page-size",
        min=0,
        help="Items asked for per page (0 = the server's default); every page is shown.",
    ),
]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"toolreg: {message}", err=True)
    raise typer.Exit(code)


def parse_level(text: str | None) -> SafetyLevel | None:
    if text is None:
        return None
    try:
        return SafetyLevel.parse(text)
    except ValueError as exc:
        fail(f"--max-level: {exc}", 2)


class Bearer(enum.Enum):
    ROOT = "root"  # the root options' --token, else the address's stored sign-in


def connect(
    ctx: typer.Context,
    address: str | None,
    *,
    token: str | client_mod.TokenProvider | Literal[Bearer.ROOT] | None = Bearer.ROOT,
) -> RegistryClient:
    """A client with the root options' TLS and bearer: ``--token``/TOOLREG_TOKEN,
    else the sign-in ``toolreg login`` stored for the address. A ``token``
    given overrides that (falling back to ``--token`` only, never to a stored
    sign-in: the console and ``mcp --http`` pass each caller's own)."""
    conn = ctx.find_root().obj
    if not isinstance(conn, Connection):
        conn = Connection()
    target = address or client_mod.default_address()
    if isinstance(token, Bearer):
        bearer = conn.token or _stored_sign_in(target)
    else:
        bearer = token or conn.token

    def read(path: Path | None, what: str) -> bytes | None:
        try:
            return None if path is None else read_credential(path, what)
        except ToolregError as exc:
            fail(exc.message, 2)

    channel = open_channel(
        target, token=bearer, tls_ca=read(conn.tls_ca, "TLS CA"),
        tls_cert=read(conn.tls_cert, "client certificate"),
        tls_key=read(conn.tls_key, "client key"), tls=conn.tls,
    )  # fmt: skip
    return RegistryClient(target, channel=channel)


def _stored_sign_in(address: str) -> client_mod.TokenProvider | None:
    """The provider of the address's stored sign-in, refreshing it; a refresh
    that fails ends the command with one line."""
    store = TokenStore()
    if not store.path_for(address).exists():
        return None
    tokens = StoredLoginTokens(store, address)

    def token() -> str:
        try:
            return tokens()
        except TokenError as exc:
            fail(f"the sign-in for {address} cannot be used ({exc}); run toolreg login again")

    return token


def rpc_failed(err: grpc.RpcError, address: str) -> NoReturn:
    if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE:
        fail(
            f"cannot reach the toolreg server at {address} ({err.details()});"
            " is `toolreg serve` running?"
        )
    fail(describe_rpc_error(err))

"""`toolreg console`: the approval console."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from registry_server.cli.common import AddressOpt, Connection, connect, fail
from registry_server.client import registry_client as client_mod
from registry_server.domain.errors import ToolregError


def console_serve(
    ctx: typer.Context,
    address: AddressOpt = None,
    http: Annotated[
        str, typer.Option("--http", metavar="HOST:PORT", help="Where to serve the page.")
    ] = "127.0.0.1:8780",
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            help="The server's policy file: its approvers sign in with their client tokens.",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None, typer.Option("--allow-host", help="Another Host to accept, NAME:PORT.")
    ] = None,
    http_tls_cert: Annotated[
        Path | None, typer.Option("--http-tls-cert", help="Serve HTTPS (PEM).")
    ] = None,
    http_tls_key: Annotated[Path | None, typer.Option("--http-tls-key", help="The key.")] = None,
    max_sessions: Annotated[
        int | None, typer.Option("--max-sessions", help="Signed-in sessions at once (32).")
    ] = None,
    session_idle_s: Annotated[
        float | None, typer.Option("--session-idle-s", help="End idle sessions after (900 s).")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option("--max-body-bytes", help="Request body cap (64 KiB).")
    ] = None,
    sso_provider: Annotated[
        str | None,
        typer.Option(
            "--sso-provider",
            envvar="TOOLREG_CONSOLE_SSO_PROVIDER",
            help="Sign in with this identity provider of the policy (OpenID Connect).",
        ),
    ] = None,
    sso_client_id: Annotated[
        str | None,
        typer.Option(
            "--sso-client-id",
            envvar="TOOLREG_CONSOLE_SSO_CLIENT_ID",
            help="The console's client id at the provider.",
        ),
    ] = None,
    sso_client_secret_file: Annotated[
        Path | None,
        typer.Option(
            "--sso-client-secret-file",
            help="A file holding its client secret"
            " (else $TOOLREG_CONSOLE_SSO_CLIENT_SECRET; never an argument).",
        ),
    ] = None,
    sso_scopes: Annotated[
        str | None, typer.Option("--sso-scopes", help='Scopes asked beside openid ("groups").')
    ] = None,
    sso_resource: Annotated[
        str | None,
        typer.Option(
            "--sso-resource",
            help="The registry's audience at the provider (default: the provider's one audience).",
        ),
    ] = None,
    sso_redirect_uri: Annotated[
        str | None,
        typer.Option(
            "--sso-redirect-uri",
            help="The callback URL the provider knows"
            " (default: this listener's URL + /auth/callback).",
        ),
    ] = None,
    trusted_proxy: Annotated[
        list[str] | None,
        typer.Option(
            "--trusted-proxy",
            envvar="TOOLREG_CONSOLE_TRUSTED_PROXIES",
            help="A reverse proxy's address or CIDR network (repeatable): from these peers"
            " only, the forwarded header names the client the sign-in throttle counts"
            " (default: none; forwarded headers are ignored).",
        ),
    ] = None,
    forwarded_header: Annotated[
        str | None,
        typer.Option(
            "--forwarded-header",
            help="The header the trusted proxies set: x-forwarded-for (default) or forwarded.",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
) -> None:
    """Serve the approval console: a web page where approvers see, live, the
    requests they may approve, read each in full (checked against its digests)
    and sign it in their browser with their own key, which never leaves it.

    Approvers sign in with their client token from --policy, or with --sso-provider
    through the organization's identity provider; each is then its own registry
    client. Beyond loopback it needs --http-tls-cert/--http-tls-key."""
    import logging

    from registry_server.console.app import serve_console
    from registry_server.console.settings import ConsoleSettings

    conn = ctx.find_root().obj
    if isinstance(conn, Connection) and conn.token:
        fail(
            "--token/TOOLREG_TOKEN does not apply to the console: each approver's own client"
            " token is its registry identity",
            2,
        )
    try:
        logging.basicConfig(
            stream=sys.stderr, level=log_level.upper(), format="%(asctime)s %(name)s %(message)s"
        )
    except ValueError as exc:
        fail(f"--log-level: {exc}", 2)
    try:
        settings = ConsoleSettings.from_options(
            http, policy_file=policy, allowed_hosts=tuple(allow_host or ()),
            tls_cert=http_tls_cert, tls_key=http_tls_key, max_sessions=max_sessions,
            session_idle_s=session_idle_s, max_body_bytes=max_body_bytes,
            sso_provider=sso_provider, sso_client_id=sso_client_id,
            sso_client_secret_file=sso_client_secret_file, sso_scopes=sso_scopes,
            sso_resource=sso_resource, sso_redirect_uri=sso_redirect_uri,
            trusted_proxies=tuple(trusted_proxy or ()), forwarded_header=forwarded_header,
        )  # fmt: skip
    except ToolregError as exc:
        fail(exc.message, 2)
    connect(ctx, address).close()  # the TLS files are read now, not at the first sign-in
    try:
        serve_console(
            lambda bearer: connect(ctx, address, token=bearer),
            settings,
            address=address or client_mod.default_address(),
        )
    except ToolregError as exc:
        fail(exc.message)

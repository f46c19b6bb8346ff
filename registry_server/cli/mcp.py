"""`toolreg mcp`: the registry's tools as an MCP server (stdio or Streamable HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from registry_server.cli.common import (
    AddressOpt,
    CategoryOpt,
    Connection,
    LevelOpt,
    connect,
    fail,
    parse_level,
)
from registry_server.client import registry_client as client_mod
from registry_server.domain.errors import ToolregError


def mcp_serve(
    ctx: typer.Context,
    max_level: LevelOpt = None,
    category: CategoryOpt = None,
    address: AddressOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
    http: Annotated[
        str | None,
        typer.Option(
            "--http", metavar="HOST:PORT", help="Serve Streamable HTTP at HOST:PORT/mcp, not stdio."
        ),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            help="With --http: accept the bearer tokens of this policy's clients (the server's"
            " policy file); each MCP client is then its own registry client.",
        ),
    ] = None,
    insecure_dev: Annotated[
        bool,
        typer.Option(
            "--insecure-dev",
            help="With --http and no --policy: no authentication; loopback only (development).",
        ),
    ] = False,
    allow_host: Annotated[
        list[str] | None,
        typer.Option("--allow-host", help="With --http: another Host to accept, NAME:PORT."),
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-origin", help="With --http: a browser Origin to accept (default: none)."
        ),
    ] = None,
    http_tls_cert: Annotated[
        Path | None, typer.Option("--http-tls-cert", help="With --http: serve HTTPS (PEM).")
    ] = None,
    http_tls_key: Annotated[
        Path | None, typer.Option("--http-tls-key", help="With --http: the key (PEM).")
    ] = None,
    max_sessions: Annotated[
        int | None, typer.Option("--max-sessions", help="With --http: open sessions (64).")
    ] = None,
    session_idle_s: Annotated[
        float | None,
        typer.Option("--session-idle-s", help="With --http: close idle sessions after (600 s)."),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option("--max-body-bytes", help="With --http: request body cap (1 MiB + 64 KiB)."),
    ] = None,
    resume_ttl_s: Annotated[
        float | None,
        typer.Option(
            "--resume-ttl-s",
            help="With --http: keep a stream's events for Last-Event-ID this long after its"
            " last event (600 s).",
        ),
    ] = None,
    resume_max_bytes: Annotated[
        int | None,
        typer.Option(
            "--resume-max-bytes", help="With --http: bytes of stream events kept in all (64 MiB)."
        ),
    ] = None,
    oauth_provider: Annotated[
        str | None,
        typer.Option(
            "--oauth-provider",
            help="With --http and --policy: also accept MCP hosts' OAuth tokens from this identity"
            " provider of the policy (RFC 9728 metadata, audience = --resource-url); each"
            " person's calls use a registry token exchanged for them (RFC 8693).",
        ),
    ] = None,
    resource_url: Annotated[
        str | None,
        typer.Option("--resource-url", help="With --oauth-provider: this bridge's public MCP URL."),
    ] = None,
    oauth_scope: Annotated[
        list[str] | None,
        typer.Option("--oauth-scope", help="With --oauth-provider: a scope hosts' tokens need."),
    ] = None,
    oauth_client_id: Annotated[
        str | None,
        typer.Option(
            "--oauth-client-id",
            help="With --oauth-provider: the bridge's client at the provider (its secret:"
            " $TOOLREG_OAUTH_CLIENT_SECRET or --oauth-client-secret-file).",
        ),
    ] = None,
    oauth_client_secret_file: Annotated[
        Path | None,
        typer.Option(
            "--oauth-client-secret-file", help="With --oauth-provider: its secret's file."
        ),
    ] = None,
    console_url: Annotated[
        str | None,
        typer.Option(
            "--console-url",
            help="The approval console's base URL: a dangerous call then asks the host's user"
            " to open its approval page (an MCP input request) instead of answering text"
            " (default with --policy: the policy's console_url).",
        ),
    ] = None,
    approval_state_ttl_s: Annotated[
        float | None,
        typer.Option(
            "--approval-state-ttl-s",
            help="How long a host may take to retry an approval input request (900 s).",
        ),
    ] = None,
    registry_resource: Annotated[
        str | None,
        typer.Option(
            "--registry-resource",
            help="With --oauth-provider: the registry's audience to exchange for (default: the"
            " provider's first audience in the policy).",
        ),
    ] = None,
) -> None:
    """Serve the registry's tools as an MCP server, for MCP hosts: over stdio,
    or over Streamable HTTP with --http.

    Lists the tools this client may see and runs calls through ExecuteTool; a
    call with a progress token runs through StreamExecuteTool and reports its
    output as progress. A dangerous call answers with its approval request id;
    once approved, call again with "_approval_request_id": ID added to the
    arguments. Over stdio the registry sees --token; over HTTP it sees the bearer
    token each MCP client sends, checked against --policy (401 otherwise).
    Without a policy, HTTP is refused unless --insecure-dev on loopback. Logs go
    to stderr (over stdio, stdout is the MCP channel)."""
    from registry_server.mcp import bridge as mcp_bridge

    level = parse_level(max_level)
    try:
        mcp_bridge.configure_logging(log_level)
    except ValueError as exc:
        fail(f"--log-level: {exc}", 2)
    http_only = {
        "--policy": policy is not None, "--insecure-dev": insecure_dev,
        "--allow-host": bool(allow_host), "--allow-origin": bool(allow_origin),
        "--http-tls-cert": http_tls_cert is not None, "--http-tls-key": http_tls_key is not None,
        "--max-sessions": max_sessions is not None, "--session-idle-s": session_idle_s is not None,
        "--max-body-bytes": max_body_bytes is not None,
        "--resume-ttl-s": resume_ttl_s is not None,
        "--resume-max-bytes": resume_max_bytes is not None,
        "--oauth-provider": oauth_provider is not None, "--resource-url": resource_url is not None,
        "--oauth-scope": bool(oauth_scope), "--oauth-client-id": oauth_client_id is not None,
        "--oauth-client-secret-file": oauth_client_secret_file is not None,
        "--registry-resource": registry_resource is not None,
    }  # fmt: skip
    if http is None:
        given = [name for name, set_ in http_only.items() if set_]
        if given:
            fail(f"{', '.join(given)}: only with --http", 2)
        from registry_server.mcp import http_settings as mcp_http_settings

        try:
            url = mcp_http_settings.check_console_url(console_url or "")
            ttl = mcp_http_settings.check_state_ttl(approval_state_ttl_s)
        except ToolregError as exc:
            fail(exc.message, 2)
        with connect(ctx, address) as client:
            mcp_bridge.serve(
                client, max_level=level, categories=category or (), console_url=url,
                state_ttl_s=ttl,
            )  # fmt: skip
        return
    _serve_mcp_http(
        ctx, address, http, policy=policy, insecure_dev=insecure_dev,
        allowed_hosts=allow_host or (), allowed_origins=allow_origin or (),
        tls_cert=http_tls_cert, tls_key=http_tls_key, max_sessions=max_sessions,
        session_idle_s=session_idle_s, max_body_bytes=max_body_bytes,
        resume_ttl_s=resume_ttl_s, resume_max_bytes=resume_max_bytes,
        max_level=level, categories=category or (), oauth_provider=oauth_provider,
        resource_url=resource_url, oauth_scopes=oauth_scope or (),
        oauth_client_id=oauth_client_id, oauth_client_secret_file=oauth_client_secret_file,
        registry_resource=registry_resource, console_url=console_url,
        approval_state_ttl_s=approval_state_ttl_s,
    )  # fmt: skip


def _serve_mcp_http(
    ctx: typer.Context, address: str | None, endpoint: str, *, policy: Path | None, **options: Any
) -> None:
    from registry_server.mcp import http as mcp_http
    from registry_server.mcp import http_settings as mcp_http_settings

    conn = ctx.find_root().obj
    if policy is not None and isinstance(conn, Connection) and conn.token:
        # One fixed identity for every MCP client would share its roles and approvals.
        fail(
            "--token/TOOLREG_TOKEN does not apply to --http with --policy: each MCP client's"
            " own bearer token is its registry identity",
            2,
        )
    try:
        settings = mcp_http_settings.http_settings(endpoint, policy_file=policy, **options)
    except ToolregError as exc:
        fail(exc.message, 2)
    connect(ctx, address).close()  # the TLS files are read now, not at the first request
    try:
        mcp_http.serve_http(
            lambda token: connect(ctx, address, token=token),
            settings,
            address=address or client_mod.default_address(),
        )
    except ToolregError as exc:
        fail(exc.message)

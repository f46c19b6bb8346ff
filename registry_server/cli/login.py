"""`toolreg login` and `toolreg logout`: a person signs in at the
organization's identity provider (``idp_login``), and the CLI's verbs then
use that sign-in for the registry address, refreshing it (``common.connect``,
``idp_tokens.StoredLoginTokens``). The sign-in is kept in the user's config
directory (``token_store``), never printed."""

from __future__ import annotations

import contextlib
import os
import ssl
import sys
import time
import webbrowser
from pathlib import Path
from typing import Annotated

import typer

from registry_server.cli.common import AddressOpt, fail
from registry_server.cli.idp_login import (
    DEFAULT_SCOPE,
    CallbackListener,
    LoginError,
    Request,
    discover,
    revoke,
    signed_in_as,
)
from registry_server.client import registry_client as client_mod
from registry_server.client.idp_tokens import TokenError, https_client
from registry_server.client.token_store import StoredLogin, StoreError, TokenStore

DEFAULT_TIMEOUT_S = 300  # seconds to wait for the person to sign in


def login(
    issuer: Annotated[
        str | None,
        typer.Option("--issuer", envvar="TOOLREG_ISSUER", help="The identity provider's issuer."),
    ] = None,
    client_id: Annotated[
        str | None,
        typer.Option("--client-id", envvar="TOOLREG_CLIENT_ID", help="The CLI's (public) client."),
    ] = None,
    resource: Annotated[
        str | None,
        typer.Option(
            "--resource", envvar="TOOLREG_RESOURCE", help="The registry's audience (RFC 8707)."
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            "--ca-file", envvar="TOOLREG_IDP_CA", help="CA of the provider's TLS (private CAs)."
        ),
    ] = None,
    scope: Annotated[
        str | None,
        typer.Option("--scope", help=f"Scopes to ask for besides '{DEFAULT_SCOPE}'."),
    ] = None,
    port: Annotated[
        int,
        typer.Option(
            "--port", min=0, max=65535, help="Loopback port of the redirect (0: any free one)."
        ),
    ] = 0,
    no_browser: Annotated[
        bool, typer.Option("--no-browser", help="Only print the sign-in URL.")
    ] = False,
    timeout_s: Annotated[
        float, typer.Option("--timeout", min=1, help="Seconds to wait for the sign-in.")
    ] = DEFAULT_TIMEOUT_S,
    address: AddressOpt = None,
) -> None:
    """Sign in at your identity provider; the CLI then uses (and refreshes)
    that sign-in for this registry address. The options given at the last
    sign-in to the address are the defaults."""
    target = address or client_mod.default_address()
    store = TokenStore()
    previous = _stored(store, target)

    def needed(value: str | None, before: str | None, option: str) -> str:
        if value or before:
            return value or before or ""
        fail(f"{option} is needed (the first sign-in to {target} names it)", 2)

    issuer = needed(issuer, previous.issuer if previous else None, "--issuer")
    client_id = needed(client_id, previous.client_id if previous else None, "--client-id")
    resource = needed(resource, previous.resource if previous else None, "--resource")
    scope = scope or (previous.scope if previous else None)
    ca = str(ca_file.resolve()) if ca_file else (previous.ca_file if previous else None)
    asked = " ".join(dict.fromkeys([*DEFAULT_SCOPE.split(), *(scope or "").split()]))
    try:
        http = https_client(ca)
    except (OSError, ssl.SSLError) as exc:
        fail(f"--ca-file: cannot use {ca} ({exc.strerror or exc})", 2)
    with http:
        try:
            provider = discover(http, issuer)
        except LoginError as exc:
            fail(str(exc))
        try:
            listener = CallbackListener(port)
        except OSError as exc:
            fail(f"cannot listen on {port or 'a free port'} of loopback ({exc.strerror})")
        try:
            request = Request.new()
            url = request.url(
                provider, client_id, listener.redirect_uri, scope=asked, resource=resource
            )
            typer.echo(
                f"To sign in to {target}, open this URL in a browser"
                f" (waiting {timeout_s:g} s):\n\n  {url}\n",
                err=True,
            )
            if not no_browser:
                _open_browser(url)
            try:
                code = listener.wait(timeout_s, lambda query: request.code_from(query, provider))
            except LoginError as exc:
                fail(str(exc))
        finally:
            listener.close()
        try:
            answer = request.exchange(
                http, provider, client_id, code, listener.redirect_uri, resource
            )
        except TokenError as exc:
            fail(f"the sign-in failed: {exc}")
    who = signed_in_as(answer.id_token)
    stored = StoredLogin(
        address=target, issuer=provider.issuer, client_id=client_id, resource=resource,
        token_endpoint=provider.token_endpoint, access_token=answer.access_token,
        expires_at=time.time() + answer.lifetime, refresh_token=answer.refresh_token,
        revocation_endpoint=provider.revocation_endpoint, ca_file=ca, scope=scope, subject=who,
    )  # fmt: skip
    try:
        path = store.save(stored)
    except OSError as exc:
        fail(f"cannot store the sign-in in {store.directory} ({exc.strerror})")
    typer.echo(f"signed in to {target}{f' as {who}' if who else ''} (kept in {path})")
    if not answer.refresh_token:
        typer.echo(
            "toolreg: the provider gave no refresh token (offline_access not allowed?):"
            " sign in again when the access token expires",
            err=True,
        )


def logout(address: AddressOpt = None) -> None:
    """Forget the sign-in for this registry address (and revoke its refresh
    token at the provider, where it can)."""
    target = address or client_mod.default_address()
    store = TokenStore()
    previous = _stored(store, target, unreadable_ok=True)
    note = ""
    if previous and previous.refresh_token and previous.revocation_endpoint:
        try:
            with https_client(previous.ca_file) as http:
                why = revoke(
                    http, previous.revocation_endpoint, previous.refresh_token, previous.client_id
                )
        except (OSError, ssl.SSLError) as exc:
            why = f"CA file: {exc.strerror or exc}"
        if why:
            note = f"; the provider did not revoke its refresh token ({why})"
    if not store.delete(target):
        typer.echo(f"not signed in to {target}")
        return
    typer.echo(f"signed out of {target}{note}")


def _stored(store: TokenStore, address: str, *, unreadable_ok: bool = False) -> StoredLogin | None:
    try:
        return store.load(address)
    except StoreError as exc:
        if unreadable_ok:
            return None
        fail(f"{exc}: remove it or run toolreg logout", 2)


def _open_browser(url: str) -> None:
    """The person's browser, where there is one to open (a terminal browser
    would take over this terminal: none is started without a display)."""
    graphical = sys.platform in ("darwin", "win32") or any(
        os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")
    )
    if graphical:
        with contextlib.suppress(webbrowser.Error):
            webbrowser.open(url)

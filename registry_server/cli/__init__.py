"""The ``toolreg`` command: the server, and client verbs that talk to it over gRPC.

One module per verb group; this one builds the root app from them. User
mistakes (bad manifest, unknown tool, server not running) print one clear line
and exit non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import sys

# Before anything imports jsonschema: when rfc3987-syntax is installed (cyclonedx-bom,
# which `toolreg images build --server` needs beside toolreg, brings it), jsonschema
# imports it for its "iri" format checks, and it builds a Lark grammar at import:
# 1.3 s of CPU at every start of every toolreg command (4x the rest of the start-up).
# toolreg checks no format but "regex" (domain/schema_safety.py), so its own program
# does without; a library user's process, which never imports this package, is
# left alone. tests/unit/test_cli_startup.py holds it.
sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]

from pathlib import Path
from typing import Annotated

import typer

from registry_server.cli.approvals import approvals_app
from registry_server.cli.audit import audit_app
from registry_server.cli.common import Connection, fail
from registry_server.cli.console import console_serve
from registry_server.cli.doctor import doctor
from registry_server.cli.execute import exec_tool
from registry_server.cli.identities import identities_app
from registry_server.cli.images import images_app
from registry_server.cli.keys import keys_app
from registry_server.cli.login import login, logout
from registry_server.cli.mcp import mcp_serve
from registry_server.cli.policy import policy_app
from registry_server.cli.server import health, reap, serve
from registry_server.cli.tools import tools_app
from registry_server.cli.witness import witness_app
from registry_server.domain.errors import ToolregError
from registry_server.version import version_line

app = typer.Typer(
    name="toolreg",
    help="A tool registry for LLM agents that runs every call in a fresh sandbox.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(tools_app, name="tools")
app.add_typer(approvals_app, name="approvals")
app.add_typer(keys_app, name="keys")
app.add_typer(audit_app, name="audit")
app.add_typer(policy_app, name="policy")
app.add_typer(witness_app, name="witness")
app.add_typer(images_app, name="images")
app.add_typer(identities_app, name="identities")
# `toolreg --help` lists these in this order, before the groups above.
app.command()(serve)
app.command("exec")(exec_tool)
app.command()(reap)
app.command()(health)
app.command()(doctor)
app.command("mcp")(mcp_serve)
app.command("console")(console_serve)
app.command()(login)
app.command()(logout)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and the git revision it was built from.",
        ),
    ] = False,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="TOOLREG_TOKEN", help="Bearer token of this client."),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option("--tls-ca", envvar="TOOLREG_TLS_CA", help="CA that signed the server."),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", envvar="TOOLREG_TLS_CERT", help="Client certificate (mTLS)."),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option("--tls-key", envvar="TOOLREG_TLS_KEY", help="Client key (mTLS).")
    ] = None,
    tls: Annotated[
        bool, typer.Option("--tls", envvar="TOOLREG_TLS", help="Use TLS (system CAs).")
    ] = False,
) -> None:
    ctx.obj = Connection(token, tls_ca, tls_cert, tls_key, tls)
    _start_tracing(ctx)


# The service name each kind of process reports when OTEL_SERVICE_NAME is unset.
SERVICE_NAMES = {
    "serve": "toolreg", "mcp": "toolreg-mcp", "console": "toolreg-console",
    "witness": "toolreg-witness",
}  # fmt: skip
LONG_RUNNING = frozenset(SERVICE_NAMES)  # no span for the whole life of a server


def _start_tracing(ctx: typer.Context) -> None:
    """Tracing, when the OTEL_* variables ask for it: a command is one span, and
    its RPCs are client spans under it, which the server continues."""
    from registry_server.api import tracing

    command = ctx.invoked_subcommand or ""
    try:
        started = tracing.configure(SERVICE_NAMES.get(command, "toolreg-cli"))
    except ToolregError as exc:
        fail(exc.message, 2)
    if started is None:
        return
    ctx.call_on_close(started.shutdown)  # exports the last spans before the process ends
    if command not in LONG_RUNNING:
        from opentelemetry import trace

        tracer = trace.get_tracer("toolreg.cli")
        ctx.with_resource(tracer.start_as_current_span(f"toolreg {command}".strip()))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

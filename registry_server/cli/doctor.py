"""`toolreg doctor`: check this host before trusting it with tool calls. It reads
its settings exactly as `toolreg serve` does (the same options, TOOLREG_* variables
through ServerConfig), so it checks the engine, store, files and ports that serve
would use (docs/how-to/deploying.md, "toolreg doctor")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from registry_server.cli.common import fail
from registry_server.cli.server_options import (
    DataDirOpt,
    HostOpt,
    MetricsPortOpt,
    PolicyOpt,
    PortOpt,
    StoreUrlOpt,
    TlsCertOpt,
    TlsClientCaOpt,
    TlsKeyOpt,
    server_config,
)


def doctor(
    host: HostOpt = None,
    port: PortOpt = None,
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
    policy: PolicyOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_client_ca: TlsClientCaOpt = None,
    metrics_port: MetricsPortOpt = None,
    docker_url: Annotated[
        str | None,
        typer.Option("--docker-url", help="Engine address (default: DOCKER_HOST or the socket)."),
    ] = None,
    tools: Annotated[
        Path | None,
        typer.Option(
            "--tools",
            help="The manifests serve would register (their images must be present), and"
            " the tool sources the images were built from (default: the packaged examples).",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the results as JSON (stable keys).")
    ] = False,
) -> None:
    """Check the engine, runtimes, images, init, data directory, store, policy, TLS
    and ports; each failure names its fix. Exit status 1 on any failure."""
    from registry_server.install.doctor import exit_status, render_json, render_text, run_checks

    config = server_config(
        host=host, port=port, data_dir=data_dir, store_url=store_url, policy_file=policy,
        tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
        metrics_port=metrics_port, docker_url=docker_url,
    )  # fmt: skip
    if tools is not None and not tools.is_dir():
        fail(f"--tools: {tools} is not a directory", 2)
    results = run_checks(config, tools_dir=tools.resolve() if tools else None)
    typer.echo(render_json(results) if as_json else render_text(results))
    raise typer.Exit(exit_status(results))

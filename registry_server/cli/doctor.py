"""`toolreg doctor`: check this host before trusting it with tool calls. It reads
its settings exactly as `toolreg serve` does (the same options, TOOLREG_* variables
through ServerConfig), so it checks the engine, store, files and ports that serve
would use (docs/how-to/deploying.md, "toolreg doctor")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from registry_server.cli.common import fail


def doctor(
    host: Annotated[str | None, typer.Option(help="Address the server would listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Its port (0 = any free port).")] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Where the store lives.")
    ] = None,
    store_url: Annotated[
        str | None,
        typer.Option(
            "--store-url", help="sqlite:///PATH or postgresql://... (default: in --data-dir)."
        ),
    ] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Policy file (YAML).")] = None,
    tls_cert: Annotated[
        Path | None, typer.Option("--tls-cert", help="Server certificate (PEM).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="Server key (PEM).")] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option("--tls-client-ca", help="CA of client certificates (mTLS)."),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Prometheus metrics port.")
    ] = None,
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
    from pydantic import ValidationError

    from registry_server.api.config import ServerConfig
    from registry_server.install.doctor import exit_status, render_json, render_text, run_checks

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": host,
            "port": port,
            "data_dir": data_dir,
            "store_url": store_url,
            "policy_file": policy,
            "tls_cert": tls_cert,
            "tls_key": tls_key,
            "tls_client_ca": tls_client_ca,
            "metrics_port": metrics_port,
            "docker_url": docker_url,
        }.items()
        if v is not None
    }
    try:
        config = ServerConfig(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        fail(f"invalid configuration: {problems}", 2)
    if tools is not None and not tools.is_dir():
        fail(f"--tools: {tools} is not a directory", 2)
    results = run_checks(config, tools_dir=tools.resolve() if tools else None)
    typer.echo(render_json(results) if as_json else render_text(results))
    raise typer.Exit(exit_status(results))

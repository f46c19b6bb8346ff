"""The server verbs: `toolreg serve` and `toolreg reap`."""

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
from registry_server.domain.errors import ToolregError


def serve(
    host: HostOpt = None,
    port: PortOpt = None,
    data_dir: DataDirOpt = None,
    tools: Annotated[
        Path | None,
        typer.Option("--tools", help="Register the manifests of this directory at start."),
    ] = None,
    policy: PolicyOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_client_ca: TlsClientCaOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
    log_format: Annotated[
        str, typer.Option("--log-format", envvar="TOOLREG_LOG_FORMAT", help="auto, json or text.")
    ] = "auto",
    metrics_port: MetricsPortOpt = None,
    store_url: StoreUrlOpt = None,
    log_key: Annotated[
        Path | None,
        typer.Option(
            "--log-key",
            help="Sign checkpoints of the audit log with this Ed25519 key (PEM, mode 600;"
            " keep it outside the store). docs/how-to/audit.md",
        ),
    ] = None,
    log_origin: Annotated[
        str | None,
        typer.Option("--log-origin", help="The log's name in its checkpoints."),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option("--checkpoint-every", help="A checkpoint once this many records wait."),
    ] = None,
    checkpoint_interval_s: Annotated[
        float | None,
        typer.Option(
            "--checkpoint-interval-s", help="A checkpoint at most this many seconds after a record."
        ),
    ] = None,
    witness: Annotated[
        list[str] | None,
        typer.Option(
            "--witness",
            help="Submit each checkpoint to this witness: 'VKEY URL' (its verifier key and"
            " submission URL). Repeatable. docs/how-to/audit.md, Witnesses",
        ),
    ] = None,
    export_jsonl: Annotated[
        Path | None,
        typer.Option(
            "--export-jsonl",
            help="Export every audit record as an OCSF event to this JSON Lines"
            " file (rotated by size). docs/how-to/audit.md",
        ),
    ] = None,
    export_jsonl_max_bytes: Annotated[
        int | None,
        typer.Option("--export-jsonl-max-bytes", help="Rotate the file before it passes this."),
    ] = None,
    export_jsonl_keep: Annotated[
        int | None, typer.Option("--export-jsonl-keep", help="Rotated files kept.")
    ] = None,
    export_syslog: Annotated[
        str | None,
        typer.Option(
            "--export-syslog",
            help="Export every audit record as an OCSF event to this syslog"
            " receiver, HOST:PORT, over TLS (RFC 5425).",
        ),
    ] = None,
    export_syslog_ca: Annotated[
        Path | None,
        typer.Option("--export-syslog-ca", help="The CA that signed the receiver's certificate."),
    ] = None,
    export_syslog_cert: Annotated[
        Path | None,
        typer.Option("--export-syslog-cert", help="Client certificate for the receiver (PEM)."),
    ] = None,
    export_syslog_key: Annotated[
        Path | None,
        typer.Option("--export-syslog-key", help="Its key (PEM, unencrypted)."),
    ] = None,
) -> None:
    """Run the gRPC server in the foreground until SIGTERM/SIGINT."""

    from registry_server.api import logs
    from registry_server.api.server import serve as run_server

    try:
        logs.configure(log_level, log_format)
    except ValueError as exc:
        fail(f"--log-format/--log-level: {exc}", 2)
    config = server_config(
        **{
            "host": host,
            "port": port,
            "data_dir": data_dir,
            "tools_dir": tools,
            "policy_file": policy,
            "tls_cert": tls_cert,
            "tls_key": tls_key,
            "tls_client_ca": tls_client_ca,
            "metrics_port": metrics_port,
            "store_url": store_url,
            "log_key_file": log_key,
            "log_origin": log_origin,
            "checkpoint_every": checkpoint_every,
            "checkpoint_interval_s": checkpoint_interval_s,
            "witnesses": tuple(witness) if witness else None,
            "export_jsonl": export_jsonl,
            "export_jsonl_max_bytes": export_jsonl_max_bytes,
            "export_jsonl_keep": export_jsonl_keep,
            "export_syslog": export_syslog,
            "export_syslog_ca": export_syslog_ca,
            "export_syslog_cert": export_syslog_cert,
            "export_syslog_key": export_syslog_key,
        }
    )
    try:
        run_server(config)
    except ToolregError as exc:
        fail(exc.message)
    except OSError as exc:
        fail(str(exc))


def reap(
    docker_url: Annotated[
        str | None,
        typer.Option("--docker-url", envvar="TOOLREG_DOCKER_URL", help="Engine address."),
    ] = None,
) -> None:
    """Remove sandbox containers left behind by toolreg servers that are gone.
    Containers of running servers are never touched."""
    from registry_server.api.app import open_backend
    from registry_server.api.config import ServerConfig
    from sandbox_runner import SandboxError

    backend = open_backend(ServerConfig(docker_url=docker_url), reaper=True)
    try:
        removed = backend.reap()
    except SandboxError as exc:
        fail(str(exc))
    finally:
        backend.close()
    typer.echo(f"removed {removed} leftover container{'s' if removed != 1 else ''}")


def health(
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="The health port, HOST:PORT (default: 127.0.0.1 and TOOLREG_HEALTH_PORT).",
        ),
    ] = None,
    service: Annotated[
        str, typer.Option("--service", help="The service to ask about ('': the server).")
    ] = "",
) -> None:
    """Ask a server's cleartext health port (TOOLREG_HEALTH_PORT) whether it serves:
    exit 0 on SERVING, 1 otherwise. The server image's health check."""
    from registry_server.client.health_probe import probe

    code = probe(address, service)
    if code != 0:
        raise typer.Exit(code)

"""The server's own settings as options, shared by `toolreg serve` and `toolreg doctor`
so that doctor checks exactly what serve would use: the same flags, read through the
same ServerConfig (TOOLREG_* variables below them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from registry_server.cli.common import fail

if TYPE_CHECKING:
    from registry_server.api.config import ServerConfig

HostOpt = Annotated[str | None, typer.Option(help="Address the server listens on.")]
PortOpt = Annotated[int | None, typer.Option(help="Port (0 = any free port).")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="Where the store lives.")]
StoreUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--store-url", help="sqlite:///PATH or postgresql://... (default: in --data-dir)."
    ),
]
PolicyOpt = Annotated[Path | None, typer.Option("--policy", help="Policy file (YAML).")]
TlsCertOpt = Annotated[Path | None, typer.Option("--tls-cert", help="Server certificate (PEM).")]
TlsKeyOpt = Annotated[Path | None, typer.Option("--tls-key", help="Server key (PEM).")]
TlsClientCaOpt = Annotated[
    Path | None,
    typer.Option("--tls-client-ca", help="Require client certificates from this CA."),
]
MetricsPortOpt = Annotated[
    int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port.")
]


def server_config(**settings: Any) -> ServerConfig:
    """ServerConfig from the options given (None: not given, so TOOLREG_* or the
    default); an invalid value ends the command with exit status 2, naming the field."""
    from pydantic import ValidationError

    from registry_server.api.config import ServerConfig

    try:
        return ServerConfig(**{k: v for k, v in settings.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        fail(f"invalid configuration: {problems}", 2)

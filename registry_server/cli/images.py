"""`toolreg images`: the sandbox images, built on this host from what the wheel carries
(nothing is pulled from a registry)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from registry_server.cli.common import fail
from registry_server.install.images import build_sandbox_images
from registry_server.install.packaged import EXAMPLE_TOOLS_DIR
from registry_server.install.server_image import (
    SBOM_IN_IMAGE,
    ServerImageError,
    build_server_image,
)

images_app = typer.Typer(
    help="Build the sandbox images locally (busybox-static, a debootstrap'ed Debian),"
    " and the server image.",
    no_args_is_help=True,
)


@images_app.command("build")
def build(
    tools: Annotated[
        Path,
        typer.Option(
            "--tools",
            help="Tool sources to put into the images (*.sh into toolreg/base, *.py into"
            " toolreg/python). Default: the packaged example tools.",
        ),
    ] = EXAMPLE_TOOLS_DIR,
    server: Annotated[
        bool,
        typer.Option(
            "--server",
            help="Then build the server image toolreg/server:<version> (and :latest) from"
            " --wheel, on toolreg/python-root, with its SBOMs.",
        ),
    ] = False,
    wheel: Annotated[
        Path | None,
        typer.Option(
            "--wheel",
            help="The toolreg wheel to install into the server image (`make server-image`"
            " builds one into dist/).",
        ),
    ] = None,
    sbom_dir: Annotated[
        Path | None,
        typer.Option("--sbom-dir", help="Where the SBOMs go (default: beside the wheel)."),
    ] = None,
) -> None:
    """Build toolreg/base, toolreg/python-root and toolreg/python where missing or stale.

    The first build needs a Docker engine and, on Debian as root, installs
    busybox-static and debootstrap; later builds redo only what changed. With
    --server, the server image follows (docs/how-to/deploying.md, "The server image")."""
    if not tools.is_dir():
        fail(f"--tools: {tools} is not a directory")
    if wheel is not None and not server:
        fail("--wheel goes with --server", 2)
    if server and (wheel is None or not wheel.is_file()):
        # An installed toolreg cannot be packed again: the image is built from a wheel.
        why = "" if wheel is None else f" ({wheel} is not a file)"
        fail(
            f"--server needs --wheel PATH, the toolreg wheel to install{why};"
            " in a checkout, `make server-image` builds both",
            2,
        )
    code = build_sandbox_images(tools.resolve())
    if code != 0:
        fail("images build failed (see above); `toolreg doctor` checks the engine", code)
    if server and wheel is not None:
        _build_server(wheel, sbom_dir)


def _build_server(wheel: Path, sbom_dir: Path | None) -> None:
    try:
        built = build_server_image(wheel, sbom_dir=sbom_dir, log=typer.echo)
    except ServerImageError as exc:
        fail(f"server image: {exc}")
    typer.echo(f"built {', '.join(built.tags)} ({built.image_id[:19]}) in {built.seconds:.0f}s")
    typer.echo(f"SBOMs: {built.wheel_sbom} (the wheel's dependency set),"
               f" {built.image_sbom} (the image; inside it at {SBOM_IN_IMAGE})")  # fmt: skip

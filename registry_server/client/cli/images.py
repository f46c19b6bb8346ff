"""`toolreg images`: the sandbox images, built on this host from what the wheel carries
(nothing is pulled from a registry)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from registry_server.client.cli.common import fail
from registry_server.install.images import build_sandbox_images
from registry_server.install.packaged import EXAMPLE_TOOLS_DIR

images_app = typer.Typer(
    help="Build the sandbox images locally (busybox-static, a debootstrap'ed Debian).",
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
) -> None:
    """Build toolreg/base, toolreg/python-root and toolreg/python where missing or stale.

    The first build needs a Docker engine and, on Debian as root, installs
    busybox-static and debootstrap; later builds redo only what changed."""
    if not tools.is_dir():
        fail(f"--tools: {tools} is not a directory")
    code = build_sandbox_images(tools.resolve())
    if code != 0:
        fail("images build failed (see above); `toolreg doctor` checks the engine", code)

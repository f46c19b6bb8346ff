"""The sandbox images as this version builds them: their names, the hashes of their
sources (the io.toolreg.source-hash label build.sh sets), and the build itself, run
from the packaged build script so `toolreg images build` and `make images` give the
same images."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from registry_server.install.packaged import BUILD_SCRIPT, EXAMPLE_TOOLS_DIR, IMAGES_DIR

BASE_IMAGE: Final = "toolreg/base:latest"
ROOT_IMAGE: Final = "toolreg/python-root:latest"  # the debootstrap'ed Debian root
PYTHON_IMAGE: Final = "toolreg/python:latest"
SANDBOX_IMAGES: Final = (BASE_IMAGE, ROOT_IMAGE, PYTHON_IMAGE)
SOURCE_LABEL: Final = "io.toolreg.source-hash"  # build.sh's source_hash()
BUILD_HASH_LABEL: Final = "io.toolreg.build-hash"


@dataclass(frozen=True)
class ImageSources:
    image: str
    files: Mapping[str, bytes]  # name in the build context -> content

    def source_hash(self) -> str:
        """As build.sh's source_hash: sha256 of "<sha256>  <name>" lines sorted by name."""
        lines = "".join(
            f"{hashlib.sha256(self.files[name]).hexdigest()}  {name}\n"
            for name in sorted(self.files)
        )
        return hashlib.sha256(lines.encode()).hexdigest()


def _tool_files(tools_dir: Path, suffix: str, prefix: str) -> dict[str, bytes]:
    return {
        f"{prefix}/{p.name}": p.read_bytes()
        for p in sorted(tools_dir.glob(f"*{suffix}"))
        if p.is_file()
    }


def image_sources(tools_dir: Path = EXAMPLE_TOOLS_DIR) -> tuple[ImageSources, ...]:
    """The images whose sources this package ships (python-root is Debian's, not ours)."""
    base = IMAGES_DIR / "base"
    return (
        ImageSources(
            BASE_IMAGE,
            {
                "Dockerfile": (base / "Dockerfile").read_bytes(),
                "rootfs/etc/passwd": (base / "passwd").read_bytes(),
                "rootfs/etc/group": (base / "group").read_bytes(),
                **_tool_files(tools_dir, ".sh", "rootfs/opt/toolreg/tools"),
            },
        ),
        ImageSources(
            PYTHON_IMAGE,
            {
                "Dockerfile": (IMAGES_DIR / "python" / "Dockerfile").read_bytes(),
                **_tool_files(tools_dir, ".py", "tools"),
            },
        ),
    )


def build_sandbox_images(tools_dir: Path = EXAMPLE_TOOLS_DIR) -> int:
    """Run the packaged build script (its output goes to ours); its exit status.

    It builds only what is missing or changed, needs a Docker engine, and needs root
    on Debian for busybox-static and debootstrap the first time; it says so itself."""
    env = {**os.environ, "TOOLREG_TOOLS_DIR": str(tools_dir)}
    return subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, check=False).returncode

"""Where the wheel's data files are, found from the installed packages themselves, never
from a checkout (a wheel in a virtual environment has no repository beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import sandbox_runner
from sandbox_runner.spec import INIT_BINARY

__all__ = ["BUILD_SCRIPT", "EXAMPLE_TOOLS_DIR", "IMAGES_DIR", "INIT_BINARY", "INIT_SOURCE"]

# The example tools: manifests plus the programs the images carry (`serve --tools`).
EXAMPLE_TOOLS_DIR: Final = Path(__file__).resolve().parents[1] / "examples" / "tools"
# The sandbox images' build contexts and their build script (run by `toolreg images build`).
IMAGES_DIR: Final = Path(sandbox_runner.__file__).resolve().parent / "images"
BUILD_SCRIPT: Final = IMAGES_DIR / "build.sh"
INIT_SOURCE: Final = INIT_BINARY.parent / "toolreg_init.c"

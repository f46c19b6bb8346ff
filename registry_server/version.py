"""Which toolreg this is: the installed distribution's version, and the git revision
the wheel was built from (setup.py writes it beside the package at build time).

A top-level module, so every layer may ask (the store records the version that
wrote it; the CLI prints it; doctor compares it).
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

_BUILD_INFO = Path(__file__).resolve().parent / "_build_info.json"


def version() -> str:
    """This code's release, e.g. "0.2.0" (pyproject.toml takes it from here, so an
    installed wheel's metadata says the same)."""
    from registry_server import __version__

    return __version__


@functools.cache
def revision() -> str:
    """The git commit the installed wheel was built from; in an editable install of a
    checkout, the checkout's commit; "unknown" when neither can be told."""
    try:
        return str(json.loads(_BUILD_INFO.read_text())["revision"])
    except (OSError, ValueError, KeyError):
        pass
    try:  # an editable install: the checkout's own commit
        out = subprocess.run(
            ["git", "-C", str(_BUILD_INFO.parent), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{out.stdout.strip()} (source checkout)" if out.returncode == 0 else "unknown"


def version_line() -> str:
    return f"toolreg {version()} (revision {revision()})"

"""What a toolreg command loads when it starts: every test that spawns a server or
runs the CLI pays it, and so does every user's command."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    # A module set to None in sys.modules is one an import was told does not exist.
    listed = "sorted(k for k, m in sys.modules.items() if m is not None)"
    probe = f"{statement}; import sys; print('\\n'.join({listed}))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(done.stdout.split())


def test_the_cli_does_not_build_rfc3987_grammar() -> None:
    """jsonschema imports rfc3987_syntax when it is installed (cyclonedx-bom brings it
    into the dev venv), and that builds a Lark grammar at import: 1.3 s a start."""
    loaded = _modules_after("import registry_server.cli")
    assert "jsonschema" in loaded  # the CLI does load jsonschema (the probe is real)
    assert "rfc3987_syntax" not in loaded
    assert "lark" not in loaded


def test_a_library_user_keeps_jsonschema_as_installed() -> None:
    """Only toolreg's own program does without it: importing the client facade
    leaves jsonschema's optional format checks as the user's install has them."""
    loaded = _modules_after(
        "import registry_server.client as c; c.RegistryClient; import jsonschema"
    )
    try:
        import rfc3987_syntax  # noqa: F401
    except ImportError:
        installed = False
    else:
        installed = True
    assert ("rfc3987_syntax" in loaded) == installed

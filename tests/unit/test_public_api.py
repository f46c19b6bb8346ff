"""`registry_server.client` is the one import path users write (README, Install):
every name it promises resolves to the object its module defines, it names nothing
else, and the examples and adapters use it rather than internal modules."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import registry_server.client as api

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_to_its_definition() -> None:
    assert sorted(api.__all__) == sorted(api._EXPORTS)
    for name, module in api._EXPORTS.items():
        assert getattr(api, name) is getattr(importlib.import_module(module), name), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'registry_client_internals'"):
        _ = api.registry_client_internals


def test_importing_the_package_loads_no_grpc_client() -> None:
    # The image's health probe imports a module of this package; the facade must not
    # drag the whole client (grpc stubs, domain models) in with it.
    code = "import sys, registry_server.client; print('registry_server.client.registry_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _imported_modules(path: Path) -> set[str]:
    return {
        n.module
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("registry_server")
    }


def test_the_examples_import_only_the_public_api() -> None:
    used = {m for p in (ROOT / "examples").glob("*.py") for m in _imported_modules(p)}
    assert used <= {"registry_server.client"}, used

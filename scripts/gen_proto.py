"""Generate the Python gRPC code for proto/ into registry_server/_proto/.

protoc writes absolute imports (`from toolregistry.v1 import registry_pb2`)
that only work with the output folder on sys.path; we rewrite them to the
private package so the generated code never touches sys.path.

Everything is generated into a temporary folder beside OUT_DIR and only then
moved into place, so a failure never leaves a half-rewritten package.

Usage: gen_proto.py [OUT_DIR]   (default registry_server/_proto)
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "registry_server._proto"


def _run_protoc(out_dir: Path) -> None:
    # the mypy-protobuf plugins live beside this interpreter (the venv's bin/)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def _sources(out_dir: Path) -> list[Path]:
    """The generated modules and stubs: never bytecode, never anything in __pycache__."""
    found = [*out_dir.rglob("*.py"), *out_dir.rglob("*.pyi")]
    return sorted(p for p in found if p.is_file() and "__pycache__" not in p.parts)


def _rewrite_imports(out_dir: Path) -> None:
    for path in _sources(out_dir):
        text = path.read_text(encoding="utf-8")
        fixed = re.sub(r"^from toolregistry\.", f"from {PACKAGE}.toolregistry.", text, flags=re.M)
        fixed = re.sub(
            r"^import toolregistry\.", f"import {PACKAGE}.toolregistry.", fixed, flags=re.M
        )
        if fixed != text:
            path.write_text(fixed, encoding="utf-8")
    for pkg in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        (pkg / "__init__.py").touch()


def _replace_dir(new: Path, out_dir: Path) -> None:
    """Put `new` where `out_dir` is: two renames on one file system, undone on failure."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()  # only the unique name is wanted
        out_dir.rename(old)
    try:
        new.rename(out_dir)
    except BaseException:
        if old is not None:
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old)


def generate(out_dir: Path) -> None:
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.new-", dir=out_dir.parent))
    try:
        _run_protoc(tmp)
        _rewrite_imports(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the package is read by others too
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was moved into place


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "registry_server" / "_proto")

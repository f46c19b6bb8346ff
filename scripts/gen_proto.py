"""Generate the Python gRPC code for proto/ into registry_server/_proto/.

protoc writes absolute imports (`from toolregistry.v1 import registry_pb2`)
that only work with the output folder on sys.path; we rewrite them to the
private package so the generated code never touches sys.path.

Usage: gen_proto.py [OUT_DIR]   (default registry_server/_proto)
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "registry_server._proto"


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
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
    for path in sorted(out_dir.rglob("*.py*")):
        text = path.read_text()
        fixed = re.sub(r"^from toolregistry\.", f"from {PACKAGE}.toolregistry.", text, flags=re.M)
        fixed = re.sub(
            r"^import toolregistry\.", f"import {PACKAGE}.toolregistry.", fixed, flags=re.M
        )
        if fixed != text:
            path.write_text(fixed)
    for pkg in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        (pkg / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "registry_server" / "_proto")

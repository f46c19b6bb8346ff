"""Copies of the files the engine bind-mounts into containers, for a server that runs in
a container itself (docs/how-to/deploying.md, "The server image").

The server asks the engine to mount host paths: the sandbox init into every sandbox, the
egress proxy's code and the upstream CA bundle into the proxy. Inside the server's own
container those files live in its image (site-packages, /etc/ssl), at paths that do not
exist on the engine's host, so the engine would mount nothing or the wrong file. The data
directory is the one path an operator mounts at the same place on both sides; staged
copies under it name the same file for the server and for the engine.

Each copy sits in a directory named by its content's sha256, written whole and then
renamed into place: servers of two versions sharing a data directory, or a server
restarting while an old container still has the previous copy mounted, never see a half
written or changed file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

HASH_CHARS: Final = 16  # hex digits of sha256 in a staged directory's name (64 bits)


def _tree_files(source: Path, pattern: str) -> list[Path]:
    return sorted(p for p in source.glob(pattern) if p.is_file())


def _digest(files: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(base)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:HASH_CHARS]


def _publish(tmp: Path, final: Path) -> Path:
    """Rename ``tmp`` to ``final``; another server that got there first wins (its copy
    has the same content: the name is the content's hash)."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def stage_tree(source: Path, stage_dir: Path, kind: str, pattern: str = "*.py") -> Path:
    """A copy of the files of ``source`` matching ``pattern`` (not its subdirectories), in
    ``<stage_dir>/<kind>/<hash>/``: directories 0755 and files 0644, as the unprivileged
    containers that mount it must read them."""
    files = _tree_files(source, pattern)
    if not files:
        raise FileNotFoundError(f"nothing to stage in {source} ({pattern})")
    final = stage_dir / kind / _digest(files, source)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=final.parent))
    for path in files:
        shutil.copyfile(path, tmp / path.name)
        os.chmod(tmp / path.name, 0o644)
    tmp.chmod(0o755)
    return _publish(tmp, final)


def stage_file(source: Path, stage_dir: Path, kind: str, mode: int = 0o644) -> Path:
    """A copy of one file, as ``<stage_dir>/<kind>/<hash>/<its name>`` with ``mode``
    (the init: 0755, as sandboxes run it as uid 65534)."""
    source = source.resolve()  # the engine follows symlinks when it mounts; so do we
    final_dir = stage_dir / kind / _digest([source], source.parent)
    final = final_dir / source.name
    if final.is_file():
        return final
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=final_dir.parent))
    shutil.copyfile(source, tmp / source.name)
    os.chmod(tmp / source.name, mode)
    tmp.chmod(0o755)
    return _publish(tmp, final_dir) / source.name

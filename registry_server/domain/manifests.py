"""YAML tool manifests: one tool per file, fields as in the Tool message with
``parameters`` as a mapping and ``safety_level`` as safe|cautious|dangerous."""

from __future__ import annotations

from pathlib import Path

import yaml

from registry_server.domain.errors import InvalidDefinition, Violation
from registry_server.domain.models import ToolDefinition, parse_definition

MANIFEST_SUFFIXES = (".yaml", ".yml")
MAX_MANIFEST_BYTES = 256 * 1024  # bytes; a manifest is a definition, not a payload


def load_manifest(path: Path) -> ToolDefinition:
    """Read and validate one manifest; every error names the file."""
    source = f"manifest {path}"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidDefinition(
            [Violation("", f"cannot read: {exc.strerror or exc}")], source
        ) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidDefinition([Violation("", f"larger than {MAX_MANIFEST_BYTES} bytes")], source)
    try:
        raw = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidDefinition(
            [Violation("", f"not valid YAML: {where}{problem}")], source
        ) from None
    if not isinstance(raw, dict):
        raise InvalidDefinition([Violation("", "must be a mapping of tool fields")], source)
    return parse_definition(raw, source=source)


def manifest_paths(target: Path) -> list[Path]:
    """The manifest files of a directory (sorted), or the file itself."""
    if target.is_dir():
        return sorted(p for p in target.iterdir() if p.suffix in MANIFEST_SUFFIXES and p.is_file())
    return [target]


def load_manifests(target: Path) -> list[ToolDefinition]:
    """All manifests under ``target``; fails on the first bad file, naming it,
    before anything is registered."""
    tools = [load_manifest(p) for p in manifest_paths(target)]
    seen: dict[str, int] = {}
    for tool in tools:
        seen[tool.name] = seen.get(tool.name, 0) + 1
    dupes = sorted(n for n, c in seen.items() if c > 1)
    if dupes:
        raise InvalidDefinition(
            [Violation("name", f"{n!r} is defined by more than one file") for n in dupes],
            f"manifests in {target}",
        )
    return tools

"""The import graph reads top to bottom (docs/explanation/architecture.md): each package
imports only itself and the packages below it, no modules import each other
in a cycle, and the store and the sandbox backend are picked in one place."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Bottom to top: a package may import the ones before it in this list.
LAYERS = [
    "domain",
    "signing",
    "policy",
    "store",
    "catalog",
    "approvals",
    "notify",
    "execution",
    "_proto",
    "wire",
    "api",
    "install",
    "client",  # the Python client library and the agent-framework adapters
    "web",  # what the web programs share (listener, Host checks)
    # the programs that are not the server, each in its own room
    "witness",
    "console",
    "mcp",
    "cli",
]
COMPOSITION_ROOT = "registry_server/api/app.py"


# The sources are parsed and walked once per run; every test reads the same nodes.
@functools.cache
def _sources() -> tuple[Path, ...]:
    return tuple(
        sorted(
            p
            for top in ("registry_server", "sandbox_runner")
            for p in (ROOT / top).rglob("*.py")
            # the example tools are programs the images run, not the server's code
            if "_proto" not in p.parts and "examples" not in p.parts
        )
    )


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the module at ``path`` (ast.walk order)."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, anywhere in it (function-level included)."""
    package = _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module(path)
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    modules = {_module(p): p for p in _sources()}
    return {
        name: frozenset(m for m in _imports(path) if m in modules) for name, path in modules.items()
    }


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "registry_server" and len(parts) > 2 else None


def test_every_package_imports_only_itself_and_what_lies_below() -> None:
    upward: list[str] = []
    for module, imported in _graph().items():
        if module.startswith("sandbox_runner"):
            upward += [f"{module} -> {m}" for m in imported if m.startswith("registry_server")]
            continue
        mine = _layer(module)
        if mine is None:
            continue
        assert mine in LAYERS, f"{module}: package '{mine}' has no place in LAYERS"
        for target in imported:
            theirs = _layer(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_modules_import_each_other_in_a_cycle() -> None:
    graph = _graph()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    assert cycles == []


def _names(node: ast.AST) -> Iterator[str]:
    """The names a node uses or defines: imported modules (first part), names, classes."""
    if isinstance(node, ast.alias):
        yield node.name.split(".")[0]
        yield node.name.split(".")[-1]
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.ClassDef):
        yield node.name


@functools.cache
def _names_in(path: Path) -> frozenset[str]:
    return frozenset(name for node in _nodes(path) for name in _names(node))


def _files_mentioning(word: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in _sources() if word in _names_in(p))


def test_only_the_sqlite_store_speaks_sql() -> None:
    assert _files_mentioning("sqlite3") == ["registry_server/store/sqlite.py"]
    sql = [
        str(p.relative_to(ROOT))
        for p in _sources()
        for n in _nodes(p)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and any(k in n.value for k in ("SELECT ", "INSERT INTO", "UPDATE ", "DELETE FROM"))
    ]
    assert set(sql) <= {
        "registry_server/store/sql.py",
        "registry_server/store/sqlite.py",
        "registry_server/store/postgres.py",
    }


def test_only_the_docker_backend_imports_docker() -> None:
    assert _files_mentioning("docker") == ["sandbox_runner/docker_backend.py"]


def test_the_composition_root_alone_picks_the_store_and_the_backend() -> None:
    for implementation, home in (
        ("SqliteStore", "registry_server/store/sqlite.py"),
        ("DockerBackend", "sandbox_runner/docker_backend.py"),
    ):
        users = set(_files_mentioning(implementation)) - {home}
        assert sorted(users) == [COMPOSITION_ROOT], implementation

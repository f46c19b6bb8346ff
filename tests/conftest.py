"""Every test carries the marker of its folder (unit, adapters, integration,
docker, security, robustness, cluster, browser, identity, install), so `-m` and the
folders always agree. Files add only finer markers (load, fault).

What collection imports (the server's modules and the libraries under them)
lives to the end of the run: the garbage collector is off while it is
imported, and it is then frozen out of the collector's passes, which would
otherwise walk all of it again and again (about a quarter of `make unit`'s CPU
time). What the tests themselves make is collected as ever, in fewer passes."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

TIERS = (
    "unit",
    "adapters",
    "integration",
    "docker",
    "security",
    "robustness",
    "cluster",
    "browser",
    "identity",
    "install",
    "docs",
)
HERE = Path(__file__).resolve().parent
GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.resolve().relative_to(HERE).parts[0]
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))


def pytest_sessionstart(session: pytest.Session) -> None:
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    # Fewer, larger passes: with the default 700 allocations a test run makes
    # over a thousand young passes, and each full pass walks what tests keep
    # (e.g. test_architecture's parsed sources); about 5% of `make unit`.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
    gc.enable()

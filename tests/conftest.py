"""Every test carries the marker of its folder (unit, adapters, integration,
docker, security, robustness, cluster, browser, identity, install), so `-m` and the
folders always agree. Files add only finer markers (load, fault).

`make test` runs in two parts (scripts/run_tests.py): first every test not marked
``serial``, in parallel (pytest-xdist, one test file per worker at a time: each
worker has its own session fixtures, base temp dir, container run label and
databases), then the ``serial`` ones alone: those that stop something every test
shares (the Docker engine, the tests' PostgreSQL) or measure time under load, which
other tests' work would distort. ``load`` and ``fault`` tests are serial; a test
marks itself ``serial`` for the same reasons.

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
SERIAL_MARKERS = ("load", "fault")  # markers that make a test serial on their own
# The parallel part hands files to workers in this order of tiers, the slowest
# first, so that no long file starts last; within a tier, files keep their order.
SLOWEST_FIRST = (
    "install", "cluster", "integration", "security", "browser", "docs", "identity",
    "robustness", "docker", "adapters", "unit",
)  # fmt: skip
# Tiers whose files run on one worker: the install tier's session builds the sdist
# and the wheel in the checkout once (two builds at once would race in its egg-info).
ONE_GROUP = ("install",)
HERE = Path(__file__).resolve().parent
GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)


def _tier(item: pytest.Item) -> str:
    return item.path.resolve().relative_to(HERE).parts[0]


def pytest_itemcollected(item: pytest.Item) -> None:
    folder = _tier(item)
    if folder in TIERS:
        item.add_marker(getattr(pytest.mark, folder))
    if any(item.get_closest_marker(name) for name in SERIAL_MARKERS):
        item.add_marker(pytest.mark.serial)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {tier: index for index, tier in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_tier(item), len(rank)))


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a test file (its module fixtures are
    made once), or a whole tier of ONE_GROUP."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 and parts[1] in ONE_GROUP else path


# xdist's own loadgroup cannot be used: it renames items (item._nodeid), which
# pytest 9.2's nodes no longer read, so its groups are silently ignored.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)  # type: ignore[arg-type]


def pytest_sessionstart(session: pytest.Session) -> None:
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()
    # Fewer, larger passes: with the default 700 allocations a test run makes
    # over a thousand young passes, and each full pass walks what tests keep
    # (e.g. test_architecture's parsed sources); about 5% of `make unit`.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
    gc.enable()

"""Every test carries the marker of its folder (unit, adapters, integration,
docker, security, robustness, cluster, browser), so `-m` and the folders always agree. Files add only
finer markers (load, fault)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "adapters", "integration", "docker", "security", "robustness", "cluster", "browser")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.resolve().relative_to(HERE).parts[0]
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))

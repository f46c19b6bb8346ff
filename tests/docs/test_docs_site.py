"""`make check-docs` (part of `make check`) fails when the docs site has a
broken link, a link to a missing anchor, a page left out of the navigation,
or a generated reference page that is stale (docs/explanation/about-these-docs.md).

Each test runs the real target on a copy of mkdocs.yml and docs/ in a
temporary folder (the Makefile's DOCS_CONFIG and DOCS_REFERENCE name it), with
one thing broken, so the checkout is never touched."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".venv/.installed-stamp"  # the Makefile's: never re-installed by these runs


def check_docs(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "-o", STAMP, "check-docs",
         f"DOCS_CONFIG={site / 'mkdocs.yml'}", f"DOCS_REFERENCE={site / 'docs' / 'reference'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture
def site(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_the_docs_as_they_are_pass(site: Path) -> None:
    run = check_docs(site)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "docs/reference is up to date" in run.stdout
    assert "docs site builds (strict)" in run.stdout


def _append(page: str, text: str) -> Callable[[Path], None]:
    def breaks(site: Path) -> None:
        path = site / "docs" / page
        path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")

    return breaks


def _orphan(site: Path) -> None:
    (site / "docs" / "how-to" / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")


def _stale(site: Path) -> None:
    path = site / "docs" / "reference" / "settings.md"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("`TOOLREG_PORT`", "`TOOLREG_PORTE`", 1), encoding="utf-8")


@pytest.mark.parametrize(
    ("breaks", "said"),
    [
        (_append("how-to/install.md", "\n[gone](no-such-page.md)\n"), "no-such-page.md"),
        (_append("how-to/install.md", "\n[gone](deploying.md#no-such-section)\n"),
         "no-such-section"),
        (_orphan, "orphan.md"),
        (_stale, "docs/reference is stale"),
    ],
    ids=["broken-link", "missing-anchor", "page-not-in-nav", "stale-reference"],
)  # fmt: skip
def test_check_docs_fails(site: Path, breaks: Callable[[Path], None], said: str) -> None:
    breaks(site)
    run = check_docs(site)
    assert run.returncode != 0, run.stdout + run.stderr
    assert said in run.stdout + run.stderr

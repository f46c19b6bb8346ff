"""toolreg as users get it: the wheel, built once per run from an sdist of this tree
(so the sdist is shown to build it), installed into a virtual environment outside
the repository, and run from there in empty folders. Nothing here imports the
checkout's code into the installed toolreg, and no test runs it with the
repository as its working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 600  # seconds: sdist + wheel (compiles the init)
INSTALL_TIMEOUT_S = 900  # seconds: the wheel and its dependencies into a new venv
# The dependencies' wheels, kept between runs outside the repository (see ``installed``).
WHEELHOUSE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "toolreg" / "wheelhouse"
)


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path
    head: str  # `git rev-parse HEAD` of the checkout as the build started
    # The wheel built straight from the tree right after (setuptools' build folders in a
    # temporary folder, not the checkout's build/), recording the same revision as
    # ``wheel``: test_wheel.py compares the two.
    tree_wheel: Path


@dataclass(frozen=True)
class Installed:
    """The wheel installed in its own venv; ``run`` starts its `toolreg`."""

    venv: Path
    wheel: Path

    @property
    def toolreg(self) -> Path:
        return self.venv / "bin" / "toolreg"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of an installed toolreg: no PYTHONPATH into the checkout."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TOOLREG_"))}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        return {**env, **extra}

    def run(
        self, *args: str, cwd: Path, timeout: float = 120, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.toolreg), *args], cwd=cwd, env=self.env(**env), capture_output=True,
            text=True, timeout=timeout, check=False,
        )  # fmt: skip


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """`python -m build` of this tree: the sdist, then the wheel built from that sdist."""
    out = tmp_path_factory.mktemp("dist")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("toolreg-*.tar.gz")
    (wheel,) = out.glob("toolreg-*.whl")
    with zipfile.ZipFile(wheel) as z:
        revision = json.loads(z.read("registry_server/_build_info.json"))["revision"]
    return Dist(sdist, wheel, head, _wheel_from_tree(out.parent / "tree", revision))


def _wheel_from_tree(where: Path, revision: str) -> Path:
    where.mkdir()
    extra = where / "setup-extra.cfg"
    extra.write_text(
        f"[build]\nbuild_base = {where / 'build'}\n[egg_info]\negg_base = {where}\n"
        f"[bdist_wheel]\nbdist_dir = {where / 'bdist'}\n"
    )
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(extra), "TOOLREG_REVISION": revision}
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir",
         str(where / "out"), str(ROOT)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (where / "out").glob("toolreg-*.whl")
    return wheel


@pytest.fixture(scope="session")
def installed(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The wheel in a fresh venv in a temporary folder (not the repository's .venv).

    Its dependencies come from a wheelhouse of wheels pip downloaded in an earlier run
    (WHEELHOUSE): pip resolves and installs them offline, all of them into the new venv.
    When that fails (a first run, or a requirement the wheelhouse cannot meet), pip
    downloads what the wheel needs from the configured indexes into it, and installs
    offline again. That saves resolving and downloading about 45 MB on every run."""
    where = tmp_path_factory.mktemp("venv") / "toolreg"
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    pip = [str(where / "bin" / "pip"), "--disable-pip-version-check"]
    offline = [*pip, "install", "--quiet", "--no-index", "--find-links", str(WHEELHOUSE),
               str(dist.wheel)]  # fmt: skip
    proc = _run(offline)
    if proc.returncode != 0:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        fetched = _run([*pip, "download", "--quiet", "--dest", str(WHEELHOUSE), str(dist.wheel)])
        assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
        for own in WHEELHOUSE.glob("toolreg-*"):  # pip download copies the wheel itself too
            own.unlink()
        proc = _run(offline)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield Installed(where, dist.wheel)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
    )

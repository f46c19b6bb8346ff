"""The build steps pyproject.toml cannot say: the sandbox init, compiled from its C
source into the wheel (so the wheel is a platform wheel), and the build's identity
(version and git revision) written beside the package for `toolreg --version`.

Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - older setuptools
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
INIT_SOURCE = Path("sandbox_runner/init/toolreg_init.c")
INIT_BINARY = Path("sandbox_runner/init/toolreg-init")
BUILD_INFO = Path("registry_server/_build_info.json")
# The same flags as the Makefile's `make init`: a static, stripped binary that runs in
# any image (toolreg/base has no libc at all).
INIT_CFLAGS = ["-std=c11", "-Os", "-static", "-s", "-Wall", "-Wextra", "-Werror"]
# A static binary needs no glibc of the host: the oldest manylinux tag fits any Linux
# of the architecture it was compiled for.
PLATFORM_TAGS = {
    "x86_64": "manylinux_2_17_x86_64.manylinux2014_x86_64",
    "aarch64": "manylinux_2_17_aarch64.manylinux2014_aarch64",
}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _revision() -> str:
    """The git commit this build comes from: TOOLREG_REVISION, else git (with
    '-dirty' when tracked files differ from it), else what the sdist recorded."""
    if os.environ.get("TOOLREG_REVISION"):
        return os.environ["TOOLREG_REVISION"]
    commit = _git("rev-parse", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return commit + ("-dirty" if dirty else "")
    recorded = HERE / BUILD_INFO
    if recorded.is_file():  # an sdist carries the revision it was made from
        return str(json.loads(recorded.read_text()).get("revision", "unknown"))
    return "unknown"


def _build_info() -> str:
    return json.dumps({"revision": _revision(), "machine": platform.machine()}) + "\n"


def _compile_init(out: Path) -> None:
    cc = os.environ.get("CC", "gcc")
    libc = subprocess.run([cc, "-print-file-name=libc.a"], capture_output=True, text=True)
    if shutil.which(cc) is None or not libc.stdout.strip().startswith("/"):
        raise SystemExit(
            f"building the sandbox init needs {cc} and a static libc"
            " (Debian: apt-get install gcc libc6-dev)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([cc, *INIT_CFLAGS, "-o", str(tmp), str(HERE / INIT_SOURCE)], check=True)
    tmp.chmod(0o755)  # o+x: containers run it as uid 65534
    tmp.replace(out)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # a checkout builds its init with `make init`, in place
        _compile_init(Path(self.build_lib) / INIT_BINARY)
        (Path(self.build_lib) / BUILD_INFO).write_text(_build_info())


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / BUILD_INFO
        target.unlink(missing_ok=True)  # may be a hard link to a checkout's file
        target.write_text(_build_info())


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True  # it carries a compiled program: a platform wheel, installed to platlib


class BdistWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        machine = platform.machine()
        if machine not in PLATFORM_TAGS:
            raise SystemExit(f"no wheel tag for this architecture: {machine}")
        return "py3", "none", PLATFORM_TAGS[machine]


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPy, "sdist": Sdist, "bdist_wheel": BdistWheel},
)

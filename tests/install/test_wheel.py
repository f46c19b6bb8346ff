"""The sdist and the wheel as files: what they carry, that PyPI's checks pass, that the
sdist builds the same wheel as the tree, and that the installed package is the wheel's
own code, not the checkout's."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.install.conftest import BUILD_TIMEOUT_S, ROOT, Dist, Installed

# The installed fixture builds and installs once per run; its first user waits for it.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)

INIT = "sandbox_runner/init/toolreg-init"
IMAGE_CONTEXT = [
    "sandbox_runner/images/build.sh",
    "sandbox_runner/images/debian.sh",
    "sandbox_runner/images/base/Dockerfile",
    "sandbox_runner/images/python/Dockerfile",
]
EXAMPLE_TOOLS = "registry_server/examples/tools/"
BUILD_INFO = "registry_server/_build_info.json"
# e_machine of an ELF header (the ELF spec's registry) for the machines the wheel is built on.
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
PT_INTERP = 3  # a program header asking for a dynamic loader: a static init has none
WHEEL_NAME = re.compile(r"^toolreg-(?P<version>[^-]+)-py3-none-(?P<platform>[^-]+)\.whl$")


def _members(wheel: Path) -> dict[str, zipfile.ZipInfo]:
    with zipfile.ZipFile(wheel) as z:
        return {info.filename: info for info in z.infolist()}


def _version() -> str:
    """registry_server.__version__ as the checkout says it (pyproject reads it from there)."""
    text = (ROOT / "registry_server" / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match, "registry_server/__init__.py has no __version__"
    return match.group(1)


def _elf(data: bytes) -> tuple[int, int, list[int]]:
    """(EI_CLASS, e_machine, program header types) of a little-endian ELF."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[5] == 1, "not little-endian"
    ei_class = data[4]
    assert ei_class == 2, "not a 64-bit ELF"
    e_machine = int.from_bytes(data[18:20], "little")
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    types = [
        int.from_bytes(data[phoff + i * phentsize : phoff + i * phentsize + 4], "little")
        for i in range(phnum)
    ]
    return ei_class, e_machine, types


def test_twine_check_passes_on_the_sdist_and_the_wheel(dist: Dist) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_the_wheel_is_a_manylinux_wheel_of_this_version_for_this_machine(dist: Dist) -> None:
    match = WHEEL_NAME.match(dist.wheel.name)
    assert match, dist.wheel.name
    assert match["version"] == _version()
    tags = match["platform"].split(".")
    assert all(re.fullmatch(rf"manylinux(_\d+_\d+|\d+)_{platform.machine()}", t) for t in tags)
    with zipfile.ZipFile(dist.wheel) as z:
        wheel_meta = z.read(f"toolreg-{_version()}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in wheel_meta
    assert {f"Tag: py3-none-{t}" for t in tags} <= set(wheel_meta.splitlines())


def test_the_wheel_carries_a_static_executable_init_for_this_machine(dist: Dist) -> None:
    info = _members(dist.wheel)[INIT]
    mode = info.external_attr >> 16
    assert stat.S_ISREG(mode) and mode & 0o111 == 0o111, oct(mode)  # o+x: uid 65534 runs it
    with zipfile.ZipFile(dist.wheel) as z:
        data = z.read(INIT)
    _, e_machine, program_headers = _elf(data)
    assert e_machine == ELF_MACHINE[platform.machine()]
    assert PT_INTERP not in program_headers, "the init is dynamically linked"


def test_the_wheel_carries_image_contexts_example_tools_and_its_build_info(dist: Dist) -> None:
    names = set(_members(dist.wheel))
    assert set(IMAGE_CONTEXT) <= names
    tools = {Path(n).name for n in names if n.startswith(EXAMPLE_TOOLS)}
    for tool in ("echo", "word_count", "run_python", "write_file"):
        assert f"{tool}.yaml" in tools
    for program in ("word_count.py", "run_python.py", "write_file.py"):
        assert program in tools
    with zipfile.ZipFile(dist.wheel) as z:
        build_info = json.loads(z.read(BUILD_INFO))
        build_sh_mode = z.getinfo("sandbox_runner/images/build.sh").external_attr >> 16
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", build_info["revision"]), build_info
    assert build_info["machine"] == platform.machine()
    assert stat.S_ISREG(build_sh_mode)


def test_the_sdist_carries_the_init_source_not_a_binary(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        source = tar.extractfile(f"toolreg-{_version()}/sandbox_runner/init/toolreg_init.c")
        assert source is not None
        assert source.read() == (ROOT / "sandbox_runner/init/toolreg_init.c").read_bytes()
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", BUILD_INFO} <= names
    assert set(IMAGE_CONTEXT) <= names
    assert INIT not in names


def _contents(wheel: Path) -> dict[str, tuple[str, int]]:
    """What 'the same wheel' means here: the same member names, each with the same bytes
    (sha256) and the same permission bits. The zip's own timestamps and member order
    are not compared (they come from file times); RECORD is, as it lists every hash."""
    with zipfile.ZipFile(wheel) as z:
        return {
            info.filename: (hashlib.sha256(z.read(info)).hexdigest(), info.external_attr >> 16)
            for info in z.infolist()
        }


def test_the_sdist_builds_the_same_wheel_as_the_tree(dist: Dist) -> None:
    """The session's wheel (from the sdist) against one built straight from the tree just
    after it. The tree's build is told the revision the sdist recorded, so a commit landing
    between the two builds cannot make them differ; that revision is checked against git
    in the --version test."""
    assert dist.wheel.name == dist.tree_wheel.name
    a, b = _contents(dist.wheel), _contents(dist.tree_wheel)
    assert sorted(a) == sorted(b)
    assert {n: (a[n], b[n]) for n in a if a[n] != b[n]} == {}
    assert INIT in a and f"toolreg-{_version()}.dist-info/RECORD" in a


def test_the_installed_package_is_the_wheels_not_the_checkouts(
    installed: Installed, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [str(installed.python), "-c",
         "import json, registry_server, sandbox_runner\n"
         "from registry_server.install import packaged\n"
         "print(json.dumps([registry_server.__file__, sandbox_runner.__file__,"
         " str(packaged.EXAMPLE_TOOLS_DIR), str(packaged.BUILD_SCRIPT),"
         " str(packaged.INIT_BINARY)]))"],
        cwd=tmp_path, env=installed.env(), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    paths = [Path(p) for p in json.loads(proc.stdout)]
    site = installed.venv.resolve()
    for path in paths:
        assert path.resolve().is_relative_to(site), path
        assert not path.resolve().is_relative_to(ROOT), path
        assert path.exists(), path
    init = paths[-1]
    assert os.access(init, os.X_OK)
    assert init.stat().st_mode & 0o005 == 0o005  # others may read and run it (uid 65534)


def test_version_names_the_version_and_the_revision_it_was_built_from(
    dist: Dist, installed: Installed, tmp_path: Path
) -> None:
    out = installed.run("--version", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    match = re.fullmatch(r"toolreg (\S+) \(revision ([0-9a-f]{40})(-dirty)?\)\n", out.stdout)
    assert match, out.stdout
    assert match[1] == _version()
    with zipfile.ZipFile(dist.wheel) as z:
        recorded = json.loads(z.read(BUILD_INFO))["revision"]
    assert f"{match[2]}{match[3] or ''}" == recorded
    # HEAD of the checkout as the session's build started ('-dirty': tracked files differed).
    assert match[2] == dist.head

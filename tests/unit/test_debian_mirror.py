"""The image build takes debootstrap's mirror from the machine's apt sources
(sandbox_runner/images/debian.sh ``debian_mirror``, as images/build.sh calls it), one-line
.list files and deb822 .sources alike, and with none stops saying what to
set. Sample sources in a temporary directory; no debootstrap runs. The
build's own source names no mirror host."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "sandbox_runner" / "images" / "debian.sh"

# The machine's own files as Debian 12 writes them (deb822), with a third-party
# repository and the security archive beside the main one.
DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.one.test/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.one.test/debian-security
Suites: bookworm-security
Components: main
"""
THIRD_PARTY = """\
Types: deb
URIs: https://repo.vendor.test/apt
Suites: nodistro
Components: main
"""


def mirror(apt: Path, suite: str = "bookworm") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", 'source "$0"; debian_mirror "$1" "$2"', str(LIBRARY), str(apt), suite],
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip


def apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"sources.list.d/a-vendor.sources": THIRD_PARTY, "sources.list.d/debian.sources": DEB822},
         "http://mirror.one.test/debian"),
        ({"sources.list": "# deb http://old.test/debian bookworm main\n"
                          "deb [arch=amd64 signed-by=/k.gpg] http://mirror.two.test/debian/ bookworm main\n"
                          "deb http://mirror.two.test/debian-security bookworm-security main\n"},
         "http://mirror.two.test/debian"),
        ({"sources.list.d/vendor.list": "deb https://repo.vendor.test/apt stable main\n",
          "sources.list.d/z.list": "deb-src http://src.test/debian bookworm main\n"
                                   "deb http://mirror.three.test/debian bookworm main\n"},
         "http://mirror.three.test/debian"),
        ({"sources.list.d/debian.sources": DEB822.replace("Types: deb\n", "Types: deb\nEnabled: no\n", 1)
                                           + "\nTypes: deb\nURIs: http://mirror.four.test/debian\n"
                                             "Suites: bookworm\nComponents: main\n"},
         "http://mirror.four.test/debian"),
        ({"sources.list.d/debian.sources": "Types: deb deb-src\nURIs:\n http://mirror.five.test/archive/\n"
                                           "Suites:\n bookworm\nComponents: main\n"},
         "http://mirror.five.test/archive"),
        ({"sources.list.d/debian.sources": DEB822.replace("bookworm bookworm-updates", "trixie")},
         "http://mirror.one.test/debian"),
    ],
    ids=["deb822 beside a vendor", "one-line with options", ".list files in order",
         "a disabled stanza", "folded fields, no /debian path", "another suite: a /debian path"],
)  # fmt: skip
def test_the_machines_debian_mirror_is_found(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    ran = mirror(apt_dir(tmp_path, files))
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, expected + "\n", "")


@pytest.mark.parametrize(
    "files",
    [{}, {"sources.list.d/vendor.sources": THIRD_PARTY},
     {"sources.list": "deb-src http://mirror.test/debian bookworm main\n"}],
    ids=["no sources", "only a vendor's", "only source packages"],
)  # fmt: skip
def test_without_one_it_says_what_to_set(tmp_path: Path, files: dict[str, str]) -> None:
    ran = mirror(apt_dir(tmp_path, files))
    assert ran.returncode == 1 and ran.stdout == ""
    assert "no Debian mirror for 'bookworm'" in ran.stderr
    assert "Set TOOLREG_DEBIAN_MIRROR" in ran.stderr


def test_the_build_names_no_mirror_host() -> None:
    host = re.compile(r"\b[\w.-]+\.(debian|ubuntu)\.(org|com|net)\b|ftp\.\w+\.debian")
    for path in [ROOT / "sandbox_runner" / "images" / "build.sh", LIBRARY]:
        found = [line for line in path.read_text().splitlines() if host.search(line)]
        assert found == [], path

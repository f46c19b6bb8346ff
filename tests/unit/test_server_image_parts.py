"""The server image's parts that need no engine: staged mounts (api/staging.py and the
app's use of them), the health probe's address, and the image build's metadata, labels
and SBOM shaping (install/server_image.py)."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from registry_server.api import staging
from registry_server.api.app import _staged
from registry_server.api.config import ServerConfig
from registry_server.client.health_probe import health_address
from registry_server.install.server_image import (
    SBOM_IN_IMAGE,
    SBOM_LABEL,
    HostLibrary,
    RootFacts,
    ServerImageError,
    WheelInfo,
    image_sbom,
    labels,
    wheel_sbom,
)
from sandbox_runner.egress.gateway import PROXY_PACKAGE_DIR


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_staged_file_is_a_copy_named_by_its_content(tmp_path: Path) -> None:
    src = tmp_path / "toolreg-init"
    src.write_bytes(b"v1")
    stage = tmp_path / "data" / "stage"
    first = staging.stage_file(src, stage, "init", mode=0o755)
    assert first.read_bytes() == b"v1" and first.name == "toolreg-init"
    assert stage in first.parents and _mode(first) == 0o755 and _mode(first.parent) == 0o755
    assert staging.stage_file(src, stage, "init", mode=0o755) == first  # idempotent
    src.write_bytes(b"v2")
    second = staging.stage_file(src, stage, "init", mode=0o755)
    # A new init gets a new directory: a container still mounting the old one keeps it.
    assert second != first and first.read_bytes() == b"v1" and second.read_bytes() == b"v2"
    assert not list((stage / "init").glob(".staging-*"))


def test_a_staged_tree_copies_the_files_readable_by_others(tmp_path: Path) -> None:
    src = tmp_path / "pkg"
    (src / "__pycache__").mkdir(parents=True)
    (src / "a.py").write_text("A = 1\n")
    (src / "b.py").write_text("B = 2\n")
    (src / "a.py").chmod(0o600)
    (src / "__pycache__" / "a.pyc").write_bytes(b"x")
    staged = staging.stage_tree(src, tmp_path / "stage", "egress-proxy")
    assert sorted(p.name for p in staged.iterdir()) == ["a.py", "b.py"]
    assert _mode(staged / "a.py") == 0o644 and _mode(staged) == 0o755
    assert staging.stage_tree(src, tmp_path / "stage", "egress-proxy") == staged
    with pytest.raises(FileNotFoundError):
        staging.stage_tree(src / "__pycache__", tmp_path / "stage", "x")


def test_stage_mounts_puts_what_the_engine_mounts_under_the_data_dir(tmp_path: Path) -> None:
    init = tmp_path / "image" / "toolreg-init"
    init.parent.mkdir()
    init.write_bytes(b"\x7fELF init")
    init.chmod(0o700)  # staged 0755 whatever the source's mode: sandboxes run it as 65534
    ca = tmp_path / "image" / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    data = tmp_path / "data"
    config = ServerConfig(data_dir=data, init_path=init, egress_upstream_ca=ca, stage_mounts=True)
    mounted = _staged(config)
    for path in (mounted.init, mounted.proxy_dir, mounted.upstream_ca):
        assert data / "stage" in path.parents, path
    assert mounted.init.read_bytes() == init.read_bytes() and _mode(mounted.init) == 0o755
    assert mounted.upstream_ca.read_text() == ca.read_text()
    assert (mounted.proxy_dir / "proxy.py").read_bytes() == (
        PROXY_PACKAGE_DIR / "proxy.py"
    ).read_bytes()


def test_stage_mounts_leaves_a_missing_file_to_the_check_that_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "toolreg-init"
    config = ServerConfig(
        data_dir=tmp_path / "data", init_path=missing, stage_mounts=True,
        egress_upstream_ca=tmp_path / "no-ca.crt",
    )  # fmt: skip
    mounted = _staged(config)
    assert mounted.init == missing and mounted.upstream_ca == tmp_path / "no-ca.crt"


def test_stage_mounts_is_off_by_default() -> None:
    assert ServerConfig().stage_mounts is False and ServerConfig().health_port is None


@pytest.mark.parametrize(
    ("env", "address"),
    [
        ({"TOOLREG_HEALTH_PORT": "50052"}, "127.0.0.1:50052"),
        ({"TOOLREG_HEALTH_PORT": "9", "TOOLREG_HEALTH_HOST": "0.0.0.0"}, "127.0.0.1:9"),
        ({"TOOLREG_HEALTH_PORT": "9", "TOOLREG_HEALTH_HOST": "::1"}, "[::1]:9"),
        ({"TOOLREG_HEALTH_PORT": "9", "TOOLREG_HEALTH_HOST": "10.0.0.7"}, "10.0.0.7:9"),
    ],
)
def test_the_probe_asks_the_configured_health_port(env: dict[str, str], address: str) -> None:
    assert health_address(env) == address


def test_the_probe_needs_a_health_port() -> None:
    with pytest.raises(ValueError, match="TOOLREG_HEALTH_PORT"):
        health_address({})


# ------------------------------------------------------------------ the image build


def _wheel(tmp_path: Path) -> Path:
    path = tmp_path / "toolreg-9.8.7-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            "toolreg-9.8.7.dist-info/METADATA",
            "Metadata-Version: 2.4\nName: toolreg\nVersion: 9.8.7\n"
            "License-Expression: Apache-2.0\n"
            "Project-URL: Source, https://example.org/toolreg\n"
            "Project-URL: Changelog, https://example.org/toolreg/CHANGELOG.md\n",
        )
        zf.writestr("registry_server/_build_info.json", json.dumps({"revision": "abc123"}))
    return path


ROOT = RootFacts(
    image_id="sha256:" + "1" * 64, recipe="debootstrap bookworm", python="3.11",
    python_full="3.11.2", libc="2.36", machine="x86_64",
    busybox="BusyBox v1.35.0 (Debian 1:1.35.0-4+b3) multi-call binary.",
    libs=(("/usr/lib/x86_64-linux-gnu/libc.so.6", "c" * 64),),
    lib_names=frozenset({"libc.so.6"}), libdir="/usr/lib/x86_64-linux-gnu",
)  # fmt: skip

SITE_BOM = {
    "bomFormat": "CycloneDX",
    "specVersion": "1.6",
    "metadata": {},
    "components": [
        {"type": "library", "bom-ref": "toolreg==9.8.7", "name": "toolreg", "version": "9.8.7"},
        {"type": "library", "bom-ref": "grpcio==1.85.1", "name": "grpcio", "version": "1.85.1"},
    ],
    "dependencies": [{"ref": "toolreg==9.8.7", "dependsOn": ["grpcio==1.85.1"]}],
}


def test_the_wheel_names_its_version_revision_source_and_license(tmp_path: Path) -> None:
    info = WheelInfo.read(_wheel(tmp_path))
    assert (info.name, info.version, info.revision) == ("toolreg", "9.8.7", "abc123")
    assert info.source == "https://example.org/toolreg" and info.license == "Apache-2.0"
    bad = tmp_path / "not.whl"
    bad.write_bytes(b"no zip")
    with pytest.raises(ServerImageError, match="not a toolreg wheel"):
        WheelInfo.read(bad)


def test_labels_name_version_revision_source_and_where_the_sbom_is(tmp_path: Path) -> None:
    got = labels(WheelInfo.read(_wheel(tmp_path)), ROOT)
    assert got["org.opencontainers.image.version"] == "9.8.7"
    assert got["org.opencontainers.image.revision"] == "abc123"
    assert got["org.opencontainers.image.source"] == "https://example.org/toolreg"
    assert got["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert got["org.opencontainers.image.base.digest"] == ROOT.image_id
    assert got[SBOM_LABEL] == SBOM_IN_IMAGE
    assert "org.opencontainers.image.created" not in got  # reproducible labels


def test_platforms_run_from_manylinux2014_to_the_roots_glibc() -> None:
    tags = ROOT.platforms
    assert tags[0] == "manylinux2014_x86_64" and tags[-1] == "manylinux_2_36_x86_64"
    assert "manylinux_2_28_x86_64" in tags


def test_the_wheel_sbom_has_toolreg_as_its_subject(tmp_path: Path) -> None:
    bom = wheel_sbom(SITE_BOM, WheelInfo.read(_wheel(tmp_path)))
    assert bom["metadata"]["component"]["name"] == "toolreg"
    assert [c["name"] for c in bom["components"]] == ["grpcio"]
    assert SITE_BOM["components"][0]["type"] == "library"  # the input is left alone


def test_the_image_sbom_lists_the_python_set_the_root_and_host_libraries(
    tmp_path: Path,
) -> None:
    lib = HostLibrary(
        "libstdc++.so.6", Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"), "d" * 64,
        "libstdc++6", "12.2.0-14",
    )  # fmt: skip
    bom = image_sbom(
        SITE_BOM, WheelInfo.read(_wheel(tmp_path)), ROOT, "toolreg/server:9.8.7", [lib]
    )
    subject = bom["metadata"]["component"]
    assert subject["type"] == "container" and subject["version"] == "9.8.7"
    names = [c["name"] for c in bom["components"]]
    assert {"toolreg", "grpcio", "toolreg/python-root", "libstdc++6"} <= set(names)
    (root,) = [c for c in bom["components"] if c["name"] == "toolreg/python-root"]
    assert {"cpython", "busybox"} <= {c["name"] for c in root["components"]}
    (added,) = [c for c in bom["components"] if c["name"] == "libstdc++6"]
    assert added["purl"] == "pkg:deb/debian/libstdc++6@12.2.0-14"
    refs = [c["bom-ref"] for c in bom["components"]] + [
        c["bom-ref"] for c in root["components"]
    ] + [subject["bom-ref"]]  # fmt: skip
    assert len(refs) == len(set(refs))  # CycloneDX: every bom-ref once
    (image_deps,) = [d for d in bom["dependencies"] if d["ref"] == subject["bom-ref"]]
    assert set(image_deps["dependsOn"]) <= set(refs)


def test_a_build_without_cyclonedx_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from registry_server.install import server_image

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "cyclonedx_py" else real(name)
    )
    with pytest.raises(ServerImageError, match=r"pip install cyclonedx-bom"):
        server_image.build_server_image(_wheel(tmp_path), engine_cli="/nonexistent/docker")

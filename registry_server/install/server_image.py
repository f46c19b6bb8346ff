"""The server image, toolreg/server:<version>: a wheel installed on the Debian root the
sandbox images use (toolreg/python-root), built with nothing pulled, plus CycloneDX
SBOMs of the wheel's dependency set and of the image (docs/how-to/deploying.md, "The server
image").

The root has python3 but no pip, and the build runs nothing inside it: pip on this host
installs the wheel and its dependencies into a staging directory (``--target``) for the
root's interpreter and glibc, which the build context COPYs in. Binary wheels only:
nothing is compiled for a machine other than the one it runs on.
"""

from __future__ import annotations

import email.parser
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from registry_server.install.images import ROOT_IMAGE
from registry_server.install.packaged import IMAGES_DIR

SERVER_REPOSITORY: Final = "toolreg/server"
SERVER_CONTEXT: Final = IMAGES_DIR / "server"  # the Dockerfile and the `toolreg` launcher
SERVER_UID: Final = 10001  # the image's user (and group): not root, not a sandbox's 65534
SBOM_IN_IMAGE: Final = "/usr/share/toolreg/sbom.cdx.json"
SBOM_LABEL: Final = "io.toolreg.sbom"  # where the image keeps its SBOM
CDX_SPEC: Final = "1.6"  # CycloneDX spec version of both SBOMs
PIP_TIMEOUT_S: Final = 900  # seconds: resolving and fetching the dependencies
SBOM_TIMEOUT_S: Final = 300  # seconds: cyclonedx-py over the staged site
DOCKER_TIMEOUT_S: Final = 600  # seconds: one docker build or inspection
# The oldest manylinux tag pip may take; the newest is the root's own glibc.
MIN_GLIBC_MINOR: Final = 17

# Run in the root (no network, read-only) to learn what to build for and what it holds.
_ROOT_FACTS: Final = r"""
import hashlib, json, os, platform, subprocess, sys
libs, names, libdir = [], [], ""
for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
    if os.path.isdir(d):
        libdir = libdir or d
        for n in sorted(os.listdir(d)):
            p = os.path.join(d, n)
            names.append(n)
            if ".so" in n and os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    libs.append([p, hashlib.sha256(f.read()).hexdigest()])
busybox = subprocess.run(["busybox"], capture_output=True, text=True).stdout.split("\n")[0]
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2], "python_full": platform.python_version(),
    "libc": platform.libc_ver()[1], "machine": platform.machine(), "busybox": busybox,
    "libs": libs, "names": names, "libdir": libdir,
}))
"""


class ServerImageError(Exception):
    """A step of the build failed; the message names the step and its fix."""


@dataclass(frozen=True)
class WheelInfo:
    path: Path
    name: str
    version: str
    revision: str
    source: str  # the project's Source URL
    license: str  # SPDX expression

    @classmethod
    def read(cls, wheel: Path) -> WheelInfo:
        """The wheel's own metadata and build info, never the installed toolreg's."""
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = zf.namelist()
                meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
                meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
                try:
                    build = json.loads(zf.read("registry_server/_build_info.json"))
                except KeyError:
                    build = {}
        except (OSError, zipfile.BadZipFile, StopIteration) as exc:
            raise ServerImageError(f"{wheel}: not a toolreg wheel ({exc})") from None
        urls: dict[str, str] = {}
        for entry in meta.get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            urls[label.strip()] = url.strip()
        return cls(
            path=wheel,
            name=meta["Name"],
            version=meta["Version"],
            revision=str(build.get("revision", "unknown")),
            source=urls.get("Source", ""),
            license=meta.get("License-Expression") or meta.get("License") or "",
        )


@dataclass(frozen=True)
class RootFacts:
    """What the root image is: its id, recipe, interpreter, glibc and libraries."""

    image_id: str
    recipe: str
    python: str  # "3.11"
    python_full: str  # "3.11.2"
    libc: str  # "2.36"
    machine: str  # "x86_64"
    busybox: str
    libs: tuple[tuple[str, str], ...]  # (path, sha256)
    lib_names: frozenset[str]  # every name in its library directory, links included
    libdir: str  # "/usr/lib/x86_64-linux-gnu"

    def lib_hash(self, name: str) -> str:
        return next((h for p, h in self.libs if p.rsplit("/", 1)[-1] == name), "")

    @property
    def platforms(self) -> list[str]:
        """manylinux tags this root runs: from manylinux2014 (2.17) up to its glibc."""
        major, minor = (int(x) for x in self.libc.split(".")[:2])
        if major != 2 or minor < MIN_GLIBC_MINOR:
            raise ServerImageError(f"{ROOT_IMAGE}: glibc {self.libc} is older than 2.17")
        tags = [f"manylinux2014_{self.machine}"]
        tags += [f"manylinux_2_{m}_{self.machine}" for m in range(MIN_GLIBC_MINOR, minor + 1)]
        return tags


@dataclass(frozen=True)
class ServerImage:
    tags: tuple[str, ...]
    image_id: str
    wheel: WheelInfo
    wheel_sbom: Path  # the wheel's dependency set, beside the wheel
    image_sbom: Path  # the image's, also at SBOM_IN_IMAGE inside it
    seconds: float


Log = Callable[[str], None]


def _run(
    args: Sequence[str], what: str, timeout: float, fix: str = "", **kw: Any
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, check=False, **kw
        )
    except FileNotFoundError:
        raise ServerImageError(f"{what}: {args[0]} not found{'; ' + fix if fix else ''}") from None
    except subprocess.TimeoutExpired:
        raise ServerImageError(f"{what}: no result in {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        raise ServerImageError(
            f"{what} failed (exit {done.returncode}){'; ' + fix if fix else ''}:\n"
            + "\n".join(tail)
        )
    return done


def root_facts(engine_cli: str = "docker") -> RootFacts:
    """Inspect the root image (it must exist: `toolreg images build` makes it)."""
    fix = "build it with `toolreg images build` (or `make images`)"
    inspected = _run(
        [engine_cli, "image", "inspect", "-f", "{{json .}}", ROOT_IMAGE],
        f"inspecting {ROOT_IMAGE}", DOCKER_TIMEOUT_S, fix,
    )  # fmt: skip
    image = json.loads(inspected.stdout)
    labels = (image.get("Config") or {}).get("Labels") or {}
    # Its own python, with no network and nothing writable: reads files, prints JSON.
    ran = _run(
        [engine_cli, "run", "--rm", "--network", "none", "--read-only", "--user", "65534:65534",
         "--cap-drop", "ALL", "--security-opt", "no-new-privileges", ROOT_IMAGE,
         "python3", "-I", "-c", _ROOT_FACTS],
        f"asking {ROOT_IMAGE} for its python and glibc", DOCKER_TIMEOUT_S, fix,
    )  # fmt: skip
    facts = json.loads(ran.stdout)
    return RootFacts(
        image_id=str(image["Id"]),
        recipe=str(labels.get("io.toolreg.recipe", "")),
        python=facts["python"],
        python_full=facts["python_full"],
        libc=facts["libc"],
        machine=facts["machine"],
        busybox=facts["busybox"],
        libs=tuple((p, h) for p, h in facts["libs"]),
        lib_names=frozenset(facts["names"]),
        libdir=facts["libdir"],
    )


@dataclass(frozen=True)
class HostLibrary:
    """A shared library the wheels load that the slim root lacks, taken from this host."""

    soname: str
    path: Path  # the real file on this host
    sha256: str
    package: str  # its Debian package and version here ("" when dpkg cannot tell)
    version: str


def _needed_from_host(site: Path, root: RootFacts) -> list[HostLibrary]:
    """Libraries the staged extension modules load from the system (not vendored in
    their wheels' .libs) that the root does not have: manylinux lets wheels expect
    libstdc++, libgcc_s, librt, libdl and libpthread of the system, and the root kept
    only what python3 itself loads. They are taken from this host only when its glibc
    is the root's very build (same libc.so.6), so they match the root's libc."""
    wanted: dict[str, Path] = {}
    for module in sorted(site.rglob("*.so*")):
        if not module.is_file() or module.is_symlink():
            continue
        try:
            done = subprocess.run(["ldd", str(module)], capture_output=True, text=True,
                                  timeout=60, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ServerImageError(
                f"ldd {module.name}: {exc}; the build needs glibc's ldd (Debian: libc-bin)"
            ) from None
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
                name, path = parts[0], Path(parts[2])
                if site in path.parents or name in root.lib_names:
                    continue
                wanted.setdefault(name, path)
            elif len(parts) >= 3 and parts[1] == "=>" and parts[2] == "not":
                raise ServerImageError(f"{module.name} needs {parts[0]}, found nowhere")
    if not wanted:
        return []
    host_libc = Path("/lib") / Path(root.libdir).name / "libc.so.6"
    try:
        same = _sha256(host_libc) == root.lib_hash("libc.so.6")
    except OSError:
        same = False
    if not same:
        raise ServerImageError(
            f"the wheels need {', '.join(sorted(wanted))}, which {ROOT_IMAGE} lacks; they"
            " are taken from the build host only when its glibc is the root's (build on"
            " the Debian release of the root, e.g. bookworm)"
        )
    found = []
    for name, path in sorted(wanted.items()):
        real = path.resolve()
        package, version = _dpkg_owner(real)
        found.append(HostLibrary(name, real, _sha256(real), package, version))
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dpkg_owner(path: Path) -> tuple[str, str]:
    """(package, version) that installed ``path`` on this host, or ("", "")."""
    for candidate in (str(path), str(path).removeprefix("/usr")):
        try:
            owner = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True,
                                   text=True, timeout=30, check=False)  # fmt: skip
        except OSError:
            return "", ""
        if owner.returncode == 0:
            package = owner.stdout.split(":", 1)[0].strip()
            version = subprocess.run(
                ["dpkg-query", "-W", "-f", "${Version}", package],
                capture_output=True, text=True, timeout=30, check=False,
            ).stdout.strip()  # fmt: skip
            return package, version
    return "", ""


def _pip_install(wheel: Path, site: Path, root: RootFacts, log: Log) -> None:
    """The wheel and its dependencies, for the root's interpreter, into ``site``."""
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    args = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--no-input", "--target", str(site), "--only-binary=:all:",
        "--implementation", "cp", "--python-version", root.python,
        "--abi", f"cp{root.python.replace('.', '')}",
        *(f"--platform={tag}" for tag in root.platforms),
    ]  # fmt: skip
    if host != root.python:
        # Byte code compiled here would be another version's (ignored there): skip it.
        args.append("--no-compile")
    log(f"installing {wheel.name} and its dependencies for python {root.python} ...")
    _run([*args, str(wheel)], "pip install --target", PIP_TIMEOUT_S,
         "the build needs pip and an index (PyPI or PIP_INDEX_URL) with binary wheels")  # fmt: skip
    # pip's console scripts name this host's interpreter; the image has its own launcher.
    shutil.rmtree(site / "bin", ignore_errors=True)


def _cyclonedx(site: Path) -> dict[str, Any]:
    """cyclonedx-py over the staged site alone: -S keeps the interpreter's own site
    packages out, PYTHONPATH puts the staged ones in."""
    out = site.parent / "site.cdx.json"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "LANG": "C.UTF-8"}
    _run(
        [sys.executable, "-m", "cyclonedx_py", "environment", "-S", "--output-reproducible",
         "--sv", CDX_SPEC, "--of", "JSON", "-o", str(out), sys.executable],
        "cyclonedx-py environment", SBOM_TIMEOUT_S,
        "install cyclonedx-bom beside toolreg (pip install cyclonedx-bom)", env=env,
    )  # fmt: skip
    bom: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return bom


def wheel_sbom(site_bom: dict[str, Any], wheel: WheelInfo) -> dict[str, Any]:
    """The wheel as the BOM's subject, its resolved dependencies as the components."""
    bom: dict[str, Any] = json.loads(json.dumps(site_bom))  # a deep copy
    components = bom.get("components", [])
    ours = [c for c in components if c.get("name") == wheel.name]
    if len(ours) != 1:
        raise ServerImageError(f"the SBOM lists {wheel.name} {len(ours)} times, not once")
    main = ours[0]
    main["type"] = "application"
    bom["components"] = [c for c in components if c is not main]
    bom.setdefault("metadata", {})["component"] = main
    return bom


def image_sbom(
    site_bom: dict[str, Any],
    wheel: WheelInfo,
    root: RootFacts,
    tag: str,
    host_libs: Sequence[HostLibrary] = (),
) -> dict[str, Any]:
    """The image as the subject: the Python set (the wheel among it), the root (its
    interpreter, busybox and the shared libraries it carries, by file hash: the root was
    slimmed from a debootstrap without dpkg's records, so no Debian package versions),
    and the libraries added from the build host's Debian packages (with versions)."""
    bom: dict[str, Any] = json.loads(json.dumps(site_bom))
    root_ref = f"{ROOT_IMAGE}@{root.image_id}"
    image_ref = f"{tag}"
    root_parts: list[dict[str, Any]] = [
        {
            "type": "application",
            "bom-ref": f"cpython@{root.python_full}",
            "name": "cpython",
            "version": root.python_full,
            "description": "python3 of the root, from Debian (its standard library less"
            " test, idlelib, tkinter, turtledemo, ensurepip, lib2to3, pydoc_data)",
            "purl": f"pkg:generic/cpython@{root.python_full}",
        },
        {
            "type": "application",
            "bom-ref": "busybox",
            "name": "busybox",
            "version": root.busybox.split(" ")[1].lstrip("v") if " " in root.busybox else "",
            "description": root.busybox,
        },
        *(
            {
                "type": "file",
                "bom-ref": f"file:{path}",
                "name": path,
                "hashes": [{"alg": "SHA-256", "content": digest}],
            }
            for path, digest in root.libs
        ),
    ]
    root_component = {
        "type": "container",
        "bom-ref": root_ref,
        "name": ROOT_IMAGE.split(":")[0],
        "version": root.image_id,
        "description": f"the Debian root of the sandbox images: {root.recipe}",
        "components": root_parts,
    }
    added: list[dict[str, Any]] = [
        {
            "type": "library",
            "bom-ref": f"host-lib:{lib.soname}",
            "name": lib.package or lib.soname,
            "version": lib.version,
            "description": f"{lib.soname} from the build host's Debian, at"
            f" {root.libdir}/{lib.soname}",
            "hashes": [{"alg": "SHA-256", "content": lib.sha256}],
            **(
                {"purl": f"pkg:deb/debian/{lib.package}@{lib.version}"}
                if lib.package and lib.version
                else {}
            ),
        }
        for lib in host_libs
    ]
    bom["components"] = [*bom.get("components", []), root_component, *added]
    py_refs = [c["bom-ref"] for c in site_bom.get("components", []) if "bom-ref" in c]
    bom.setdefault("dependencies", []).append(
        {"ref": image_ref, "dependsOn": [root_ref, *py_refs, *(a["bom-ref"] for a in added)]}
    )
    bom.setdefault("metadata", {})["component"] = {
        "type": "container",
        "bom-ref": image_ref,
        "name": tag.rsplit(":", 1)[0],
        "version": wheel.version,
        "description": f"toolreg server {wheel.version} (revision {wheel.revision})",
        "licenses": [{"expression": wheel.license}] if wheel.license else [],
        "properties": [
            {"name": "toolreg:revision", "value": wheel.revision},
            {"name": "toolreg:sbom-path", "value": SBOM_IN_IMAGE},
        ],
    }
    return bom


# Every compiled module the server loads, imported in the image: a library missing
# from the root fails the build, not the first call.
_SMOKE: Final = (
    "import grpc, re2, yaml, cryptography.hazmat.bindings._rust, pydantic_core, psycopg,"
    " psycopg_binary, rpds, cel_expr_python, google.protobuf; import registry_server.api.server"
)


def _smoke_test(tag: str, engine_cli: str) -> None:
    _run(
        [engine_cli, "run", "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
         "--entrypoint", "python3", tag, "-I", "-c", _SMOKE],
        f"importing the server's compiled modules in {tag}", DOCKER_TIMEOUT_S,
    )  # fmt: skip


def _passwd_group(ctx: Path, engine_cli: str) -> None:
    """The root's /etc/passwd and /etc/group with the server's user added (a user
    without an entry trips libraries that look up their home or name)."""
    created = _run([engine_cli, "create", ROOT_IMAGE], "docker create", DOCKER_TIMEOUT_S)
    cid = created.stdout.strip()
    try:
        (ctx / "etc").mkdir()
        for name in ("passwd", "group"):
            _run([engine_cli, "cp", f"{cid}:/etc/{name}", str(ctx / "etc" / name)],
                 f"copying /etc/{name} out of {ROOT_IMAGE}", DOCKER_TIMEOUT_S)  # fmt: skip
    finally:
        subprocess.run([engine_cli, "rm", "-f", cid], capture_output=True, timeout=60, check=False)
    with (ctx / "etc" / "passwd").open("a") as f:
        f.write(f"toolreg:x:{SERVER_UID}:{SERVER_UID}:toolreg server:/var/lib/toolreg:"
                "/usr/sbin/nologin\n")  # fmt: skip
    with (ctx / "etc" / "group").open("a") as f:
        f.write(f"toolreg:x:{SERVER_UID}:\n")


def labels(wheel: WheelInfo, root: RootFacts) -> dict[str, str]:
    """OCI labels. No `created`: the same wheel on the same root gives the same labels."""
    return {
        "org.opencontainers.image.title": "toolreg server",
        "org.opencontainers.image.description": "gRPC tool registry: every LLM tool call"
        " in a fresh, locked-down container (needs a Docker engine's socket)",
        "org.opencontainers.image.version": wheel.version,
        "org.opencontainers.image.revision": wheel.revision,
        "org.opencontainers.image.source": wheel.source,
        "org.opencontainers.image.licenses": wheel.license,
        "org.opencontainers.image.base.name": ROOT_IMAGE,
        "org.opencontainers.image.base.digest": root.image_id,
        SBOM_LABEL: SBOM_IN_IMAGE,
    }


def _check_tools() -> None:
    """pip and cyclonedx-py beside this toolreg, asked before anything is built."""
    missing = [
        f"{module} (pip install {package})"
        for module, package in (("pip", "pip"), ("cyclonedx_py", "cyclonedx-bom"))
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        raise ServerImageError(
            f"{sys.executable} lacks {', '.join(missing)}: the build installs the wheel with"
            " pip and writes the SBOMs with cyclonedx-py"
        )


def build_server_image(
    wheel_path: Path,
    *,
    sbom_dir: Path | None = None,
    repository: str = SERVER_REPOSITORY,
    latest: bool = True,
    engine_cli: str = "docker",
    log: Log = print,
) -> ServerImage:
    """Build ``<repository>:<the wheel's version>`` (and ``:latest``) from the wheel;
    write both SBOMs into ``sbom_dir`` (default: beside the wheel)."""
    started = time.monotonic()
    _check_tools()
    wheel = WheelInfo.read(wheel_path.resolve())
    sbom_dir = (sbom_dir or wheel.path.parent).resolve()
    tags = (f"{repository}:{wheel.version}",) + ((f"{repository}:latest",) if latest else ())
    root = root_facts(engine_cli)
    log(f"building {tags[0]} from {wheel.path.name} on {ROOT_IMAGE}"
        f" (python {root.python_full}, glibc {root.libc}, {root.machine})")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="toolreg-server-image.") as tmp:
        ctx = Path(tmp) / "context"
        shutil.copytree(SERVER_CONTEXT, ctx)
        (ctx / "data").mkdir()
        _passwd_group(ctx, engine_cli)
        _pip_install(wheel.path, ctx / "site", root, log)
        host_libs = _needed_from_host(ctx / "site", root)
        (ctx / "lib").mkdir()
        for lib in host_libs:
            shutil.copyfile(lib.path, ctx / "lib" / lib.soname)
            os.chmod(ctx / "lib" / lib.soname, 0o644)
        if host_libs:
            log(f"from this host (the root's glibc): {', '.join(x.soname for x in host_libs)}")
        log("writing the SBOMs (cyclonedx-py) ...")
        site_bom = _cyclonedx(ctx / "site")
        image_bom = image_sbom(site_bom, wheel, root, tags[0], host_libs)
        (ctx / "sbom.cdx.json").write_text(json.dumps(image_bom, indent=2) + "\n")
        log(f"docker build {' '.join(tags)} ...")
        build = [engine_cli, "build", "--network", "none", "--pull=false", "--quiet",
                 "--build-arg", f"LIBDIR={root.libdir}"]  # fmt: skip
        for key, value in labels(wheel, root).items():
            build += ["--label", f"{key}={value}"]
        for tag in tags:
            build += ["-t", tag]
        built = _run([*build, str(ctx)], "docker build", DOCKER_TIMEOUT_S,
                     env={**os.environ, "DOCKER_BUILDKIT": "0"})  # fmt: skip
        image_id = built.stdout.strip().splitlines()[-1]
        _smoke_test(tags[0], engine_cli)
        sbom_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{wheel.name}-{wheel.version}"
        wheel_out = sbom_dir / f"{stem}.cdx.json"
        image_out = sbom_dir / f"{repository.replace('/', '-')}-{wheel.version}.cdx.json"
        wheel_out.write_text(json.dumps(wheel_sbom(site_bom, wheel), indent=2) + "\n")
        shutil.copyfile(ctx / "sbom.cdx.json", image_out)
    return ServerImage(tags, image_id, wheel, wheel_out, image_out, time.monotonic() - started)

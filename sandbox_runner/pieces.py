"""The pieces a host needs before a sandbox can run (an engine, gVisor, the sandbox
images, the init) and the command that provides each, where the host has this code
from: a checkout (the Makefile's targets) or an installed wheel (packages and
`toolreg` verbs). `toolreg doctor`, `toolreg serve` and a call that meets a missing
piece all name the same command, from here (docs/how-to/deploying.md, "toolreg doctor").
"""

from __future__ import annotations

import os
import platform
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "ELF_MACHINES",
    "InitProblem",
    "elf_machine",
    "engine_fix",
    "gvisor_fix",
    "host_elf_machine",
    "images_fix",
    "in_checkout",
    "init_fix",
    "init_problem",
    "machine_name",
]

# The repository root when this package runs from a checkout; in a wheel it is
# site-packages, which has no Makefile.
_CHECKOUT_ROOT: Final = Path(__file__).resolve().parents[1]
ENGINE_DOCS: Final = "docs/how-to/deploying.md, 1. The engine"

# ELF e_machine values (the System V ABI's registry) of the machines Linux runs on that a
# wheel may be built for, and what platform.machine() calls each.
EM_386: Final = 3
EM_ARM: Final = 40
EM_PPC64: Final = 21
EM_S390: Final = 22
EM_X86_64: Final = 62
EM_AARCH64: Final = 183
EM_RISCV: Final = 243
ELF_MACHINES: Final = {
    EM_386: "i386",
    EM_ARM: "arm",
    EM_PPC64: "ppc64",
    EM_S390: "s390x",
    EM_X86_64: "x86_64",
    EM_AARCH64: "aarch64",
    EM_RISCV: "riscv64",
}
_UNAME_MACHINES: Final = {
    "x86_64": EM_X86_64, "amd64": EM_X86_64,
    "aarch64": EM_AARCH64, "arm64": EM_AARCH64,
    "i386": EM_386, "i486": EM_386, "i586": EM_386, "i686": EM_386,
    "armv7l": EM_ARM, "armv6l": EM_ARM,
    "ppc64le": EM_PPC64, "ppc64": EM_PPC64,
    "s390x": EM_S390,
    "riscv64": EM_RISCV,
}  # fmt: skip
ELF_MAGIC: Final = b"\x7fELF"
ELF_HEADER_BYTES: Final = 20  # e_ident (16), e_type (2), e_machine (2)
_EI_DATA: Final = 5  # byte of e_ident: 1 little-endian, 2 big-endian
_E_MACHINE: Final = 18  # offset of e_machine, the same in 32- and 64-bit headers


def in_checkout() -> bool:
    """True when this code runs from a git checkout (make targets exist), False
    when it runs from an installed wheel."""
    return (_CHECKOUT_ROOT / "Makefile").is_file() and (_CHECKOUT_ROOT / "pyproject.toml").is_file()


def engine_fix(checkout: bool | None = None) -> str:
    """The command that gives this host a Docker engine with gVisor."""
    if checkout if checkout is not None else in_checkout():
        return "make engine (installs docker.io and runsc on Debian, starts dockerd)"
    return (
        "sudo apt-get install docker.io runsc && sudo dockerd"
        " (or start your engine; TOOLREG_DOCKER_URL names another one)"
    )


def gvisor_fix(checkout: bool | None = None) -> str:
    """The command that gives the engine the runsc and runsc-net runtimes."""
    if checkout if checkout is not None else in_checkout():
        return "make engine (registers runsc and runsc-net in /etc/docker/daemon.json)"
    return (
        "sudo apt-get install runsc, then register runsc (--network=none) and runsc-net"
        " (--network=sandbox) in /etc/docker/daemon.json and reload dockerd (SIGHUP)"
        f" ({ENGINE_DOCS})"
    )


def images_fix(checkout: bool | None = None) -> str:
    """The command that builds the sandbox images on this host (nothing is pulled)."""
    if checkout if checkout is not None else in_checkout():
        return "toolreg images build (or make images)"
    return "toolreg images build"


def init_fix(checkout: bool | None = None) -> str:
    """The command that gives this host an init it can run."""
    if checkout if checkout is not None else in_checkout():
        return "make init"
    return "pip install --force-reinstall toolreg (its wheel carries the init for this machine)"


def elf_machine(header: bytes) -> int | None:
    """The e_machine of an ELF file whose first bytes are ``header``; None when it
    is not an ELF file (a script, say)."""
    if len(header) < ELF_HEADER_BYTES or not header.startswith(ELF_MAGIC):
        return None
    data = header[_EI_DATA]
    if data not in (1, 2):
        return None
    field = header[_E_MACHINE : _E_MACHINE + 2]
    return int.from_bytes(field, "little" if data == 1 else "big")


def machine_name(machine: int) -> str:
    return ELF_MACHINES.get(machine, f"ELF machine {machine}")


def host_elf_machine() -> int | None:
    """The e_machine of this host's own programs; None for a machine not listed."""
    return _UNAME_MACHINES.get(platform.machine().lower())


@dataclass(frozen=True)
class InitProblem:
    """Why the init at a path cannot run sandboxes here (a sentence naming the path)."""

    reason: str
    not_elf: bool = False  # only this: the file may still be a script that runs

    def __str__(self) -> str:
        return self.reason


def init_problem(path: str | Path) -> InitProblem | None:
    """What is wrong with the init at ``path`` for this host, None when nothing is:
    it must be a regular file (symlinks followed, as the bind mount does), executable
    by others (the container runs it as uid 65534 through the host file's mode), and,
    when it is an ELF file, one for this machine's architecture. A file that is not
    ELF gets a problem with ``not_elf`` set: the backend lets it be (tests run shell
    scripts as inits), doctor does not (the init the wheel carries is a static ELF)."""
    shown = repr(str(path))
    try:
        st = os.stat(path)
    except OSError as e:
        return InitProblem(f"init_path {shown} is not usable: {e.strerror}")
    if not stat.S_ISREG(st.st_mode):
        return InitProblem(f"init_path {shown} is not a regular file")
    if not st.st_mode & stat.S_IXOTH:
        return InitProblem(
            f"init_path {shown} is not executable by others (mode"
            f" {stat.S_IMODE(st.st_mode):04o}); the sandbox user needs o+x"
        )
    try:
        with open(path, "rb") as f:
            header = f.read(ELF_HEADER_BYTES)
    except OSError as e:
        return InitProblem(f"init_path {shown} cannot be read: {e.strerror}")
    machine = elf_machine(header)
    if machine is None:
        return InitProblem(f"init_path {shown} is not an ELF executable", not_elf=True)
    host = host_elf_machine()
    if host is not None and machine != host:
        return InitProblem(
            f"init_path {shown} is an init for {machine_name(machine)}, and this machine"
            f" is {machine_name(host)}"
        )
    return None

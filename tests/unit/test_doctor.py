"""`toolreg doctor`'s own logic: reading an ELF header's machine, judging runtimes and
image labels as the server would, the text and JSON it prints, and its exit status.
The checks against the real engine, store, files and ports are tests/install's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from registry_server.install.doctor import (
    JSON_FORMAT,
    CheckResult,
    Status,
    check_images,
    check_init,
    check_runtimes,
    exit_status,
    redact_url,
    render_json,
    render_text,
)
from registry_server.install.images import BASE_IMAGE, PYTHON_IMAGE, ROOT_IMAGE, image_sources
from sandbox_runner import pieces
from sandbox_runner.pieces import EM_AARCH64, EM_S390, EM_X86_64, elf_machine, init_problem


def elf_header(machine: int, *, big_endian: bool = False, bits: int = 64) -> bytes:
    """The first 64 bytes of an ELF executable for ``machine``, as a linker writes them."""
    order = ">" if big_endian else "<"
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 2 if big_endian else 1, 1]) + bytes(9)
    return ident + struct.pack(f"{order}HHI", 2, machine, 1) + bytes(40)  # ET_EXEC, EV_CURRENT


def test_the_machine_is_read_from_the_header_in_its_own_byte_order() -> None:
    assert elf_machine(elf_header(EM_X86_64)) == EM_X86_64
    assert elf_machine(elf_header(EM_AARCH64)) == EM_AARCH64
    assert elf_machine(elf_header(EM_S390, big_endian=True)) == EM_S390
    assert elf_machine(elf_header(EM_X86_64, bits=32)) == EM_X86_64  # same offset in ELF32


@pytest.mark.parametrize(
    "header",
    [
        b"#!/bin/sh\nexec cat\n" + bytes(40),
        b"\x7fELF\x02\x01",
        elf_header(62)[:5] + b"\x03" + bytes(58),
    ],
    ids=["script", "short", "unknown-byte-order"],
)
def test_what_is_not_an_elf_header_has_no_machine(header: bytes) -> None:
    assert elf_machine(header) is None


def test_the_real_init_is_for_this_machine() -> None:
    from sandbox_runner.spec import INIT_BINARY

    if not INIT_BINARY.is_file():
        pytest.skip("the init is not built here (make init)")
    assert elf_machine(INIT_BINARY.read_bytes()[:64]) == pieces.host_elf_machine()


def _init(tmp_path: Path, header: bytes, mode: int = 0o755) -> Path:
    path = tmp_path / "toolreg-init"
    path.write_bytes(header + bytes(1000))
    path.chmod(mode)
    return path


def test_an_init_for_another_machine_fails_with_the_reinstall_as_its_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pieces, "host_elf_machine", lambda: EM_X86_64)
    path = _init(tmp_path, elf_header(EM_AARCH64))
    problem = init_problem(path)
    assert problem is not None and not problem.not_elf
    assert "is an init for aarch64, and this machine is x86_64" in str(problem)
    result = check_init(path)
    assert result.status is Status.FAIL and result.name == "init"
    assert pieces.init_fix() in result.fix


def test_an_init_for_this_machine_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "host_elf_machine", lambda: EM_X86_64)
    result = check_init(_init(tmp_path, elf_header(EM_X86_64)))
    assert (result.status, result.fix) == (Status.OK, "")
    assert "ELF for x86_64" in result.detail


def test_an_init_others_cannot_run_or_that_is_not_elf_fails(tmp_path: Path) -> None:
    owner_only = _init(tmp_path, elf_header(EM_X86_64), mode=0o744)
    assert "not executable by others" in check_init(owner_only).detail
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\n" + "#" * 40)
    script.chmod(0o755)
    problem = init_problem(script)
    assert problem is not None and problem.not_elf  # the backend lets scripts be
    assert check_init(script).status is Status.FAIL  # doctor does not
    assert check_init(tmp_path / "missing").status is Status.FAIL


def test_the_fixes_differ_between_a_checkout_and_an_installed_wheel() -> None:
    assert pieces.engine_fix(True).startswith("make engine")
    assert "apt-get install docker.io runsc" in pieces.engine_fix(False)
    assert pieces.init_fix(True) == "make init"
    assert pieces.init_fix(False).startswith("pip install --force-reinstall toolreg")
    assert pieces.images_fix(False) == "toolreg images build"
    assert "toolreg images build" in pieces.images_fix(True)
    assert "runsc" in pieces.gvisor_fix(False) and "make engine" in pieces.gvisor_fix(True)


def _by_name(results: list[CheckResult]) -> dict[str, tuple[Status, str]]:
    return {r.name: (r.status, r.fix) for r in results}


RUNTIMES_HERE = {
    "runc": (),
    "runsc": ("--network=none",),
    "runsc-net": ("--network=sandbox",),
}


def test_all_runtimes_with_the_netstack_pass() -> None:
    results = list(check_runtimes(RUNTIMES_HERE, require_gvisor=True, allow_hostinet=True))
    assert [(r.name, r.status) for r in results] == [
        ("runtime.runc", Status.OK),
        ("runtime.runsc", Status.OK),
        ("runtime.runsc-net", Status.OK),
    ]
    assert "netstack" in results[2].detail


def test_missing_gvisor_fails_only_where_it_is_required() -> None:
    only_runc = {"runc": ()}
    required = _by_name(list(check_runtimes(only_runc, require_gvisor=True, allow_hostinet=True)))
    relaxed = _by_name(list(check_runtimes(only_runc, require_gvisor=False, allow_hostinet=True)))
    assert required["runtime.runsc"][0] is Status.FAIL
    assert required["runtime.runsc-net"][0] is Status.FAIL
    assert relaxed["runtime.runsc"][0] is Status.WARN
    assert relaxed["runtime.runsc-net"][0] is Status.WARN
    assert all(pieces.gvisor_fix() == fix for _, fix in (required["runtime.runsc"],))


def test_hostinet_warns_and_is_refused_where_the_setting_refuses_it() -> None:
    hostinet = {**RUNTIMES_HERE, "runsc-net": ("--network=host",)}
    allowed = _by_name(list(check_runtimes(hostinet, require_gvisor=True, allow_hostinet=True)))
    refused = _by_name(list(check_runtimes(hostinet, require_gvisor=True, allow_hostinet=False)))
    assert allowed["runtime.runsc-net"][0] is Status.WARN
    assert "release-20240801" in allowed["runtime.runsc-net"][1]
    assert refused["runtime.runsc-net"][0] is Status.FAIL


def test_images_are_judged_by_their_source_labels() -> None:
    want = {s.image: s.source_hash() for s in image_sources()}
    labels = {
        BASE_IMAGE: {"io.toolreg.source-hash": want[BASE_IMAGE]},
        ROOT_IMAGE: {"io.toolreg.build-hash": "ab" * 32},
        PYTHON_IMAGE: {"io.toolreg.source-hash": "0" * 64},
    }
    got = _by_name(list(check_images(labels)))
    assert got[f"image.{BASE_IMAGE}"] == (Status.OK, "")
    assert got[f"image.{ROOT_IMAGE}"] == (Status.OK, "")
    assert got[f"image.{PYTHON_IMAGE}"] == (Status.WARN, pieces.images_fix())
    missing = _by_name(list(check_images({BASE_IMAGE: None})))
    assert all(v == (Status.FAIL, pieces.images_fix()) for v in missing.values())


RESULTS = [
    CheckResult("engine", Status.OK, "Docker 20.10"),
    CheckResult("runtime.runsc", Status.WARN, "missing", "make engine"),
    CheckResult("port.grpc", Status.FAIL, "127.0.0.1:50051 cannot be bound", "--port"),
]


def test_the_exit_status_is_one_on_a_failure_and_zero_on_warnings_alone() -> None:
    assert exit_status(RESULTS) == 1
    assert exit_status(RESULTS[:2]) == 0
    assert exit_status([]) == 0


def test_the_text_has_one_line_per_check_and_a_fix_line_under_each_problem() -> None:
    lines = render_text(RESULTS).splitlines()
    assert lines[0].startswith("ok  ") and "engine" in lines[0]
    assert lines[1].startswith("warn") and "runtime.runsc" in lines[1]
    assert lines[2].strip() == "fix: make engine"
    assert lines[3].startswith("FAIL") and "port.grpc" in lines[3]
    assert lines[4].strip() == "fix: --port"
    assert "1 failed, 1 warning(s), 3 checks" in lines[5]


def test_the_json_has_stable_keys_and_the_same_content() -> None:
    document = json.loads(render_json(RESULTS))
    assert set(document) == {"format", "version", "ok", "checks"}
    assert document["format"] == JSON_FORMAT and document["ok"] is False
    assert document["checks"] == [
        {"name": r.name, "status": r.status.value, "detail": r.detail, "fix": r.fix}
        for r in RESULTS
    ]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://toolreg:s3cret@127.0.0.1:55432/db?sslpassword=x",
            "postgresql://127.0.0.1:55432/db",
        ),
        (
            "https://user:pw@idp.example/realms/a?client_secret=y#frag",
            "https://idp.example/realms/a",
        ),
        ("unix:///var/run/docker.sock", "unix:///var/run/docker.sock"),
        ("tcp://[::1]:2375", "tcp://[::1]:2375"),
    ],
)
def test_a_url_is_printed_without_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_urls_quoted_in_a_message_lose_their_user_and_query() -> None:
    from registry_server.install.doctor import _scrub_urls

    said = "cannot read the store postgresql://u:***@db:5432/x?sslmode=require: refused"
    assert _scrub_urls(said) == "cannot read the store postgresql://db:5432/x: refused"


def test_an_image_without_a_tag_is_looked_up_as_latest() -> None:
    from registry_server.install.doctor import local_image_name

    assert local_image_name("toolreg/base") == "toolreg/base:latest"
    assert local_image_name("toolreg/base:1.2") == "toolreg/base:1.2"
    assert (
        local_image_name("registry.local:5000/team/tool") == "registry.local:5000/team/tool:latest"
    )
    assert local_image_name("team/tool@sha256:" + "a" * 64) == "team/tool@sha256:" + "a" * 64


def test_each_missing_tool_image_is_named_with_its_tools() -> None:
    from registry_server.install.doctor import ToolImage, check_tool_images

    tools = [
        ToolImage("echo", BASE_IMAGE),
        ToolImage("run_python", PYTHON_IMAGE),
        ToolImage("word_count", PYTHON_IMAGE),
    ]
    missing_ours = check_tool_images(tools, {BASE_IMAGE: {}, PYTHON_IMAGE: None})
    assert missing_ours.status is Status.FAIL
    assert missing_ours.detail == f"missing: {PYTHON_IMAGE} (run_python, word_count)"
    assert missing_ours.fix == pieces.images_fix()
    theirs = check_tool_images([ToolImage("x", "team/x:latest")], {})
    assert theirs.status is Status.FAIL and "nothing is pulled" in theirs.fix
    assert check_tool_images(tools, {BASE_IMAGE: {}, PYTHON_IMAGE: {}}).status is Status.OK


def test_the_text_shows_control_characters_of_a_detail_as_escapes() -> None:
    said = CheckResult("store", Status.FAIL, "refused \x1b[2J\x1b[31mall clear", "x\rok")
    text = render_text([said])
    assert "\x1b" not in text and "\r" not in text
    assert json.loads(render_json([said]))["checks"][0]["detail"] == said.detail  # JSON: exact

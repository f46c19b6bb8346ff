"""The installed wheel at work, as a new user runs it: from its own virtual environment,
in an empty folder, with this machine's engine. `toolreg doctor`, `toolreg images build`,
`toolreg serve` of the packaged example tools, safe and cautious calls, and a dangerous
call through two approvers' signatures, all by the installed `toolreg`."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml

from registry_server.cli.launcher import SERVING_LINE, spawn_until
from tests.install.conftest import BUILD_TIMEOUT_S, ROOT, Installed

# The installed fixture builds and installs once per run; its first user waits for it.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)

IMAGES = ("toolreg/base", "toolreg/python")
HASH_LABELS = ("io.toolreg.build-hash", "io.toolreg.source-hash")
IMAGES_BUILD_TIMEOUT_S = 900  # seconds: up to date takes seconds; a debootstrap takes minutes
AUDIENCE = "toolreg-install-test"


def _images() -> dict[str, tuple[str | None, dict[str, str]]]:
    """Each image's id and its content-hash labels, as the engine has them now."""
    client = docker.from_env()
    try:
        out = {}
        for name in IMAGES:
            image = client.images.get(name)
            labels: dict[str, str] = image.labels or {}
            out[name] = (image.id, {k: labels.get(k, "") for k in HASH_LABELS})
        return out
    finally:
        client.close()


def test_images_build_from_the_wheel_finds_what_make_images_built(
    installed: Installed, tmp_path: Path
) -> None:
    # What `make images` builds (its recipe, from the checkout): up to date after
    # make test's own `make images`, so this only reads the engine.
    made = subprocess.run(
        ["bash", str(ROOT / "sandbox_runner/images/build.sh")], cwd=ROOT, capture_output=True,
        text=True, timeout=IMAGES_BUILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    before = _images()
    for name, (_, labels) in before.items():
        assert all(len(v) == 64 for v in labels.values()), (name, labels)

    out = installed.run("images", "build", cwd=tmp_path, timeout=IMAGES_BUILD_TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = out.stdout + out.stderr
    for name in IMAGES:
        assert f"{name}:latest up to date" in said, said
    assert "building" not in said, said
    assert _images() == before


def test_doctor_passes_on_this_machine(installed: Installed, tmp_path: Path) -> None:
    # Port 0: the check is that serve could listen, not that 50051 is free here.
    where = ["--data-dir", str(tmp_path / "data"), "--port", "0"]
    out = installed.run("doctor", "--json", *where, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads(out.stdout)["ok"] is True, out.stdout
    text = installed.run("doctor", *where, cwd=tmp_path, timeout=300)
    assert text.returncode == 0, text.stdout[-3000:] + text.stderr[-3000:]


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _policy(work: Path, installed: Installed) -> Path:
    """Two approvers of group security (keys made by the installed `toolreg keys`), both
    needed for write_file; an agent that may execute up to dangerous."""
    approvers = []
    for who in ("alice", "bob"):
        made = installed.run("keys", "generate", "--out", str(work / f"{who}.key"), cwd=work)
        assert made.returncode == 0, made.stderr
        public = (work / f"{who}.pub").read_text().strip()
        approvers.append({"id": who, "public_key": public, "groups": ["security"]})
    policy: dict[str, Any] = {
        "audience": AUDIENCE,
        "approvers": approvers,
        "approval_rules": [
            {"match": {"tool": "write_file"}, "approvals_required": 2, "groups": ["security"],
             "max_token_ttl_s": 600},
        ],
        "clients": [
            {"id": "agent", "token_sha256": _sha("agent-secret"), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "alice", "token_sha256": _sha("alice-secret"), "roles": ["approve"]},
            {"id": "bob", "token_sha256": _sha("bob-secret"), "roles": ["approve"]},
        ],
    }  # fmt: skip
    path = work / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


@pytest.fixture
def served(installed: Installed, tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """The installed `toolreg serve` of the packaged example tools with the policy above,
    started in an empty folder: (its address, the folder, its data directory)."""
    where = subprocess.run(
        [str(installed.python), "-c",
         "from registry_server.install.packaged import EXAMPLE_TOOLS_DIR as d; print(d)"],
        cwd=tmp_path, env=installed.env(), capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    tools = Path(where.stdout.strip())
    assert tools.resolve().is_relative_to(installed.venv.resolve()), tools
    work = tmp_path / "work"
    work.mkdir()
    policy = _policy(work, installed)
    data = tmp_path / "data"
    argv = [str(installed.toolreg), "serve", "--tools", str(tools), "--policy", str(policy),
            "--port", "0", "--data-dir", str(data)]  # fmt: skip
    proc, address, log = spawn_until(
        argv, SERVING_LINE, what="installed toolreg serve", cwd=work, env=installed.env()
    )
    try:
        yield address, work, data
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(timeout=60)
        assert code == 0, "".join(log[-30:])


def _exec(
    installed: Installed,
    address: str,
    work: Path,
    token: str,
    tool: str,
    args: dict[str, Any],
    *extra: str,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = installed.run(
        "--token", token, "exec", tool, "--args", json.dumps(args), "--json", *extra, cwd=work,
        TOOLREG_ADDRESS=address,
    )  # fmt: skip
    return out, json.loads(out.stdout)


def test_serve_runs_safe_cautious_and_approved_dangerous_calls(
    installed: Installed, served: tuple[str, Path, Path]
) -> None:
    address, work, data = served

    def call(
        tool: str, args: dict[str, Any], *extra: str
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        return _exec(installed, address, work, "agent-secret", tool, args, *extra)

    out, result = call("echo", {"message": "from the wheel"})
    assert out.returncode == 0, out.stderr
    assert result["status"] == "EXECUTION_STATUS_OK"
    assert json.loads(result["data_json"]) == {"message": "from the wheel"}

    out, result = call("word_count", {"text": "one two three\nfour"})
    assert out.returncode == 0, out.stderr
    assert json.loads(result["data_json"])["words"] == 4

    out, result = call("run_python", {"code": "print(6 * 7)"})
    assert out.returncode == 0, out.stderr
    assert result["status"] == "EXECUTION_STATUS_OK"
    assert "42" in result["content"]

    # The dangerous call: refused until two approvers have signed exactly this request.
    args = {"path": "notes/plan.txt", "content": "ship it"}
    out, result = call("write_file", args)
    assert out.returncode != 0
    assert result["status"] == "EXECUTION_STATUS_APPROVAL_REQUIRED"
    request = result["approval_request"]
    assert request["state"] == "PENDING" and request["approvals_required"] == 2
    assert not (data / "workspace" / "notes" / "plan.txt").exists()

    def approve(who: str) -> str:
        signed = installed.run(
            "--token", f"{who}-secret", "approvals", "approve", request["id"],
            "--key", str(work / f"{who}.key"), cwd=work, TOOLREG_ADDRESS=address,
        )  # fmt: skip
        assert signed.returncode == 0, signed.stdout + signed.stderr
        return signed.stdout

    assert "1 of 2 approvals, state PENDING" in approve("alice")
    out, result = call("write_file", args, "--approval-request", request["id"])
    assert result["status"] == "EXECUTION_STATUS_APPROVAL_REQUIRED", result
    assert "2 of 2 approvals, state APPROVED" in approve("bob")

    out, result = call("write_file", args, "--approval-request", request["id"])
    assert out.returncode == 0, out.stderr
    assert result["status"] == "EXECUTION_STATUS_OK"
    assert (data / "workspace" / "notes" / "plan.txt").read_text() == "ship it"

    # Once: the approvals are spent.
    out, result = call("write_file", args, "--approval-request", request["id"])
    assert out.returncode != 0
    assert result["status"] != "EXECUTION_STATUS_OK"

    verified = installed.run("audit", "verify", "--data-dir", str(data), cwd=work)
    assert verified.returncode == 0, verified.stdout + verified.stderr

"""The approval walkthrough (docs/tutorials/first-approved-call.md) and development mode,
run as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from registry_server.api.app import build_app
from registry_server.api.config import ServerConfig
from registry_server.cli.launcher import spawn_server
from registry_server.domain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toolreg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "toolreg"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def test_readme_walkthrough_with_two_approvers() -> None:
    env = dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        TOOLREG_WALKTHROUGH_PORT=str(free_port()),
    )
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "approval-walkthrough.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "approved" in out.stdout and "2 of 2 approvals, state APPROVED" in out.stdout
    assert "workspace file: ship it" in out.stdout
    assert "audit chain intact" in out.stdout


def test_development_mode_needs_a_token_from_an_installed_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = dict(os.environ)
    generated = toolreg(
        "keys", "generate", "--out", str(tmp_path / "dana.key"), "--install", str(data), env=env
    )
    assert generated.returncode == 0, generated.stderr
    assert (data / "approvers" / "dana.pub").exists()
    assert oct((tmp_path / "dana.key").stat().st_mode & 0o777) == "0o600"
    again = toolreg("keys", "generate", "--out", str(tmp_path / "dana.key"), env=env)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr

    server = spawn_server(data, "--tools", str(ROOT / "examples" / "tools"), cwd=ROOT)
    try:
        assert any("DEVELOPMENT MODE" in line for line in server.log)
        env["TOOLREG_ADDRESS"] = server.address
        args = json.dumps({"path": "dev.txt", "content": "from dev mode"})
        ask = toolreg("exec", "write_file", "--args", args, env=env)
        assert ask.returncode == 1 and "APPROVAL_REQUIRED" in ask.stderr
        request = ask.stderr.split("approval request ")[1].split(":")[0]
        signed = toolreg(
            "approvals", "approve", request, "--key", str(tmp_path / "dana.key"), env=env
        )
        assert signed.returncode == 0, signed.stderr
        assert "1 of 1 approvals, state APPROVED" in signed.stdout
        printed = toolreg(
            "approvals", "approve", request, "--key", str(tmp_path / "dana.key"), "--print", env=env
        )
        assert printed.stdout.count(".") == 2  # a JWT, for out-of-band delivery
        ran = toolreg("exec", "write_file", "--args", args, "--approval-request", request, env=env)
        assert ran.returncode == 0, ran.stderr
        assert (data / "workspace" / "dev.txt").read_text() == "from dev mode"
    finally:
        assert server.stop() == 0


def test_listening_beyond_loopback_needs_tls_and_a_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="development mode"):
        build_app(
            ServerConfig(host="0.0.0.0", port=0, data_dir=tmp_path, allow_insecure_remote=True)
        )
    with pytest.raises(ConfigError, match="without TLS"):
        build_app(
            ServerConfig(
                host="0.0.0.0",
                port=0,
                data_dir=tmp_path,
                policy_file=ROOT / "examples" / "policy.yaml",
            )
        )

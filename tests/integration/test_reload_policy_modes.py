"""ReloadPolicy against a real server (gRPC on loopback, SQLite), in both
modes, as the .proto says: with a policy file it re-reads the file; in
development mode (no policy file) it succeeds and re-reads the approver keys
in the data directory (docs/explanation/threat-model.md, "Development mode": install a key, then
reload), and a bad key file is FAILED_PRECONDITION with the keys in force
unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.signing.keys import generate_keypair
from tests.factories import sha
from tests.integration.conftest import Running, StartServer

ADMIN = "reload-admin-secret"
TOOLREG = Path(sys.executable).parent / "toolreg"


def approvers(running: Running) -> list[str]:
    assert running.app.policy is not None
    return [a.id for a in running.app.policy.current.approvers]


def test_development_mode_reload_succeeds_and_reads_the_approver_keys_again(
    start_server: StartServer,
) -> None:
    running = start_server()
    data = running.app.config.data_dir
    info = running.stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=10)
    assert (info.policy_digest, info.policy_source) == ("", "")  # says: no policy file
    assert approvers(running) == []

    keys = data / "approvers"
    keys.mkdir(exist_ok=True)
    (keys / "dana.pub").write_text(generate_keypair()[1] + "\n")
    running.stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=10)
    assert approvers(running) == ["dana"]

    (keys / "eve.pub").write_text("not a key\n")
    with pytest.raises(grpc.RpcError) as refused:
        running.stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "approver 'eve'" in str(refused.value.details())
    assert approvers(running) == ["dana"]  # the keys in force stay

    (keys / "eve.pub").unlink()
    ran = subprocess.run(
        [str(TOOLREG), "policy", "reload", "--address", running.address],
        capture_output=True, text=True, timeout=60, env={**os.environ, "TOOLREG_TOKEN": ""},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == (
        "reloaded: development mode (no policy file): the approver keys in the"
        " server's data directory were read again\n"
    )


def test_with_a_policy_file_reload_reads_the_file_again(
    start_server: StartServer, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    text: dict[str, Any] = {
        "audience": "toolreg-reload",
        "clients": [{"id": "admin", "token_sha256": sha(ADMIN), "roles": ["admin"]}],
    }
    policy.write_text(yaml.safe_dump(text))
    running = start_server(policy_file=policy)
    admin = (("authorization", f"Bearer {ADMIN}"),)
    first = running.stub.ReloadPolicy(pb.ReloadPolicyRequest(), metadata=admin, timeout=10)
    assert first.policy_source == str(policy) and len(first.policy_digest) == 64
    _, public = generate_keypair()
    text["approvers"] = [{"id": "dana", "public_key": public, "groups": ["ops"]}]
    policy.write_text(yaml.safe_dump(text))
    second = running.stub.ReloadPolicy(pb.ReloadPolicyRequest(), metadata=admin, timeout=10)
    assert second.policy_digest != first.policy_digest and approvers(running) == ["dana"]

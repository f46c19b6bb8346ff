"""The Node.js client suite (tests/interop/) against a real `toolreg serve`
process with a policy: proves the .proto alone is enough for another language
(grpc-js loading proto/ at run time), and runs the approval path and the
authentication checks through the typed client (clients/typescript)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from registry_server.cli.launcher import spawn_server
from registry_server.signing.keys import generate_keypair
from tests.factories import example_tools_policy, token_client

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / "tests" / "interop"
EXAMPLES = ROOT / "examples" / "tools"
NODE_TIMEOUT_S = 300  # seconds for the whole Node suite (it starts a few dozen containers)
TOKENS = {"agent": "interop-agent", "admin": "interop-admin", "alice": "interop-alice"}


def write_policy(path: Path, public_keys: dict[str, str]) -> None:
    clients = [
        token_client("agent", TOKENS["agent"], ["execute"], "dangerous"),
        token_client("admin", TOKENS["admin"], ["register"]),
        token_client("alice", TOKENS["alice"], ["approve"]),
    ]
    policy = example_tools_policy("toolreg-interop", public_keys, clients)
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def run_node_suite(address: str, alice_private: bytes) -> subprocess.CompletedProcess[str]:
    """The Node.js suite against ``address``, whose servers use ``write_policy``'s
    clients and alice's key; fails the test when Node or its modules are missing."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (>= 20) is not on PATH: the interop suite needs Node.js")
    if not (INTEROP / "node_modules").is_dir():
        pytest.fail(
            "tests/interop/node_modules is missing: "
            "run `make test` (it installs the interop dependencies)"
        )
    if not (ROOT / "clients" / "typescript" / "dist" / "index.js").is_file():
        pytest.fail(
            "the TypeScript client (clients/typescript) is not built: "
            "run `make ts-client` (make test does)"
        )
    env = {
        **os.environ,
        "TOOLREG_ADDRESS": address,
        "TOOLREG_AGENT_TOKEN": TOKENS["agent"],
        "TOOLREG_ADMIN_TOKEN": TOKENS["admin"],
        "TOOLREG_APPROVER_TOKEN": TOKENS["alice"],
        "TOOLREG_APPROVER_ID": "alice",
        "TOOLREG_APPROVER_KEY_PEM": alice_private.decode(),
    }
    return subprocess.run(
        [node, "--test", "tests/interop/"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
    )  # fmt: skip


def test_node_client_suite(tmp_path: Path) -> None:
    alice_private, alice_public = generate_keypair()
    _, bob_public = generate_keypair()
    policy = tmp_path / "policy.yaml"
    write_policy(policy, {"alice": alice_public, "bob": bob_public})
    server = spawn_server(
        tmp_path / "data", "--policy", str(policy), "--tools", str(EXAMPLES), cwd=ROOT
    )
    try:
        done = run_node_suite(server.address, alice_private)
    finally:
        code = server.stop()
    output = done.stdout + done.stderr
    print(output)  # node's TAP report: shown by `pytest -rP`, and on failure
    assert done.returncode == 0, (
        f"node --test tests/interop/ failed ({done.returncode}):\n{output}\n"
        "--- server log (last 40 lines) ---\n" + "".join(server.log[-40:])
    )
    assert code == 0, "the server did not stop cleanly:\n" + "".join(server.log[-40:])

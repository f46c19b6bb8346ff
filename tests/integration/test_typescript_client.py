"""The TypeScript client's own tests (clients/typescript/test/) against real
`toolreg serve` processes with a policy: one plain, one with TLS (clients by
bearer token), one requiring client certificates (mTLS)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.signing.keys import generate_keypair
from tests.certs import CertificateAuthority
from tests.factories import example_tools_policy, token_client

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"
EXAMPLES = ROOT / "examples" / "tools"
NODE_TIMEOUT_S = 240  # seconds for the whole TypeScript suite (it starts a few dozen containers)
TOKENS = {
    "agent": "ts-agent", "agent2": "ts-agent2", "admin": "ts-admin", "alice": "ts-alice",
    "ops": "ts-ops",
}  # fmt: skip
MTLS_SUBJECT = "CN=ts-agent-tls"


def write_policy(path: Path, public_keys: dict[str, str]) -> None:
    clients = [
        token_client("agent", TOKENS["agent"], ["execute"], "dangerous"),
        # Another agent: may not see the first one's approval requests; the
        # watch tests use it alone, so its watch count is theirs.
        token_client("agent2", TOKENS["agent2"], ["execute"], "dangerous"),
        token_client("admin", TOKENS["admin"], ["register"]),
        # The operator: the kill switch, and tools of any level (kill-switch tests)
        token_client("ops", TOKENS["ops"], ["register", "admin"]),
        token_client("alice", TOKENS["alice"], ["approve"]),
        {"id": "agent-tls", "mtls_subject": MTLS_SUBJECT, "roles": ["execute"]},
    ]
    policy = example_tools_policy("toolreg-ts-client", public_keys, clients)
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def _newest(paths: Iterator[Path]) -> float:
    return max((p.stat().st_mtime for p in paths), default=0.0)


def check_built() -> str:
    """node's path; fails the test when Node, the package's modules or its
    build are missing or older than the sources."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (>= 20) is not on PATH: the TypeScript client needs Node.js")
    hint = "run `make ts-client` (make test does)"
    if not (PACKAGE / "node_modules").is_dir():
        pytest.fail(f"clients/typescript/node_modules is missing: {hint}")
    built = [PACKAGE / "dist" / "index.js", PACKAGE / "dist-test" / "test" / "helpers.js"]
    missing = [str(p.relative_to(ROOT)) for p in built if not p.is_file()]
    if missing:
        pytest.fail(f"the TypeScript client is not built ({', '.join(missing)}): {hint}")
    sources = _newest(p for d in ("src", "test", "examples") for p in (PACKAGE / d).rglob("*.ts"))
    if sources > min(p.stat().st_mtime for p in built):
        pytest.fail(f"the TypeScript build is older than its sources: {hint}")
    return node


def tls_files(tmp_path: Path) -> dict[str, Path]:
    ca = CertificateAuthority("toolreg-ts-test-ca")
    server = ca.issue("localhost", server=True)
    agent = ca.issue(MTLS_SUBJECT.removeprefix("CN="))
    files = {
        "ca": ca.pem,
        "server_cert": server.cert_pem,
        "server_key": server.key_pem,
        "client_cert": agent.cert_pem,
        "client_key": agent.key_pem,
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_bytes(data)
    return paths


@pytest.mark.timeout(NODE_TIMEOUT_S + 60)
def test_typescript_client_suite(tmp_path: Path) -> None:
    node = check_built()
    test_files = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("dist-test/test/*.test.js")
    )
    assert test_files, "no compiled tests in clients/typescript/dist-test/test/"
    alice_private, alice_public = generate_keypair()
    _, bob_public = generate_keypair()
    policy = tmp_path / "policy.yaml"
    write_policy(policy, {"alice": alice_public, "bob": bob_public})
    certs = tls_files(tmp_path)
    common = ("--policy", str(policy), "--tools", str(EXAMPLES))
    server_tls = ("--tls-cert", str(certs["server_cert"]), "--tls-key", str(certs["server_key"]))
    servers: dict[str, ServerProcess] = {}
    with ExitStack() as stack:
        for name, extra in {
            "plain": (),
            "tls": server_tls,
            "mtls": (*server_tls, "--tls-client-ca", str(certs["ca"])),
        }.items():
            servers[name] = spawn_server(tmp_path / f"data-{name}", *common, *extra, cwd=ROOT)
            stack.callback(servers[name].kill)
        env = {
            **os.environ,
            "TOOLREG_ADDRESS": servers["plain"].address,
            "TOOLREG_TLS_ADDRESS": servers["tls"].address,
            "TOOLREG_MTLS_ADDRESS": servers["mtls"].address,
            "TOOLREG_TLS_CA_FILE": str(certs["ca"]),
            "TOOLREG_TLS_CLIENT_CERT_FILE": str(certs["client_cert"]),
            "TOOLREG_TLS_CLIENT_KEY_FILE": str(certs["client_key"]),
            "TOOLREG_AGENT_TOKEN": TOKENS["agent"],
            "TOOLREG_OTHER_AGENT_TOKEN": TOKENS["agent2"],
            "TOOLREG_ADMIN_TOKEN": TOKENS["admin"],
            "TOOLREG_OPS_TOKEN": TOKENS["ops"],
            "TOOLREG_APPROVER_TOKEN": TOKENS["alice"],
            "TOOLREG_APPROVER_ID": "alice",
            "TOOLREG_APPROVER_KEY_PEM": alice_private.decode(),
        }
        done = subprocess.run(
            [node, "--test", *test_files],
            cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
        )  # fmt: skip
        codes = {name: server.stop() for name, server in servers.items()}
    output = done.stdout + done.stderr
    print(output)  # node's TAP report: shown by `pytest -rP`, and on failure
    logs = "".join(
        f"--- {name} server log (last 30 lines) ---\n" + "".join(server.log[-30:])
        for name, server in servers.items()
    )
    assert done.returncode == 0, (
        f"node --test {' '.join(test_files)} failed ({done.returncode}):\n{output}\n{logs}"
    )
    counts = dict(re.findall(r"^# (pass|fail|skipped|todo|cancelled) (\d+)$", output, re.MULTILINE))
    assert int(counts.get("pass", "0")) > 0, f"no test passed:\n{output}"
    assert {k: v for k, v in counts.items() if k != "pass"} == {
        "fail": "0", "skipped": "0", "todo": "0", "cancelled": "0",
    }, output  # fmt: skip
    assert codes == {"plain": 0, "tls": 0, "mtls": 0}, f"a server did not stop cleanly:\n{logs}"

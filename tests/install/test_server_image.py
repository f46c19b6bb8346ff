"""The server image as an operator runs it: built from this run's wheel on the sandbox
images' Debian root (nothing pulled), started against this machine's engine with the
socket mounted, a policy, TLS and the tests' PostgreSQL, and called from the host.

The container gets the host's network (it reaches PostgreSQL on loopback) and listens
on loopback only; the data directory is mounted at the same path as on the host, which
is what lets the engine mount the staged init and the workspace into sandboxes
(docs/deploying.md, "The server image")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from registry_server.install.server_image import (
    SBOM_IN_IMAGE,
    SBOM_LABEL,
    SERVER_UID,
    ServerImage,
    build_server_image,
)
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests.certs import CertificateAuthority
from tests.factories import sha
from tests.install.conftest import Dist

ROOT = Path(__file__).resolve().parents[2]
RUN = uuid.uuid4().hex[:10]  # names and labels of what this run makes
TEST_LABEL = f"io.toolreg.test-run={RUN}"
AUDIENCE = "toolreg-image-test"
AGENT_TOKEN = f"agent-{uuid.uuid4().hex}"
TOOLS_IN_IMAGE = "/usr/local/lib/python3.11/dist-packages/registry_server/examples/tools"
HEALTHY_TIMEOUT_S = 90  # seconds for the container's health check to say healthy
SOCKET = Path("/var/run/docker.sock")

pytestmark = pytest.mark.timeout(600)


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        pytest.fail(f"docker {' '.join(args[:3])} ...: {done.stderr[-2000:]}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def image(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerImage]:
    built = build_server_image(
        dist.wheel,
        sbom_dir=tmp_path_factory.mktemp("sbom"),
        repository=f"toolreg/server-test-{RUN}",
        latest=False,
        log=lambda line: None,
    )
    yield built
    docker("image", "rm", "-f", *built.tags, check=False)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database of the tests' PostgreSQL, dropped afterwards."""
    url = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ensure_postgres.sh"), "url"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.strip()  # fmt: skip
    name = f"toolreg_image_{RUN}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield url.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@dataclass
class Served:
    container: str
    address: str
    data_dir: Path
    ca_pem: bytes
    approver_keys: dict[str, bytes]

    def stub(self) -> pb_grpc.ToolRegistryStub:
        return pb_grpc.ToolRegistryStub(
            open_channel(self.address, token=AGENT_TOKEN, tls_ca=self.ca_pem)
        )

    def inspect(self) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(docker("container", "inspect", self.container))
        return data[0]

    def logs(self) -> str:
        done = subprocess.run(
            ["docker", "logs", "--tail", "60", self.container],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.stdout + done.stderr


def _policy(approvers: dict[str, str]) -> dict[str, Any]:
    return {
        "audience": AUDIENCE,
        "approvers": [
            {"id": who, "public_key": key, "groups": ["security"]} for who, key in approvers.items()
        ],
        "approval_rules": [
            {
                "match": {"tool": "write_file"},
                "approvals_required": 2,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            }
        ],
        "clients": [
            {
                "id": "agent",
                "token_sha256": sha(AGENT_TOKEN),
                "roles": ["execute"],
                "max_safety_level": "dangerous",
            }
        ],
    }


def _owned_by_server(path: Path, mode: int) -> None:
    os.chown(path, SERVER_UID, SERVER_UID)
    path.chmod(mode)


@pytest.fixture(scope="module")
def served(
    image: ServerImage, database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("server-image")
    base.chmod(0o755)  # the server's user walks to its data directory
    data_dir, config_dir = base / "data", base / "etc"
    data_dir.mkdir()
    config_dir.mkdir()
    _owned_by_server(data_dir, 0o700)
    keys = {who: generate_keypair() for who in ("alice", "bob")}
    (config_dir / "policy.yaml").write_text(
        yaml.safe_dump(_policy({who: pub for who, (_, pub) in keys.items()}), sort_keys=False)
    )
    ca = CertificateAuthority("server-image-test-ca")
    leaf = ca.issue("localhost", server=True, ip_addresses=["127.0.0.1"])
    (config_dir / "tls.crt").write_bytes(leaf.cert_pem)
    (config_dir / "tls.key").write_bytes(leaf.key_pem)
    _owned_by_server(config_dir / "tls.key", 0o600)
    port, health_port = free_port(), free_port()
    name = f"toolreg-server-test-{RUN}"
    docker(
        "run", "--detach", "--name", name, "--label", TEST_LABEL,
        "--network", "host", "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,size=64m",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--group-add", str(SOCKET.stat().st_gid),
        "--volume", f"{SOCKET}:{SOCKET}",
        "--volume", f"{data_dir}:{data_dir}",  # the same path on both sides
        "--volume", f"{config_dir}:/etc/toolreg:ro",
        "--env", f"TOOLREG_DATA_DIR={data_dir}",
        "--env", f"TOOLREG_STORE_URL={database}",
        "--env", "TOOLREG_HOST=127.0.0.1",  # the host's loopback: nothing beyond this machine
        "--env", f"TOOLREG_PORT={port}",
        "--env", f"TOOLREG_HEALTH_PORT={health_port}",
        "--env", "TOOLREG_HEALTH_INTERVAL_S=1",
        "--health-interval", "2s",  # the image's check, asked more often than its 10 s
        image.tags[0],
        "--policy", "/etc/toolreg/policy.yaml", "--tools", TOOLS_IN_IMAGE,
        "--tls-cert", "/etc/toolreg/tls.crt", "--tls-key", "/etc/toolreg/tls.key",
    )  # fmt: skip
    keys_pem = {who: private for who, (private, _) in keys.items()}
    running = Served(name, f"localhost:{port}", data_dir, ca.pem, keys_pem)
    try:
        yield running
    finally:
        print(running.logs())
        # SIGTERM first: the server removes its own sandboxes as it stops.
        docker("stop", "--time", "30", name, timeout=90, check=False)
        docker("rm", "--force", "--volumes", name, check=False)


def _wait_healthy(served: Served) -> str:
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    status = ""
    while time.monotonic() < deadline:
        state = served.inspect()["State"]
        status = (state.get("Health") or {}).get("Status", "")
        if status == "healthy" or not state["Running"]:
            break
        time.sleep(1)
    return status


def test_the_image_serves_calls_and_approved_dangerous_calls(served: Served) -> None:
    status = _wait_healthy(served)
    assert status == "healthy", served.logs()
    stub = served.stub()
    safe = stub.ExecuteTool(
        pb.ExecuteToolRequest(name="echo", arguments_json='{"message": "from the image"}'),
        timeout=120,
    )
    assert safe.success, (safe.error, served.logs())
    assert json.loads(safe.data_json) == {"message": "from the image"}

    args = json.dumps({"path": f"image-{RUN}.txt", "content": "approved twice"})
    asked = stub.ExecuteTool(pb.ExecuteToolRequest(name="write_file", arguments_json=args))
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked.error
    request = asked.approval_request
    assert request.approvals_required == 2
    tokens = [
        mint_for(load_private_key(key), issuer=who, request=request)
        for who, key in served.approver_keys.items()
    ]
    done = stub.ExecuteTool(
        pb.ExecuteToolRequest(
            name="write_file", arguments_json=args, approval_tokens=tokens,
            approval_request_id=request.id,
        ),
        timeout=180,
    )  # fmt: skip
    assert done.success, (done.error, done.stderr, served.logs())
    # The sandbox wrote into the workspace the engine mounted from the host's data
    # directory: the same path inside the server's container and on the host.
    assert (served.data_dir / "workspace" / f"image-{RUN}.txt").read_text() == "approved twice"
    staged = list((served.data_dir / "stage" / "init").glob("*/toolreg-init"))
    assert len(staged) == 1


def test_the_container_is_non_root_with_a_read_only_root(served: Served) -> None:
    inspected = served.inspect()
    assert inspected["Config"]["User"] == f"{SERVER_UID}:{SERVER_UID}"
    assert inspected["HostConfig"]["ReadonlyRootfs"] is True
    uid = docker("exec", served.container, "id", "-u").strip()
    assert uid == str(SERVER_UID) and uid != "0"
    touched = subprocess.run(
        ["docker", "exec", served.container, "touch", "/usr/local/bin/x"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr


def test_the_image_names_its_version_revision_and_source(image: ServerImage) -> None:
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", image.tags[0]))
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == image.wheel.version
    assert labels["org.opencontainers.image.revision"] == image.wheel.revision
    assert image.wheel.revision not in ("", "unknown")
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels[SBOM_LABEL] == SBOM_IN_IMAGE
    assert config["Entrypoint"] == ["toolreg", "serve"]
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert not any("password" in v.lower() or ("://" in v and "@" in v) for v in labels.values())


def _validate_cyclonedx(text: str) -> dict[str, Any]:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    assert error is None, str(error)[:2000]
    bom: dict[str, Any] = json.loads(text)
    assert bom["bomFormat"] == "CycloneDX"
    return bom


def test_the_sboms_are_cyclonedx_in_the_image_and_beside_the_wheel(
    image: ServerImage, served: Served
) -> None:
    inside = _validate_cyclonedx(docker("exec", served.container, "cat", SBOM_IN_IMAGE))
    assert inside["metadata"]["component"]["type"] == "container"
    names = {c["name"] for c in inside["components"]}
    assert {"toolreg", "grpcio", "toolreg/python-root"} <= names
    assert image.image_sbom.read_text() == docker("exec", served.container, "cat", SBOM_IN_IMAGE)
    wheel_bom = _validate_cyclonedx(image.wheel_sbom.read_text())
    assert wheel_bom["metadata"]["component"]["name"] == "toolreg"
    assert {"grpcio", "cryptography", "psycopg"} <= {c["name"] for c in wheel_bom["components"]}

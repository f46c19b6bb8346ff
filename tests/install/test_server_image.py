"""The server image as an operator runs it: built from this run's wheel on the sandbox
images' Debian root (nothing pulled), started against this machine's engine with the
socket mounted, a policy, TLS and the tests' PostgreSQL, and called from the host.

The container gets the host's network (it reaches PostgreSQL on loopback) and listens
on loopback only; the data directory is mounted at the same path as on the host, which
is what lets the engine mount the staged init and the workspace into sandboxes
(docs/how-to/deploying.md, "The server image"). A tool with egress and both kinds of secret
reaches an upstream of the tests' own (tests/egress_world) through the egress proxy the
non-root server starts."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.install.server_image import (
    SBOM_IN_IMAGE,
    SBOM_LABEL,
    SERVER_UID,
    ServerImage,
    build_server_image,
)
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.wire import convert
from tests.certs import CertificateAuthority
from tests.egress_world import UpstreamWorld
from tests.factories import sha
from tests.install.conftest import Dist
from tests.pg_databases import fresh_database

ROOT = Path(__file__).resolve().parents[2]
RUN = uuid.uuid4().hex[:10]  # names and labels of what this run makes
TEST_LABEL = f"io.toolreg.test-run={RUN}"
AUDIENCE = "toolreg-image-test"
AGENT_TOKEN = f"agent-{uuid.uuid4().hex}"
OPS_TOKEN = f"ops-{uuid.uuid4().hex}"  # registers the egress tool
HEADER_SECRET = f"header-{uuid.uuid4().hex}"  # added by the proxy: never in the sandbox
FILE_SECRET = f"file-{uuid.uuid4().hex}"  # read by the sandbox from /run/secrets
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
    with fresh_database(url, f"toolreg_image_{RUN}") as made:
        yield made


@dataclass
class Served:
    container: str
    address: str
    data_dir: Path
    ca_pem: bytes
    approver_keys: dict[str, bytes]

    def stub(self, token: str = AGENT_TOKEN) -> pb_grpc.ToolRegistryStub:
        return pb_grpc.ToolRegistryStub(open_channel(self.address, token=token, tls_ca=self.ca_pem))

    def inspect(self) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(docker("container", "inspect", self.container))
        return data[0]

    def logs(self) -> str:
        done = subprocess.run(
            ["docker", "logs", "--tail", "60", self.container],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.stdout + done.stderr


def _policy(approvers: dict[str, str], world: UpstreamWorld) -> dict[str, Any]:
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
        "egress": {"allow_private": [world.subnet]},  # the world's upstreams are private
        "clients": [
            {
                "id": "agent",
                "token_sha256": sha(AGENT_TOKEN),
                "roles": ["execute"],
                "max_safety_level": "dangerous",
            },
            {
                "id": "ops",
                "token_sha256": sha(OPS_TOKEN),
                "roles": ["register", "execute"],
                "max_safety_level": "cautious",
                "register": {
                    "max_safety_level": "cautious",
                    "images": ["toolreg/python"],
                    "egress": ["api.world.test:443"],
                    "secrets": ["IMAGE_HEADER_SECRET", "IMAGE_FILE_SECRET"],
                },
            },
        ],
    }


def _owned_by_server(path: Path, mode: int) -> None:
    os.chown(path, SERVER_UID, SERVER_UID)
    path.chmod(mode)


@pytest.fixture(scope="module")
def world(image: ServerImage) -> Iterator[UpstreamWorld]:
    """The tests' upstreams and DNS on a network of their own (toolreg/python: the
    image's build made it)."""
    with UpstreamWorld(labels={"io.toolreg.test-run": RUN}) as made:
        yield made


@pytest.fixture(scope="module")
def served(
    image: ServerImage, database: str, world: UpstreamWorld,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:  # fmt: skip
    base = tmp_path_factory.mktemp("server-image")
    base.chmod(0o755)  # the server's user walks to its data directory
    data_dir, config_dir = base / "data", base / "etc"
    data_dir.mkdir()
    config_dir.mkdir()
    _owned_by_server(data_dir, 0o700)
    (data_dir / "secrets").mkdir()
    _owned_by_server(data_dir / "secrets", 0o700)
    for name, value in (("IMAGE_HEADER_SECRET", HEADER_SECRET), ("IMAGE_FILE_SECRET", FILE_SECRET)):
        (data_dir / "secrets" / name).write_text(value)
        _owned_by_server(data_dir / "secrets" / name, 0o600)
    keys = {who: generate_keypair() for who in ("alice", "bob")}
    (config_dir / "policy.yaml").write_text(
        yaml.safe_dump(
            _policy({who: pub for who, (_, pub) in keys.items()}, world), sort_keys=False
        )
    )
    (config_dir / "upstream-ca.pem").write_bytes(world.ca_file.read_bytes())
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
        # The proxy reaches the world's upstreams, resolves with its DNS, trusts its CA.
        "--env", f"TOOLREG_EGRESS_NETWORKS={json.dumps([world.network_name])}",
        "--env", f"TOOLREG_EGRESS_DNS={json.dumps([world.dns_ip])}",
        "--env", "TOOLREG_EGRESS_UPSTREAM_CA=/etc/toolreg/upstream-ca.pem",
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


# The egress tool: reads its file secret, and fetches from the world's upstream through
# the proxy (urllib reads HTTPS_PROXY) a page that echoes the header the proxy adds.
EGRESS_TOOL = r"""
import hashlib, json, sys, urllib.request
secret = open("/run/secrets/IMAGE_FILE_SECRET", "rb").read()
req = urllib.request.Request(
    "https://api.world.test/echo-header?name=Authorization",
    headers={"X-File-Secret-Sha256": hashlib.sha256(secret).hexdigest()},
)
with urllib.request.urlopen(req, timeout=30) as answer:
    body = json.load(answer)
print(json.dumps({"status": answer.status, "host": body["host"], "echoed": body["value"]}))
"""


def _egress_tool() -> pb.Tool:
    return convert.tool_to_pb(
        parse_definition(
            {
                "name": f"image_egress_{RUN}",
                "description": "fetches through the egress proxy with both kinds of secret",
                "parameters": {"type": "object"},
                "safety_level": "cautious",
                "sandbox": {"image": "toolreg/python", "command": ["python3", "-c", EGRESS_TOOL]},
                "network": {"egress": ["api.world.test:443"]},
                "secrets": [
                    {"name": "IMAGE_HEADER_SECRET", "inject": {"host": "api.world.test"}},
                    {"name": "IMAGE_FILE_SECRET", "deliver": "file"},
                ],
            }
        )
    )


def _proxy_of(served: Served) -> dict[str, Any]:
    """The egress proxy container this server started (it mounts its control dir).

    Listed by that mount, not by name alone: other test files' servers start and
    remove their own proxies on this engine meanwhile, and one removed between the
    listing and its inspect answers `[]` (exit 1), not a container."""
    control = str(served.data_dir / "egress" / "control")
    listed = docker(
        "ps", "--quiet", "--no-trunc", "--filter", "name=egress-proxy",
        "--filter", f"volume={control}",
    )  # fmt: skip
    for cid in listed.split():
        found = json.loads(docker("container", "inspect", cid, check=False) or "[]")
        if found and any(m.get("Source") == control for m in found[0].get("Mounts") or []):
            return dict(found[0])
    pytest.fail(f"no egress proxy mounts {control}: {served.logs()}")


def test_an_egress_tool_reaches_its_upstream_with_both_kinds_of_secret(
    served: Served, world: UpstreamWorld
) -> None:
    """Through the non-root server: the proxy runs as the server's uid, the sandbox (uid
    65534) reads its file secret, and the proxy adds the header secret."""
    assert _wait_healthy(served) == "healthy", served.logs()
    tool = _egress_tool()
    ops = served.stub(OPS_TOKEN)
    ops.RegisterTool(pb.RegisterToolRequest(tool=tool), timeout=60)
    result = ops.ExecuteTool(
        pb.ExecuteToolRequest(name=tool.name, arguments_json="{}"), timeout=180
    )
    assert result.success, (result.error, result.stderr, served.logs())
    out = json.loads(result.data_json)
    assert out["status"] == 200 and out["host"] == "api.world.test"
    assert HEADER_SECRET not in out["echoed"]  # masked on its way back to the tool
    (sent,) = [r for r in world.requests("api.world.test") if "/echo-header" in r["path"]]
    headers = {k.lower(): v for k, v in sent["headers"].items()}
    assert headers["authorization"] == f"Bearer {HEADER_SECRET}"
    # The sandbox's uid 65534 read the file the non-root server wrote for it.
    assert headers["x-file-secret-sha256"] == hashlib.sha256(FILE_SECRET.encode()).hexdigest()

    proxy = _proxy_of(served)
    assert proxy["Config"]["User"] == f"{SERVER_UID}:{SERVER_UID}"  # not root
    assert proxy["HostConfig"]["ReadonlyRootfs"] is True
    assert proxy["HostConfig"]["CapDrop"] == ["ALL"]
    status = docker("exec", proxy["Id"], "python3", "-c", "print(open('/proc/1/status').read())")
    ids = {k: v.split() for k, _, v in (line.partition(":") for line in status.splitlines())}
    assert ids["Uid"][0] == ids["Gid"][0] == str(SERVER_UID)
    # Its own group alone: not the socket's, which the server was given.
    assert set(ids["Groups"]) <= {str(SERVER_UID)}
    assert str(SOCKET.stat().st_gid) not in ids["Groups"]
    control = (served.data_dir / "egress" / "control").stat()
    assert (control.st_uid, stat.S_IMODE(control.st_mode)) == (SERVER_UID, 0o700)
    run_dir = served.data_dir / "egress" / "run"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    deadline = time.monotonic() + 30  # the sandbox is removed after the answer
    while list(run_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(run_dir.iterdir()) == []  # the call's secret file went with it


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

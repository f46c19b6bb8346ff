"""`toolreg doctor` against the real things, one failure it names at a time: a second
Docker engine of this test's own (no toolreg images, no gVisor runtime, then stopped),
a PostgreSQL that is not there and the tests' one that is, a read-only data directory,
an invalid policy, an identity provider that does not answer, a TLS key of another
certificate, a port in use, an init for another architecture (doctor, and `toolreg
serve` refusing it). The main engine, its images and its configuration are never
touched: other tests use them.

Doctor runs as the `toolreg` command of this checkout's venv, in a subprocess, with
the environment cleared of TOOLREG_* and DOCKER_HOST so only what a test gives counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox_runner import pieces
from sandbox_runner.pieces import EM_AARCH64, EM_X86_64
from sandbox_runner.spec import INIT_BINARY
from tests.certs import CertificateAuthority
from tests.pg_databases import fresh_database as new_database

ROOT = Path(__file__).resolve().parents[2]
TOOLREG = ROOT / ".venv" / "bin" / "toolreg"
EXAMPLES = ROOT / "examples" / "tools"
DOCTOR_TIMEOUT_S = 60  # seconds for one doctor run (each probe is bounded by 5 s)
ENGINE_START_S = 30  # seconds for the second dockerd to answer
SERVE_START_S = 60  # seconds for `toolreg serve` to say it serves
E_MACHINE_OFFSET = 18  # the ELF header's e_machine (little-endian on x86_64 and aarch64)


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("TOOLREG_") and k != "DOCKER_HOST"
    }
    return {**env, **extra}


@dataclass(frozen=True)
class Doctor:
    code: int
    document: dict[str, Any]
    text: str

    def check(self, name: str) -> dict[str, str]:
        found = [c for c in self.document["checks"] if c["name"] == name]
        assert len(found) == 1, (name, self.document)
        return found[0]

    def status(self, name: str) -> str:
        return self.check(name)["status"]

    def expect(self, name: str, status: str) -> dict[str, str]:
        """The check, asserted to have ``status`` (its detail shown when not)."""
        check = self.check(name)
        assert check["status"] == status, check
        return check


def doctor(data_dir: Path, *args: str, text: bool = False, **env: str) -> Doctor:
    """`toolreg doctor --json`; with ``text``, the same in text too (one line per
    check, fixes under them), whose exit status must agree."""
    base = [str(TOOLREG), "doctor", "--data-dir", str(data_dir), *args]
    as_json = subprocess.run(
        [*base, "--json"], env=clean_env(**env), capture_output=True, text=True,
        timeout=DOCTOR_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert as_json.returncode in (0, 1), as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["ok"] is (as_json.returncode == 0)
    if not text:
        return Doctor(as_json.returncode, document, "")
    shown = subprocess.run(
        base, env=clean_env(**env), capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert shown.returncode == as_json.returncode, shown.stdout + shown.stderr
    assert len([line for line in shown.stdout.splitlines() if not line.startswith(" ")]) == (
        len(document["checks"]) + 1  # and the summary
    )
    return Doctor(as_json.returncode, document, shown.stdout)


# -- a second engine of this module's own -----------------------------------------------------


@dataclass
class SecondEngine:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def second_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecondEngine]:
    """A dockerd of its own: own data root, exec root, pid file, socket and an empty
    daemon.json (so none of the main engine's runtimes), no iptables, and a bridge of its
    own. Not --bridge=none: a dockerd started so deletes the host's docker0, the main
    engine's default bridge, and every later container on it fails to start."""
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.fail("a second Docker engine needs dockerd and root (make engine installs it)")
    tag = uuid.uuid4().hex[:8]
    home = Path(f"/tmp/toolreg-doctor-{tag}")  # a short unix socket path
    home.mkdir(mode=0o700)
    bridge = f"trdk{tag}"  # at most 15 characters
    main_bridge = Path("/sys/class/net/docker0").exists()
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _bridge_up(bridge)
    except BaseException:
        _ip("link", "del", bridge)
        raise
    (home / "daemon.json").write_text("{}")
    sock = home / "docker.sock"
    log = tmp_path_factory.mktemp("second-engine") / "dockerd.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [dockerd, "--config-file", str(home / "daemon.json"),
             "--data-root", str(home / "data"), "--exec-root", str(home / "exec"),
             "--pidfile", str(home / "docker.pid"), "--host", f"unix://{sock}",
             f"--bridge={bridge}", "--iptables=false", "--ip-masq=false",
             "--storage-driver=vfs", "--log-level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    engine = SecondEngine(f"unix://{sock}", process, log)
    try:
        deadline = time.monotonic() + ENGINE_START_S
        while not _answers(sock):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the second dockerd did not answer: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield engine
    finally:
        engine.stop()
        _ip("link", "del", bridge)
        shutil.rmtree(home, ignore_errors=True)
    # The main engine's containers still have their bridge.
    assert Path("/sys/class/net/docker0").exists() or not main_bridge


# The second engine's bridge address: a documentation range (RFC 5737) that this
# machine does not use, so it takes no route from the main engine's 172.17.0.0/16.
SECOND_BRIDGE_ADDRESS = "198.51.100.1/30"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _bridge_up(name: str) -> None:
    taken = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True)
    assert SECOND_BRIDGE_ADDRESS.split("/")[0] not in taken.stdout, taken.stdout
    _ip("addr", "add", SECOND_BRIDGE_ADDRESS, "dev", name)
    _ip("link", "set", name, "up")


def _answers(sock: Path) -> bool:
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        try:
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in s.recv(64)
        except OSError:
            return False


def test_a_fresh_engine_has_no_images_and_no_gvisor(
    second_engine: SecondEngine, tmp_path: Path
) -> None:
    found = doctor(
        tmp_path / "data", "--docker-url", second_engine.url, "--tools", str(EXAMPLES), text=True
    )
    assert found.code == 1
    found.expect("tools", "ok")
    tool_images = found.check("tool_images")
    assert tool_images["status"] == "fail"
    assert "toolreg/base:latest (echo)" in tool_images["detail"]
    assert "toolreg images build" in tool_images["fix"]
    found.expect("engine", "ok")
    assert "cgroup v" in found.check("engine")["detail"]
    found.expect("runtime.runc", "ok")
    # development mode: dangerous tools would run under runc, a warning
    found.expect("runtime.runsc", "warn")
    assert found.check("runtime.runsc")["fix"] == pieces.gvisor_fix(True)
    for image in ("toolreg/base:latest", "toolreg/python-root:latest", "toolreg/python:latest"):
        check = found.check(f"image.{image}")
        assert check["status"] == "fail", check
        assert "toolreg images build" in check["fix"]
    assert "fix: toolreg images build" in found.text


def test_missing_gvisor_fails_where_gvisor_is_required(
    second_engine: SecondEngine, tmp_path: Path
) -> None:
    found = doctor(
        tmp_path / "data", "--docker-url", second_engine.url, TOOLREG_REQUIRE_GVISOR="true"
    )
    found.expect("runtime.runsc", "fail")
    found.expect("runtime.runsc-net", "fail")
    assert "make engine" in found.check("runtime.runsc")["fix"]


@contextlib.contextmanager
def served(tmp_path: Path, **env: str) -> Iterator[tuple[str, Path]]:
    """`toolreg serve --tools <the examples>` on a free loopback port, until it says
    it serves; its address and its log (stdout and stderr)."""
    port = _closed_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(TOOLREG), "serve", "--port", str(port), "--data-dir", str(tmp_path / "state"),
             "--tools", str(EXAMPLES)],
            env=clean_env(**env), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + SERVE_START_S
        while "toolreg serving on" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}", log
    finally:
        process.terminate()
        process.wait(timeout=30)


def exec_tool(address: str, name: str = "echo", args: str = '{"message": "hi"}') -> dict[str, Any]:
    proc = subprocess.run(
        [str(TOOLREG), "exec", name, "--args", args, "--address", address, "--json"],
        env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    result: dict[str, Any] = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {**result, "stderr": proc.stderr}


def test_calls_missing_an_image_or_gvisor_name_the_piece_and_its_fix(
    second_engine: SecondEngine, tmp_path: Path
) -> None:
    with served(tmp_path, TOOLREG_DOCKER_URL=second_engine.url, TOOLREG_REQUIRE_GVISOR="true") as (
        address,
        log,
    ):
        result = exec_tool(address)
        # a dangerous tool, where gVisor is required: refused before any approval is asked
        dangerous = exec_tool(address, "write_file", '{"path": "a.txt", "content": "x"}')
        said = log.read_text()
    assert result["status"] == "EXECUTION_STATUS_SANDBOX_ERROR"
    assert "image 'toolreg/base' not found locally" in result["error"]
    assert "toolreg images build" in result["error"]
    assert dangerous["status"] == "EXECUTION_STATUS_SANDBOX_ERROR"
    assert "needs gVisor (runsc), which this engine lacks" in dangerous["error"]
    assert pieces.gvisor_fix(True) in dangerous["error"]
    # and at start, that dangerous tools will be refused, with the command that fixes it
    assert f"dangerous tools will be refused; fix: {pieces.gvisor_fix(True)}" in said


def test_serve_without_an_engine_names_how_to_start_one(tmp_path: Path) -> None:
    nowhere = f"unix://{tmp_path}/no-engine.sock"
    with served(tmp_path, TOOLREG_DOCKER_URL=nowhere) as (address, log):
        result = exec_tool(address)
        said = log.read_text()
    assert "container engine unavailable at start-up" in said
    assert f"fix: {pieces.engine_fix(True)}" in said
    assert "make engine" in result["stderr"] + json.dumps(result), result


def test_a_stopped_engine_fails_naming_how_to_start_one(
    second_engine: SecondEngine, tmp_path: Path
) -> None:
    second_engine.stop()  # the last test of this module that uses it
    started = time.monotonic()
    # TOOLREG_DOCKER_URL: as serve reads it
    found = doctor(tmp_path / "data", text=True, TOOLREG_DOCKER_URL=second_engine.url)
    assert time.monotonic() - started < DOCTOR_TIMEOUT_S
    assert found.code == 1
    engine = found.check("engine")
    assert engine["status"] == "fail"
    assert "no Docker engine answers" in engine["detail"]
    assert engine["fix"] == pieces.engine_fix(True) and "make engine" in engine["fix"]
    found.expect("image.toolreg/base:latest", "warn")  # not checked without one
    assert "fix: make engine" in found.text


def test_an_image_build_without_an_engine_names_how_to_start_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(TOOLREG), "images", "build"], cwd=tmp_path, capture_output=True, text=True,
        env=clean_env(DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock"), timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no Docker engine answers; start one: make engine" in proc.stderr
    assert "toolreg images build" in proc.stderr


def test_the_main_engine_passes_the_engine_checks(tmp_path: Path) -> None:
    found = doctor(tmp_path / "data", "--tools", str(EXAMPLES))
    found.expect("tool_images", "ok")
    found.expect("engine", "ok")
    found.expect("runtime.runc", "ok")
    found.expect("image.toolreg/python-root:latest", "ok")
    found.expect("init", "ok")


# -- the store ------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_postgresql_fails_without_showing_its_password(tmp_path: Path) -> None:
    url = (
        f"postgresql://doctoruser:doctor-s3cret@127.0.0.1:{_closed_port()}/toolreg"
        "?application_name=doctorquery"
    )
    found = doctor(tmp_path / "data", "--store-url", url, text=True)
    store = found.check("store")
    assert store["status"] == "fail"
    assert "start PostgreSQL" in store["fix"]
    shown = json.dumps(found.document) + found.text
    for secret in ("doctor-s3cret", "doctoruser", "doctorquery"):  # no userinfo, no query
        assert secret not in shown


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """A database of its own on the tests' PostgreSQL, dropped after the test."""

    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ensure_postgres.sh"), "url"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"the tests' PostgreSQL is not running (make postgres): {proc.stderr}")
    admin = proc.stdout.strip()
    with new_database(admin, "doctor") as made:
        yield made


def test_the_tests_postgresql_is_reachable_and_at_this_version(
    fresh_database: str, tmp_path: Path
) -> None:
    from registry_server.store.postgres import PostgresStore

    empty = doctor(tmp_path / "data", "--store-url", fresh_database).check("store")
    assert empty["status"] == "ok" and "no store yet" in empty["detail"]
    PostgresStore(fresh_database).close()  # the schema of this version, as serve makes it
    found = doctor(tmp_path / "data", "--store-url", fresh_database, text=True)
    store = found.check("store")
    assert store["status"] == "ok" and "(this version's)" in store["detail"], store
    password = fresh_database.split("@")[0].rsplit(":", 1)[1]
    assert password not in json.dumps(found.document) + found.text


def _sqlite_store(data: Path, *, schema_delta: int, written_by: str) -> bytes:
    """A store of this release moved ``schema_delta`` schemas away, as that release
    would leave it; its bytes (doctor must leave them so)."""
    from registry_server.store.inspect import inspect_store
    from registry_server.store.sqlite import SqliteStore

    path = data / "toolreg.db"
    SqliteStore(path).close()
    known = inspect_store(f"sqlite:///{path}").known_version
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE toolreg_release SET version = ?", (written_by,))
    db.execute(f"PRAGMA user_version = {known + schema_delta}")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return path.read_bytes()


def test_a_store_of_a_newer_release_fails_naming_both_and_is_left_unchanged(
    tmp_path: Path,
) -> None:
    from registry_server.version import version

    data = tmp_path / "data"
    before = _sqlite_store(data, schema_delta=1, written_by="0.9.0")
    store = doctor(data).check("store")
    assert store["status"] == "fail"
    assert "written by toolreg 0.9.0" in store["detail"]
    assert f"this is toolreg {version()}" in store["detail"]
    assert "install toolreg 0.9.0 or newer" in store["fix"]
    assert (data / "toolreg.db").read_bytes() == before


def test_a_store_of_an_older_schema_warns_that_serve_migrates_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    before = _sqlite_store(data, schema_delta=-1, written_by="0.1.9")
    store = doctor(data).check("store")
    assert store["status"] == "warn"
    assert "last opened by toolreg 0.1.9" in store["detail"] and "migrates it" in store["detail"]
    assert "back the store up first" in store["fix"]
    assert (data / "toolreg.db").read_bytes() == before


# -- the data directory -----------------------------------------------------------------------


def test_a_data_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("not a directory")
    check = doctor(path).check("data_dir")
    assert check["status"] == "fail" and "is not a directory" in check["detail"]
    assert "--data-dir" in check["fix"]


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs: not writable even by root, whose permission bits would pass."""
    where = tmp_path / "ro"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a read-only tmpfs here (needs root): {mounted.stderr}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_read_only_data_dir_fails_even_for_root(read_only_dir: Path) -> None:
    found = doctor(read_only_dir)
    check = found.check("data_dir")
    assert check["status"] == "fail", check
    assert "Read-only file system" in check["detail"]
    # and one to be created under it
    doctor(read_only_dir / "new").expect("data_dir", "fail")


# -- the policy and its identity providers ---------------------------------------------------


def _policy(tmp_path: Path, issuer: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "audience": "toolreg-doctor",
                "clients": [{"id": "admin", "token_sha256": "0" * 64, "roles": ["admin"]}],
                "identity_providers": [
                    {"id": "corp", "issuer": issuer, "audiences": ["toolreg-doctor"],
                     "allow_http_loopback": True},
                ],
            },
            sort_keys=False,
        )
    )  # fmt: skip
    return path


def test_a_bad_manifest_fails_as_serve_would_refuse_it(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "broken.yaml").write_text("name: Not-Snake\ndescription: x\n")
    check = doctor(tmp_path / "data", "--tools", str(tools)).check("tools")
    assert check["status"] == "fail" and "broken.yaml" in check["detail"], check
    assert "correct the manifest" in check["fix"]


def test_an_invalid_policy_fails_naming_the_rule(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("audience: toolreg-doctor\nsurprise: 1\n")
    check = doctor(tmp_path / "data", "--policy", str(path)).check("policy")
    assert check["status"] == "fail"
    assert "surprise" in check["detail"]
    assert f"toolreg policy check {path}" in check["fix"]


class _Discovery(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path != "/.well-known/openid-configuration":
            self.send_error(404)
            return
        body = json.dumps({"issuer": issuer, "jwks_uri": f"{issuer}/jwks"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def discovery_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_identity_provider_whose_discovery_answers_passes(
    tmp_path: Path, discovery_server: str
) -> None:
    found = doctor(tmp_path / "data", "--policy", str(_policy(tmp_path, discovery_server)))
    found.expect("policy", "ok")
    found.expect("idp.corp", "ok")


def test_an_identity_provider_that_does_not_answer_fails(tmp_path: Path) -> None:
    issuer = f"http://127.0.0.1:{_closed_port()}"
    found = doctor(tmp_path / "data", "--policy", str(_policy(tmp_path, issuer)))
    found.expect("policy", "ok")
    idp = found.check("idp.corp")
    assert idp["status"] == "fail" and "discovery" in idp["detail"]
    assert "identity_providers entry corp" in idp["fix"]


# -- TLS ---------------------------------------------------------------------------------------


def test_a_tls_key_of_another_certificate_fails(tmp_path: Path) -> None:
    ca = CertificateAuthority("doctor-ca")
    server, other = ca.issue("server", server=True), ca.issue("other", server=True)
    cert, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.write_bytes(server.cert_pem)
    key.write_bytes(other.key_pem)
    ca_file.write_bytes(ca.pem)
    args = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca_file))
    found = doctor(tmp_path / "data", *args)
    tls = found.check("tls")
    assert tls["status"] == "fail" and "does not match" in tls["detail"]
    assert "--tls-key" in tls["fix"]
    found.expect("tls.client_ca", "ok")
    key.write_bytes(server.key_pem)
    # a pair now (the test CA's certificates live a day: "expires" warns, never fails)
    matched = doctor(tmp_path / "data", *args).check("tls")
    assert matched["status"] in ("ok", "warn") and "certificate and key match" in matched["detail"]
    (tmp_path / "gone.pem").unlink(missing_ok=True)
    unreadable = doctor(tmp_path / "data", *args[:4], "--tls-client-ca", str(tmp_path / "gone.pem"))
    unreadable.expect("tls.client_ca", "fail")


# -- ports -------------------------------------------------------------------------------------


def test_ports_in_use_fail(tmp_path: Path) -> None:
    with socket.socket() as grpc_port, socket.socket() as metrics_port:
        for s in (grpc_port, metrics_port):
            s.bind(("127.0.0.1", 0))
            s.listen()
        port, metrics = grpc_port.getsockname()[1], metrics_port.getsockname()[1]
        found = doctor(tmp_path / "data", "--port", str(port), "--metrics-port", str(metrics))
    for name, number in (("port.grpc", port), ("port.metrics", metrics)):
        check = found.check(name)
        assert check["status"] == "fail", check
        assert f":{number}" in check["detail"] and f"sport = :{number}" in check["fix"]
    free = doctor(tmp_path / "data", "--port", str(port), "--metrics-port", str(metrics))
    free.expect("port.grpc", "ok")
    free.expect("port.metrics", "ok")


# -- the init ----------------------------------------------------------------------------------


@pytest.fixture
def foreign_init(tmp_path: Path) -> Path:
    """The real init with its ELF header saying another machine."""
    if not INIT_BINARY.is_file():
        pytest.fail(f"the sandbox init {INIT_BINARY} is not built: run `make init`")
    data = bytearray(INIT_BINARY.read_bytes())
    here = int.from_bytes(data[E_MACHINE_OFFSET : E_MACHINE_OFFSET + 2], "little")
    other = EM_AARCH64 if here == EM_X86_64 else EM_X86_64
    data[E_MACHINE_OFFSET : E_MACHINE_OFFSET + 2] = other.to_bytes(2, "little")
    path = tmp_path / "toolreg-init"
    path.write_bytes(bytes(data))
    path.chmod(0o755)
    return path


def test_an_init_for_another_architecture_fails_in_doctor(
    foreign_init: Path, tmp_path: Path
) -> None:
    found = doctor(tmp_path / "data", TOOLREG_INIT_PATH=str(foreign_init))
    init = found.check("init")
    assert init["status"] == "fail"
    assert "is an init for" in init["detail"] and str(foreign_init) in init["detail"]
    assert init["fix"].startswith(pieces.init_fix(True))  # "make init" in a checkout


def test_serve_refuses_an_init_for_another_architecture(foreign_init: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(TOOLREG), "serve", "--data-dir", str(tmp_path / "data"), "--port", "0"],
        env=clean_env(TOOLREG_INIT_PATH=str(foreign_init)), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "is an init for" in proc.stderr
    assert "make init" in proc.stderr

"""Upgrades keep the audit log (docs/how-to/deploying.md, "Upgrades"): a store written by
toolreg 0.1.0's own code, SQLite and PostgreSQL, opens with this release.

The old store is made by running 0.1.0 itself: its source is taken from git (the
commit tagged v0.1.0), its init compiled from that source, and
tests/install/old_release_store.py runs a real 0.1.0 server on it against the
real engine: a safe call, an approved dangerous call (two tokens spent), a
request left pending with one of its two approvals, and audit checkpoints signed
with the log key and cosigned by a witness. Then this release's `toolreg serve`
opens the same store and the test checks that the migrations applied, the tools
kept their digests, the spent tokens stay spent (a replay is refused), the pending
request is approved and runs once, the hash chain and the old checkpoint verify
with the log's key alone, and the witness cosigns the next checkpoint as a
consistent extension of the one 0.1.0 signed.

A store from a newer release is refused, naming both releases, and left byte for
byte (or row for row) as it was."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
import yaml

from registry_server.api.config import CHECKPOINT_COPY_FILENAME, DB_FILENAME
from registry_server.cli.launcher import ServerProcess, spawn_server, spawn_until
from registry_server.client.registry_client import RegistryClient, Status
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.store.inspect import inspect_store
from registry_server.version import version
from tests.factories import sha
from tests.pg_databases import fresh_database

ROOT = Path(__file__).resolve().parents[2]
OLD_RELEASE = "0.1.0"
OLD_COMMIT = "35ecf4978419f37f5666b7ea291cd668a7f755b4"  # tag v0.1.0
OLD_SCHEMA = {"sqlite": 13, "postgresql": 10}  # 0.1.0's last migration, per store
GENERATOR = Path(__file__).with_name("old_release_store.py")
ENSURE_POSTGRES = ROOT / "scripts" / "ensure_postgres.sh"
TOOLREG = [sys.executable, "-m", "registry_server.cli"]
AUDIENCE = "toolreg-upgrade"
ORIGIN = "toolreg.example/upgrade"
WITNESS = "witness.example/upgrade"
TOKENS = {"agent": "upgrade-agent-token", "desk": "upgrade-desk-token"}
INIT_CFLAGS = ["-std=c11", "-Os", "-static", "-s", "-Wall", "-Wextra", "-Werror"]
SERVING = re.compile(r"serving on (http://\S+)")


def toolreg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOOLREG, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)  # fmt: skip


@pytest.fixture(scope="module")
def old_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """0.1.0's source tree, as git holds it, with its init compiled from its source."""
    where = tmp_path_factory.mktemp("toolreg-0.1.0")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT],
                             capture_output=True, timeout=120, check=False)  # fmt: skip
    assert archive.returncode == 0, (
        f"git history must hold 0.1.0 ({OLD_COMMIT}): {archive.stderr.decode()[-500:]}"
    )
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    init = where / "sandbox_runner" / "init"
    subprocess.run(["gcc", *INIT_CFLAGS, "-o", str(init / "toolreg-init"),
                    str(init / "toolreg_init.c")], check=True, timeout=120)  # fmt: skip
    (init / "toolreg-init").chmod(0o755)
    return where


@dataclass
class Deployment:
    base: Path
    store_url: str | None  # None: SQLite in the data directory
    log_vkey: str
    witness_vkey: str

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def policy(self) -> Path:
        return self.base / "policy.yaml"

    @property
    def log_key(self) -> Path:
        return self.base / "log.key"

    def approver_key(self, who: str) -> Path:
        return self.base / f"{who}.key"

    @property
    def url(self) -> str:
        return self.store_url or f"sqlite:///{self.data / DB_FILENAME}"


def make_deployment(base: Path, store_url: str | None) -> Deployment:
    approvers = {}
    for who in ("alice", "bob"):
        private, public = generate_keypair()
        path = base / f"{who}.key"
        path.write_bytes(private)
        path.chmod(0o600)
        approvers[who] = public
    policy = {
        "audience": AUDIENCE,
        "approvers": [{"id": w, "public_key": k, "groups": ["security"]} for w, k in approvers.items()],
        "approval_rules": [{"name": "two-for-files", "match": {"tool": "write_file"},
                            "approvals_required": 2, "groups": ["security"]}],
        "clients": [
            {"id": "agent", "token_sha256": sha(TOKENS["agent"]), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "desk", "token_sha256": sha(TOKENS["desk"]), "roles": ["approve"]},
        ],
    }  # fmt: skip
    (base / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    made = toolreg("keys", "generate", "--out", str(base / "log.key"))
    assert made.returncode == 0, made.stderr
    vkey = toolreg("audit", "verifier-key", "--key", str(base / "log.pub"), "--origin", ORIGIN)
    assert vkey.returncode == 0, vkey.stderr
    witness = toolreg("witness", "keygen", "--out", str(base / "witness.key"), "--name", WITNESS)
    assert witness.returncode == 0, witness.stderr
    return Deployment(base, store_url, vkey.stdout.strip(), witness.stdout.strip())


class Witness:
    def __init__(self, d: Deployment) -> None:
        argv = [*TOOLREG, "witness", "serve", "--key", str(d.base / "witness.key"), "--name",
                WITNESS, "--log", d.log_vkey, "--state", str(d.base / "witness-state.json"),
                "--listen", "127.0.0.1:0", "--log-format", "text"]  # fmt: skip
        self.proc, self.url, self.log = spawn_until(argv, SERVING, what="toolreg witness", cwd=ROOT)

    def cosigned(self, after: int, timeout_s: float = 30) -> int:
        """The size of the first checkpoint cosigned as an extension of ``after``."""
        pattern = re.compile(rf"cosigned {re.escape(ORIGIN)} at size (\d+) .*after size {after}$")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.log):
                if m := pattern.search(line.rstrip()):
                    return int(m.group(1))
            time.sleep(0.1)
        raise AssertionError(f"no cosignature after size {after}:\n" + "".join(self.log[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)


def run_old_release(old_source: Path, d: Deployment, witness: Witness) -> dict[str, object]:
    """0.1.0's server fills the store; what it made, as the generator reports it."""
    spec = {
        "data_dir": str(d.data), "store_url": d.store_url, "policy_file": str(d.policy),
        "log_key_file": str(d.log_key), "tools_dir": str(old_source / "examples" / "tools"),
        "tokens": TOKENS, "approvers": {w: str(d.approver_key(w)) for w in ("alice", "bob")},
        "log_origin": ORIGIN, "witness": f"{d.witness_vkey} {witness.url}",
    }  # fmt: skip
    (d.base / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLREG_")}
    env["PYTHONPATH"] = str(old_source)  # 0.1.0's packages before this checkout's
    done = subprocess.run(
        [sys.executable, str(GENERATOR), str(d.base / "spec.json"), str(d.base / "old.json")],
        cwd=old_source, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    made: dict[str, object] = json.loads((d.base / "old.json").read_text())
    assert made["release"] == OLD_RELEASE  # it really ran 0.1.0's code
    return made


def serve_new(d: Deployment, witness: Witness) -> ServerProcess:
    args = ["--policy", str(d.policy), "--log-key", str(d.log_key), "--log-origin", ORIGIN,
            "--checkpoint-every", "1", "--checkpoint-interval-s", "1",
            "--witness", f"{d.witness_vkey} {witness.url}"]  # fmt: skip
    if d.store_url:
        args += ["--store-url", d.store_url]
    return spawn_server(d.data, *args, cwd=ROOT)


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh database on the tests' PostgreSQL (make test starts it); dropped after."""
    done = subprocess.run(["bash", str(ENSURE_POSTGRES)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    maintenance = done.stdout.strip()
    with fresh_database(maintenance, "toolreg_upgrade") as made:
        yield made


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_store_written_by_0_1_0_opens_with_this_release(
    kind: str, old_source: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store_url = request.getfixturevalue("pg_database") if kind == "postgresql" else None
    d = make_deployment(tmp_path, store_url)
    witness = Witness(d)
    try:
        made = run_old_release(old_source, d, witness)
        before = inspect_store(d.url)
        assert (before.schema_version, before.written_by) == (OLD_SCHEMA[kind], None)
        assert before.behind
        old_checkpoint = (d.data / CHECKPOINT_COPY_FILENAME).read_text()
        old_size = int(old_checkpoint.splitlines()[1])
        assert old_size >= 4  # the calls' records, checkpointed by 0.1.0
        (tmp_path / "old-checkpoint.txt").write_text(old_checkpoint)

        server = serve_new(d, witness)
        try:
            after = inspect_store(d.url)
            assert after.schema_version == after.known_version > OLD_SCHEMA[kind]
            assert after.written_by == version()
            with (
                RegistryClient.connect(server.address, token=TOKENS["agent"]) as agent,
                RegistryClient.connect(server.address, token=TOKENS["desk"]) as desk,
            ):
                # The tools, with the digests 0.1.0 gave them.
                tools = {t.name: t.digest for t in agent.list_tool_definitions()}
                assert tools == made["tools"]
                # Spent tokens stay spent: the same approved call again is refused.
                written = made["written"]
                assert isinstance(written, dict)
                spent = made["spent_tokens"]
                assert isinstance(spent, list)
                replay = agent.execute_tool("write_file", written, approval_tokens=spent)
                assert replay.status is Status.APPROVAL_DENIED, replay
                assert "already" in replay.error.lower() or "used" in replay.error.lower(), replay
                # The pending request kept its first approval; a second one runs it, once.
                pending = made["pending"]
                assert isinstance(pending, dict)
                seen = desk.get_approval_request(pending["id"])
                assert (seen.state, seen.approved_by) == ("PENDING", ("alice",))
                key = load_private_key(d.approver_key("bob").read_bytes())
                approved = desk.submit_approval_token(
                    seen.id, mint_for(key, issuer="bob", request=seen)
                )
                assert approved.state == "APPROVED"
                ran = agent.execute_tool(
                    "write_file", pending["arguments"], approval_request_id=seen.id
                )
                assert ran.status is Status.OK, ran
                again = agent.execute_tool(
                    "write_file", pending["arguments"], approval_request_id=seen.id
                )
                assert again.status is not Status.OK  # consumed: it ran once
            # The witness cosigns this release's next checkpoint as extending 0.1.0's.
            new_size = witness.cosigned(after=old_size)
            assert new_size > old_size
        finally:
            assert server.stop() == 0
        # The chain, and the old checkpoint with the log's public key alone.
        where = ["--store-url", d.store_url] if d.store_url else ["--data-dir", str(d.data)]
        chain = toolreg("audit", "verify", *where)
        assert chain.returncode == 0, chain.stdout + chain.stderr
        extends = toolreg("audit", "verify", "--checkpoint", str(tmp_path / "old-checkpoint.txt"),
                          "--key", d.log_vkey, *where)  # fmt: skip
        assert extends.returncode == 0, extends.stdout + extends.stderr
    finally:
        witness.stop()


def _sqlite_files(data: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(data.glob(f"{DB_FILENAME}*"))
    }


def _pg_dump(url: str) -> str:
    with psycopg.connect(url) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )]  # fmt: skip
        return json.dumps({
            t: [list(map(str, r)) for r in conn.execute(f'SELECT * FROM "{t}" ORDER BY 1')]
            for t in tables
        })  # fmt: skip


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_store_from_a_newer_release_is_refused_and_left_unchanged(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store_url = request.getfixturevalue("pg_database") if kind == "postgresql" else None
    data = tmp_path / "data"
    # This release makes the store; then "0.9.0" moves it one schema ahead.
    first = spawn_server(data, *(["--store-url", store_url] if store_url else []), cwd=ROOT)
    assert first.stop() == 0
    url = store_url or f"sqlite:///{data / DB_FILENAME}"
    known = inspect_store(url).known_version
    if store_url:
        with psycopg.connect(store_url, autocommit=True) as conn:
            conn.execute("UPDATE toolreg_schema SET version = %s", (known + 1,))
            conn.execute("UPDATE toolreg_release SET version = '0.9.0'")
        snapshot = _pg_dump(store_url)
    else:
        db = sqlite3.connect(data / DB_FILENAME, isolation_level=None)
        db.execute("UPDATE toolreg_release SET version = '0.9.0'")
        db.execute(f"PRAGMA user_version = {known + 1}")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        snapshot = json.dumps(_sqlite_files(data))
    state = inspect_store(url)
    assert state.ahead and state.written_by == "0.9.0"

    done = subprocess.run(
        [*TOOLREG, "serve", "--port", "0", "--data-dir", str(data),
         *(["--store-url", store_url] if store_url else [])],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0
    said = done.stderr
    assert f"written by toolreg 0.9.0 (store schema {known + 1})" in said, said
    assert f"this is toolreg {version()}, which knows schema {known}" in said, said
    assert "left unchanged" in said
    assert "Traceback" not in said
    if store_url:
        password = urlsplit(store_url).password
        assert password and password not in said  # the URL is named without it
        assert _pg_dump(store_url) == snapshot
    else:
        assert json.dumps(_sqlite_files(data)) == snapshot

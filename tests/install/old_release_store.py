"""Run by tests/install/test_upgrade.py under an OLD release's code (PYTHONPATH at
that release's source, taken from git): it fills a store the way that release's
server does, then writes what it made to a JSON file for the test to check
after the upgrade.

Usage: python old_release_store.py SPEC.json OUT.json

SPEC: data_dir, store_url (or null: SQLite in data_dir), policy_file, log_key_file,
log_origin, witness ("VKEY URL"), tools_dir, tokens {agent, desk}, approvers {id: private
key PEM path}.

Only APIs that release had are used here: this file must keep working against
0.1.0 (it is not imported by the tests; it runs in its own process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_pem_private_key

from registry_server.api.config import ServerConfig
from registry_server.api.server import create_server
from registry_server.client.registry_client import RegistryClient, Status
from registry_server.signing.tokens import mint_for

WRITTEN = {"path": "notes/upgrade.txt", "content": "written by 0.1.0"}
PENDING = {"path": "notes/pending.txt", "content": "approved after the upgrade"}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    keys = {
        who: load_pem_private_key(Path(path).read_bytes(), None)
        for who, path in spec["approvers"].items()
    }
    settings = {
        "host": "127.0.0.1", "port": 0, "data_dir": Path(spec["data_dir"]),
        "tools_dir": Path(spec["tools_dir"]), "policy_file": Path(spec["policy_file"]),
        "log_key_file": Path(spec["log_key_file"]), "log_origin": spec["log_origin"],
        "checkpoint_every": 1, "checkpoint_interval_s": 1, "witnesses": (spec["witness"],),
    }  # fmt: skip
    if spec.get("store_url"):
        settings["store_url"] = spec["store_url"]
    server, port, app = create_server(ServerConfig(**settings))
    server.start()
    out: dict[str, object] = {}
    try:
        address = f"127.0.0.1:{port}"
        with (
            RegistryClient.connect(address, token=spec["tokens"]["agent"]) as agent,
            RegistryClient.connect(address, token=spec["tokens"]["desk"]) as desk,
        ):
            echo = agent.execute_tool("echo", {"message": "hello from 0.1.0"})
            assert echo.status is Status.OK, echo
            # An approved dangerous call: its two tokens are spent in this store.
            first = agent.execute_tool("write_file", WRITTEN)
            assert first.status is Status.APPROVAL_REQUIRED, first
            request = first.approval_request
            assert request is not None
            tokens = [mint_for(keys[who], issuer=who, request=request) for who in ("alice", "bob")]
            ran = agent.execute_tool("write_file", WRITTEN, approval_tokens=tokens)
            assert ran.status is Status.OK, ran
            # A request left pending with one of its two approvals.
            second = agent.execute_tool("write_file", PENDING)
            assert second.status is Status.APPROVAL_REQUIRED, second
            pending = second.approval_request
            assert pending is not None
            desk.submit_approval_token(
                pending.id, mint_for(keys["alice"], issuer="alice", request=pending)
            )
            out = {
                "release": _release(),
                "tools": {t.name: t.digest for t in agent.list_tool_definitions()},
                "spent_tokens": tokens,
                "written": WRITTEN,
                "pending": {"id": pending.id, "arguments": PENDING},
                "executions": [echo.execution_id, ran.execution_id],
            }
    finally:
        server.stop(grace=None).wait()
        app.close()
    Path(out_path).write_text(json.dumps(out, indent=2))


def _release() -> str:
    import registry_server

    return str(registry_server.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:3])

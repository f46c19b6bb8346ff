"""A real `toolreg serve` process with a policy, for the agent-framework adapters'
tests: an agent client, two approvers with Ed25519 keys, and the example tools
(word_count and echo safe, run_python cautious, write_file dangerous)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import ApprovalRequestView, RegistryClient
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.models import SafetyLevel
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests.factories import example_tools_policy, token_client

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tools"
RECORDED_CALLS = ROOT / "examples" / "recorded_tool_calls.json"
TOKENS = {"agent": "adapters-agent", "alice": "adapters-alice", "bob": "adapters-bob"}
APPROVERS = ("alice", "bob")


@dataclass
class PolicyServer:
    process: ServerProcess
    data_dir: Path
    keys: dict[str, bytes]  # approver id -> private key (PEM)

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def workspace(self) -> Path:
        return self.data_dir / "workspace"  # where write_file writes (the server's default)

    def client(self, who: str = "agent") -> RegistryClient:
        return RegistryClient.connect(self.address, token=TOKENS[who])

    def request(self, request_id: str) -> ApprovalRequestView:
        """The request as an approver reads it."""
        with self.client("alice") as alice:
            return alice.get_approval_request(request_id)

    def approve(self, request_id: str, who: str = "alice") -> ApprovalRequestView:
        """What `toolreg approvals approve ID --key KEY` does for ``who``."""
        key = load_private_key(self.keys[who])
        with self.client(who) as approver:
            request = approver.get_approval_request(request_id)
            token = mint_for(key, issuer=who, request=request, bind_request=True)
            return approver.submit_approval_token(request_id, token)

    def requests_for(self, tool: str, arguments: dict[str, Any]) -> list[ApprovalRequestView]:
        """Every approval request (any state) for exactly this call."""
        digest = arguments_digest(arguments)
        with self.client("alice") as alice:
            listed = alice.list_approval_requests(limit=500)
        return [r for r in listed if r.tool_name == tool and r.arguments_digest == digest]

    def executions(self, tool: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """The server's execution log records (one JSON line each) of exactly this call."""
        digest = arguments_digest(arguments)
        found = []
        for line in list(self.process.log):
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("tool") == tool and record.get("args_digest") == digest:
                found.append(record)
        return found

    def stop(self) -> int:
        return self.process.stop()


# (max_level, categories) pairs each adapter is listed with, against GetToolSchemas.
FILTERS: list[tuple[Any, tuple[str, ...]]] = [
    (None, ()),
    (SafetyLevel.SAFE, ()),
    ("cautious", ()),
    (None, ("text",)),
    (None, ("files", "code")),
    (SafetyLevel.CAUTIOUS, ("text", "files")),
]


def write_policy(path: Path, public_keys: dict[str, str], *, request_ttl_s: int) -> None:
    clients = [
        token_client("agent", TOKENS["agent"], ["execute", "register"], "dangerous"),
        *(token_client(who, TOKENS[who], ["approve"]) for who in APPROVERS),
    ]
    policy = example_tools_policy(
        "toolreg-adapters", public_keys, clients, approval_request_ttl_s=request_ttl_s
    )
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def start_policy_server(base: Path, *, request_ttl_s: int = 3600) -> PolicyServer:
    keys: dict[str, bytes] = {}
    public: dict[str, str] = {}
    for who in APPROVERS:
        keys[who], public[who] = generate_keypair()
    policy = base / "policy.yaml"
    write_policy(policy, public, request_ttl_s=request_ttl_s)
    data = base / "data"
    process = spawn_server(
        data, "--policy", str(policy), "--tools", str(EXAMPLES), "--log-format", "json", cwd=ROOT
    )
    return PolicyServer(process, data, keys)


def recorded_turns() -> list[list[dict[str, Any]]]:
    """The tool calls of each recorded assistant turn (OpenAI chat format)."""
    turns = json.loads(RECORDED_CALLS.read_text(encoding="utf-8"))
    return [list(turn.get("tool_calls") or ()) for turn in turns]

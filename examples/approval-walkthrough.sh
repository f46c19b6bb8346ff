#!/usr/bin/env bash
# Approving a dangerous call (write_file) with two approvers, end to end.
# docs/tutorials/first-approved-call.md walks through these same steps; tests/security/test_walkthrough.py
# runs this script. Needs the `toolreg` command on PATH (make install: .venv/bin)
# and the sandbox images (make images).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
port="${TOOLREG_WALKTHROUGH_PORT:-50061}"
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
cd "$work"

# 1. Each approver makes a key pair; only the public half goes into the policy.
toolreg keys generate --out alice.key
toolreg keys generate --out bob.key

# 2. The policy: write_file needs 2 approvals from the security group; the
#    agent may execute, the approvers may approve. Bearer tokens are stored
#    only as their sha256.
sha() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
cat > policy.yaml <<POLICY
audience: toolreg-walkthrough
approvers:
  - {id: alice, public_key: "$(cat alice.pub)", groups: [security]}
  - {id: bob, public_key: "$(cat bob.pub)", groups: [security]}
approval_rules:
  - match: {tool: write_file}
    approvals_required: 2
    groups: [security]
    max_token_ttl_s: 900
clients:
  - {id: agent, token_sha256: $(sha agent-secret), roles: [execute], max_safety_level: dangerous}
  - {id: alice, token_sha256: $(sha alice-secret), roles: [approve]}
  - {id: bob, token_sha256: $(sha bob-secret), roles: [approve]}
POLICY

# 3. The server, with the example tools.
toolreg serve --port "$port" --data-dir data --policy policy.yaml --tools "$here/tools" 2> server.log &
server=$!
export TOOLREG_ADDRESS="127.0.0.1:$port"
for _ in $(seq 100); do grep -q "serving on" server.log && break; sleep 0.1; done

# 4. The agent asks; the server answers APPROVAL_REQUIRED with a request id.
args='{"path": "notes/plan.txt", "content": "ship it"}'
toolreg --token agent-secret exec write_file --args "$args" 2> ask.err || true
cat ask.err
request=$(grep -o 'approval request [0-9a-f]*' ask.err | head -1 | cut -d' ' -f3)

# 5. An approver reads the request (arguments in full: `approvals show`; here
#    alice, bob could too) and each signs it with their own key; signing
#    happens in the CLI, the key never leaves it.
toolreg --token alice-secret approvals show "$request"
toolreg --token alice-secret approvals approve "$request" --key alice.key
toolreg --token bob-secret approvals approve "$request" --key bob.key

# 6. The agent calls again with the request id: it runs, once.
toolreg --token agent-secret exec write_file --args "$args" --approval-request "$request"
echo "workspace file: $(cat data/workspace/notes/plan.txt)"
if toolreg --token agent-secret exec write_file --args "$args" --approval-request "$request"; then
  echo "a consumed approval ran twice" >&2; exit 1
fi

# 7. Every step is in the hash-chained audit log.
toolreg audit verify --data-dir data
toolreg audit tail -n 3 --data-dir data

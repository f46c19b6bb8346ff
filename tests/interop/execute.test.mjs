// ExecuteTool, StreamExecuteTool and the approval path from a Node.js client.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import {
  closeAll,
  connect,
  grpc,
  mintApproval,
  rpcError,
  sha256Hex,
  tokens,
  uniqueName,
} from "./lib/client.mjs";

const TICKER = uniqueName("interop_ticker");
const LINES = 4;

let admin;
let agent;
let approver;

before(async () => {
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  approver = connect(tokens.approver);
  await admin.RegisterTool({
    tool: {
      name: TICKER,
      description: "Prints a few numbered lines, one at a time.",
      parameters_json: JSON.stringify({ type: "object", properties: {} }),
      safety_level: "SAFETY_LEVEL_SAFE",
      categories: ["interop"],
      sandbox: {
        image: "toolreg/base",
        command: ["sh", "-c", `for i in $(seq 1 ${LINES}); do echo "line $i"; sleep 0.2; done`],
      },
    },
  });
});
after(closeAll);

describe("ExecuteTool", () => {
  test("echo succeeds and data_json round-trips the arguments", async () => {
    const args = { message: "héllo from node", n: Number.MAX_SAFE_INTEGER, nested: { list: [1, 2.5, null] } };
    const argumentsJson = JSON.stringify(args);
    const result = await agent.ExecuteTool({ name: "echo", arguments_json: argumentsJson });
    assert.equal(result.status, "EXECUTION_STATUS_OK", `${result.error} ${result.stderr}`);
    assert.equal(result.success, true);
    assert.equal(result.exit_code, 0);
    assert.equal(result.content, argumentsJson);
    assert.deepEqual(JSON.parse(result.data_json), args);
    assert.ok(result.execution_id, "every call has an audit record");
    assert.equal(typeof result.duration_ms, "string"); // int64 as a string
  });

  test("an unknown tool is a TOOL_NOT_FOUND result, not an error", async () => {
    const result = await agent.ExecuteTool({ name: "no_such_tool", arguments_json: "{}" });
    assert.equal(result.success, false);
    assert.equal(result.status, "EXECUTION_STATUS_TOOL_NOT_FOUND");
    assert.match(result.error, /no_such_tool/);
  });

  test("arguments failing the schema are an INVALID_ARGUMENTS result", async () => {
    const result = await agent.ExecuteTool({ name: "echo", arguments_json: JSON.stringify({ message: 7 }) });
    assert.equal(result.success, false);
    assert.equal(result.status, "EXECUTION_STATUS_INVALID_ARGUMENTS");
    assert.ok(result.error);
  });
});

describe("StreamExecuteTool", () => {
  test("stdout chunks arrive first, then exactly one result", async () => {
    const events = await agent.StreamExecuteTool({ name: TICKER, arguments_json: "{}" });
    assert.ok(events.length >= 2, `expected chunks and a result, got ${events.length} events`);
    const kinds = events.map((e) => e.event);
    assert.equal(kinds.filter((k) => k === "result").length, 1, kinds.join());
    assert.equal(kinds.at(-1), "result", kinds.join());
    const chunks = events.filter((e) => e.event === "stdout");
    assert.ok(chunks.length >= 2, `output must stream in several chunks: ${kinds.join()}`);
    for (const c of chunks) assert.ok(Buffer.isBuffer(c.stdout)); // bytes field
    const streamed = Buffer.concat(chunks.map((c) => c.stdout)).toString("utf8");
    const expected = Array.from({ length: LINES }, (_, i) => `line ${i + 1}\n`).join("");
    assert.equal(streamed, expected);
    const { result } = events.at(-1);
    assert.equal(result.status, "EXECUTION_STATUS_OK", result.error);
    assert.equal(result.content, expected);
  });

  test("an unknown tool streams a single TOOL_NOT_FOUND result", async () => {
    const events = await agent.StreamExecuteTool({ name: "no_such_tool" });
    assert.equal(events.length, 1);
    assert.equal(events[0].event, "result");
    assert.equal(events[0].result.status, "EXECUTION_STATUS_TOOL_NOT_FOUND");
  });
});

describe("approvals (dangerous write_file)", () => {
  const file = `interop/${uniqueName("note")}.txt`;
  const args = JSON.stringify({ path: file, content: "from node" });
  // RFC 8785 for this ASCII-only object: keys sorted, no whitespace.
  const canonical = JSON.stringify({ content: "from node", path: file });
  let request;

  before(async () => {
    const result = await agent.ExecuteTool({ name: "write_file", arguments_json: args });
    assert.equal(result.success, false);
    assert.equal(result.status, "EXECUTION_STATUS_APPROVAL_REQUIRED", result.error);
    request = result.approval_request;
  });

  test("the call is answered with an approval request", async () => {
    assert.ok(request?.id, "approval_request.id must be set");
    assert.equal(request.tool_name, "write_file");
    // the canonical bytes: what the approvers sign and the tool receives
    assert.equal(request.arguments_json, canonical);
    assert.equal(request.state, "PENDING");
    assert.equal(request.requested_by, "agent");
    assert.ok(request.approvals_required >= 1);
    assert.match(request.tool_digest, /^[0-9a-f]{64}$/);
    assert.equal(request.arguments_digest, sha256Hex(canonical));
    assert.ok(Number(request.expires_at.seconds) > Number(request.created_at.seconds));
  });

  test("GetApprovalRequest returns it to the approver and to the caller", async () => {
    const seen = await approver.GetApprovalRequest({ id: request.id });
    assert.equal(seen.id, request.id);
    assert.equal(seen.arguments_json, canonical);
    assert.equal(seen.tool.sandbox.image, "toolreg/python");
    assert.equal(seen.tool.owner, "[operator]");
    assert.equal(seen.state, "PENDING");
    const polled = await agent.GetApprovalRequest({ id: request.id });
    assert.equal(polled.id, request.id);
    const missing = await rpcError(approver.GetApprovalRequest({ id: "no-such-request" }));
    assert.equal(missing.code, grpc.status.NOT_FOUND, missing.details);
  });

  test("ListApprovalRequests lists it, also filtered by state", async () => {
    const all = await approver.ListApprovalRequests({});
    assert.ok(all.requests.some((r) => r.id === request.id));
    const pending = await approver.ListApprovalRequests({ state: "PENDING", limit: 100 });
    assert.ok(pending.requests.some((r) => r.id === request.id));
    assert.ok(pending.requests.every((r) => r.state === "PENDING"));
    const consumed = await approver.ListApprovalRequests({ state: "CONSUMED" });
    assert.ok(!consumed.requests.some((r) => r.id === request.id));
    const bad = await rpcError(approver.ListApprovalRequests({ state: "MAYBE" }));
    assert.equal(bad.code, grpc.status.INVALID_ARGUMENT, bad.details);
  });

  test("SubmitApproval rejects a token that does not verify", async () => {
    const err = await rpcError(approver.SubmitApproval({ request_id: request.id, token: "not.a.jwt" }));
    assert.equal(err.code, grpc.status.PERMISSION_DENIED, err.details);
    const empty = await rpcError(approver.SubmitApproval({ request_id: request.id, token: "" }));
    assert.equal(empty.code, grpc.status.INVALID_ARGUMENT, empty.details);
  });

  test("a token minted in Node approves the call, which then runs", async (t) => {
    const pem = process.env.TOOLREG_APPROVER_KEY_PEM;
    const issuer = process.env.TOOLREG_APPROVER_ID;
    if (!pem || !issuer) {
      t.skip("TOOLREG_APPROVER_KEY_PEM / TOOLREG_APPROVER_ID not set");
      return;
    }
    const token = mintApproval(pem, issuer, request);
    const updated = await approver.SubmitApproval({ request_id: request.id, token });
    assert.ok(updated.approved_by.includes(issuer), JSON.stringify(updated));
    assert.equal(updated.state, "APPROVED");
    const result = await agent.ExecuteTool({
      name: "write_file",
      arguments_json: args,
      approval_request_id: request.id,
    });
    assert.equal(result.status, "EXECUTION_STATUS_OK", result.error);
    const done = await approver.GetApprovalRequest({ id: request.id });
    assert.equal(done.state, "CONSUMED");
  });
});

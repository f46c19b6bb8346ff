// ExecuteTool and StreamExecuteTool over the bare .proto (grpc-js), and the
// approval path with the typed client (toolreg-client).
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import {
  clientError,
  closeAll,
  connect,
  connectClient,
  mintApproval,
  sha256Hex,
  tokens,
  uniqueName,
} from "./lib/client.mjs";

const TICKER = uniqueName("interop_ticker");
const LINES = 4;

let admin;
let agent;

before(async () => {
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
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
    assert.equal(kinds[0], "started", kinds.join()); // the execution id AttachExecution takes
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

describe("approvals (dangerous write_file), with the typed client", () => {
  const file = `interop/${uniqueName("note")}.txt`;
  const args = { path: file, content: "from node" };
  // RFC 8785 for this ASCII-only object: keys sorted, no whitespace.
  const canonical = JSON.stringify({ content: "from node", path: file });
  let agentClient;
  let approverClient;
  let request;

  before(async () => {
    agentClient = connectClient(tokens.agent);
    approverClient = connectClient(tokens.approver);
    const result = await agentClient.executeTool("write_file", args);
    assert.equal(result.success, false);
    assert.equal(result.status, "APPROVAL_REQUIRED", result.error);
    request = result.approvalRequest;
  });

  test("the call is answered with an approval request", async () => {
    assert.ok(request?.id, "approvalRequest.id must be set");
    assert.equal(request.toolName, "write_file");
    // the canonical bytes: what the approvers sign and the tool receives
    assert.equal(request.argumentsJson, canonical);
    assert.equal(request.state, "PENDING");
    assert.equal(request.requestedBy, "agent");
    assert.ok(request.approvalsRequired >= 1);
    assert.match(request.toolDigest, /^[0-9a-f]{64}$/);
    assert.equal(request.argumentsDigest, sha256Hex(canonical));
    assert.ok(request.expiresAt > request.createdAt);
  });

  test("GetApprovalRequest returns it to the approver and to the caller", async () => {
    const seen = await approverClient.getApprovalRequest(request.id);
    assert.equal(seen.id, request.id);
    assert.equal(seen.argumentsJson, canonical);
    assert.equal(seen.tool.sandbox.image, "toolreg/python");
    assert.equal(seen.tool.owner, "[operator]");
    assert.equal(seen.state, "PENDING");
    const polled = await agentClient.getApprovalRequest(request.id);
    assert.equal(polled.id, request.id);
    const missing = await clientError(approverClient.getApprovalRequest("no-such-request"));
    assert.equal(missing.code, "NOT_FOUND", missing.message);
  });

  test("ListApprovalRequests lists it, also filtered by state", async () => {
    const all = await approverClient.listApprovalRequests();
    assert.ok(all.some((r) => r.id === request.id));
    const pending = await approverClient.listApprovalRequests({ state: "PENDING", limit: 100 });
    assert.ok(pending.some((r) => r.id === request.id));
    assert.ok(pending.every((r) => r.state === "PENDING"));
    const consumed = await approverClient.listApprovalRequests({ state: "CONSUMED" });
    assert.ok(!consumed.some((r) => r.id === request.id));
    const bad = await clientError(approverClient.listApprovalRequests({ state: "MAYBE" }));
    assert.equal(bad.code, "INVALID_ARGUMENT", bad.message);
  });

  test("SubmitApproval rejects a token that does not verify", async () => {
    const err = await clientError(approverClient.submitApproval(request.id, "not.a.jwt"));
    assert.equal(err.code, "PERMISSION_DENIED", err.message);
    const empty = await clientError(approverClient.submitApproval(request.id, ""));
    assert.equal(empty.code, "INVALID_ARGUMENT", empty.message);
  });

  test("a token minted in Node approves the call, which then runs once", async () => {
    const pem = process.env.TOOLREG_APPROVER_KEY_PEM;
    const issuer = process.env.TOOLREG_APPROVER_ID;
    assert.ok(pem && issuer, "set TOOLREG_APPROVER_KEY_PEM and TOOLREG_APPROVER_ID (the pytest wrapper does)");
    const waiting = agentClient.waitForApproval(request.id, { timeoutMs: 30_000, pollMs: 100 });
    const token = mintApproval(pem, issuer, request);
    const updated = await approverClient.submitApproval(request.id, token);
    assert.ok(updated.approvedBy.includes(issuer), JSON.stringify(updated));
    assert.equal(updated.state, "APPROVED");
    assert.equal((await waiting).state, "APPROVED");
    const result = await agentClient.executeTool("write_file", args, { approvalRequestId: request.id });
    assert.equal(result.status, "OK", result.error);
    assert.deepEqual(result.data, { path: file, bytes: args.content.length });
    const done = await approverClient.getApprovalRequest(request.id);
    assert.equal(done.state, "CONSUMED");
  });
});

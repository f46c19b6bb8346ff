// The approval flow of a dangerous tool (the policy's write_file rule needs one
// approval from the security group): APPROVAL_REQUIRED -> an approver signs ->
// submitApproval -> waitForApproval -> the call runs once.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import { ApprovalWaitError, type ToolregClient } from "toolreg-client";

import { closeAll, connect, env, mintApproval, rpcError, sha256Hex, tokens, uniqueName } from "./helpers.js";

let agent: ToolregClient;
let approver: ToolregClient;

before(() => {
  agent = connect(tokens.agent);
  approver = connect(tokens.approver);
});
after(closeAll);

/** A fresh write_file call that needs approval, and its canonical arguments. */
async function askForApproval() {
  const file = `ts-client/${uniqueName("note")}.txt`;
  const args = { path: file, content: "from typescript" };
  const result = await agent.executeTool("write_file", args);
  assert.equal(result.status, "APPROVAL_REQUIRED", result.error);
  assert.equal(result.success, false);
  assert.equal(result.needsApproval, true);
  assert.ok(result.approvalRequest, "APPROVAL_REQUIRED carries the approval request");
  // RFC 8785 for this ASCII-only object: keys sorted, no whitespace.
  const canonical = JSON.stringify({ content: args.content, path: file });
  return { args, canonical, request: result.approvalRequest };
}

async function rejection(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  assert.fail("the promise resolved; a rejection was expected");
}

describe("approvals (dangerous write_file)", () => {
  test("APPROVAL_REQUIRED -> sign -> submitApproval -> waitForApproval -> SUCCESS, once", async () => {
    const { args, canonical, request } = await askForApproval();
    assert.equal(request.toolName, "write_file");
    assert.equal(request.state, "PENDING");
    assert.equal(request.requestedBy, "agent");
    assert.equal(request.argumentsJson, canonical);
    assert.equal(request.argumentsDigest, sha256Hex(canonical));
    assert.match(request.toolDigest, /^[0-9a-f]{64}$/);
    assert.equal(request.approvalsRequired, 1);
    assert.equal(request.approvalsMissing, 1);
    assert.ok(request.expiresAt > request.createdAt);
    assert.equal(request.tool?.name, "write_file");
    assert.equal(request.tool?.safetyLevel, "dangerous");

    // The agent waits while the approver reads the request in full and signs it.
    const waiting = agent.waitForApproval(request.id, { timeoutMs: 30_000, pollMs: 100 });
    const seen = await approver.getApprovalRequest(request.id);
    assert.equal(seen.argumentsJson, canonical);
    assert.equal(seen.tool?.owner, "[operator]");
    const token = mintApproval(env("TOOLREG_APPROVER_KEY_PEM"), env("TOOLREG_APPROVER_ID"), seen);
    const updated = await approver.submitApproval(request.id, token);
    assert.deepEqual(updated.approvedBy, [env("TOOLREG_APPROVER_ID")]);
    assert.equal(updated.state, "APPROVED");

    const approved = await waiting;
    assert.equal(approved.id, request.id);
    assert.equal(approved.state, "APPROVED");

    const result = await agent.executeTool("write_file", args, { approvalRequestId: request.id });
    assert.equal(result.status, "OK", result.error);
    assert.equal(result.success, true);
    assert.deepEqual(result.data, { path: args.path, bytes: args.content.length });

    // Spent: the request is consumed and waiting on it again fails at once.
    const err = await rejection(agent.waitForApproval(request.id, { timeoutMs: 5_000 }));
    assert.ok(err instanceof ApprovalWaitError, String(err));
    assert.equal(err.reason, "CONSUMED");
    assert.equal(err.request?.state, "CONSUMED");
    const again = await agent.executeTool("write_file", args, { approvalRequestId: request.id });
    assert.equal(again.status, "APPROVAL_DENIED");
    assert.match(again.error, /consumed/);
  });

  test("listApprovalRequests lists pending requests without their arguments", async () => {
    const { request } = await askForApproval();
    const pending = await approver.listApprovalRequests({ state: "PENDING", limit: 100 });
    const listed = pending.find((r) => r.id === request.id);
    assert.ok(listed, "the new request is listed as PENDING");
    assert.ok(pending.every((r) => r.state === "PENDING"));
    assert.equal(listed.argumentsJson, "");
    assert.equal(listed.tool, null, "listings leave the definition's schema out");
    assert.equal(listed.argumentsDigest, request.argumentsDigest);
    const consumed = await approver.listApprovalRequests({ state: "CONSUMED" });
    assert.ok(!consumed.some((r) => r.id === request.id));
  });

  test("waitForApproval times out with the last state seen", async () => {
    const { request } = await askForApproval();
    const started = performance.now();
    const err = await rejection(agent.waitForApproval(request.id, { timeoutMs: 400, pollMs: 100 }));
    assert.ok(err instanceof ApprovalWaitError, String(err));
    assert.equal(err.reason, "TIMEOUT");
    assert.equal(err.request?.state, "PENDING");
    assert.match(err.message, /still pending after 400 ms \(0 of 1 approvals\)/);
    assert.ok(performance.now() - started < 5_000);
  });

  test("waitForApproval stops when its signal aborts", async () => {
    const { request } = await askForApproval();
    const controller = new AbortController();
    setTimeout(() => controller.abort(new Error("the user gave up")), 200);
    const err = await rejection(
      agent.waitForApproval(request.id, { timeoutMs: 30_000, pollMs: 5_000, signal: controller.signal }),
    );
    assert.ok(err instanceof Error && err.message === "the user gave up", String(err));
  });

  test("submitApproval refuses a token that does not verify, and an unknown id", async () => {
    const { request } = await askForApproval();
    const bad = await rpcError(approver.submitApproval(request.id, "not.a.jwt"));
    assert.equal(bad.code, "PERMISSION_DENIED", bad.message);
    const empty = await rpcError(approver.submitApproval(request.id, ""));
    assert.equal(empty.code, "INVALID_ARGUMENT", empty.message);
    const missing = await rpcError(approver.getApprovalRequest("no-such-request"));
    assert.equal(missing.code, "NOT_FOUND");
    const unknown = await rpcError(agent.waitForApproval("no-such-request", { timeoutMs: 1_000 }));
    assert.equal(unknown.code, "NOT_FOUND", "a failed poll throws RpcError");
  });
});

// The approval flow of a dangerous tool (the policy's write_file rule needs one
// approval from the security group): APPROVAL_REQUIRED -> an approver signs ->
// submitApproval -> waitForApproval -> the call runs once; or an approver
// rejects it, and the agent is told why.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import { ApprovalWaitError, type ToolregClient } from "toolreg-client";

import {
  askForApproval as ask,
  closeAll,
  connect,
  env,
  mintApproval,
  rejection,
  rpcError,
  sha256Hex,
  tokens,
} from "./helpers.js";

// The old poll interval (DEFAULT_POLL_MS): waitForApproval follows the watch
// stream, so it answers well within this of the approval.
const OLD_POLL_MS = 1_000;

let agent: ToolregClient;
let approver: ToolregClient;

before(() => {
  agent = connect(tokens.agent);
  approver = connect(tokens.approver);
});
after(closeAll);

const askForApproval = () => ask(agent);

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

    // The agent waits while the approver reads the request in full and signs
    // it. pollMs is far beyond the test: the wait follows the watch stream.
    let answeredAt = 0;
    const waiting = agent.waitForApproval(request.id, { timeoutMs: 30_000, pollMs: 60_000 }).then((r) => {
      answeredAt = performance.now();
      return r;
    });
    const seen = await approver.getApprovalRequest(request.id);
    assert.equal(seen.argumentsJson, canonical);
    assert.equal(seen.tool?.owner, "[operator]");
    assert.equal(seen.rejectedBy, "");
    assert.equal(seen.rejectionReason, "");
    // Which rules apply and why: the policy's one (unnamed) rule for write_file.
    assert.deepEqual(seen.appliedRules, [
      { name: "rule 1", match: "tool write_file", condition: "", approvalsRequired: 1, groups: ["security"] },
    ]);
    const token = mintApproval(env("TOOLREG_APPROVER_KEY_PEM"), env("TOOLREG_APPROVER_ID"), seen);
    await new Promise((resolve) => setTimeout(resolve, 300)); // the wait is watching by now
    const updated = await approver.submitApproval(request.id, token);
    const approvedAt = performance.now();
    assert.deepEqual(updated.approvedBy, [env("TOOLREG_APPROVER_ID")]);
    assert.equal(updated.state, "APPROVED");

    const approved = await waiting;
    assert.equal(approved.id, request.id);
    assert.equal(approved.state, "APPROVED");
    assert.equal(approved.argumentsJson, canonical, "the approved request comes whole");
    const lag = answeredAt - approvedAt;
    assert.ok(lag < OLD_POLL_MS / 2, `waitForApproval answered ${lag.toFixed(0)} ms after the approval`);

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

  test("a rejection ends waitForApproval with the approver's reason, and the call stays refused", async () => {
    const { args, request } = await askForApproval();
    const reason = "not on a Friday: file a change ticket first";
    let answeredAt = 0;
    const waiting = rejection(
      agent.waitForApproval(request.id, { timeoutMs: 30_000, pollMs: 60_000 }).finally(() => {
        answeredAt = performance.now();
      }),
    );
    await new Promise((resolve) => setTimeout(resolve, 300)); // the wait is watching by now

    // Only an eligible approver may reject, with a reason.
    const byAgent = await rpcError(agent.rejectApprovalRequest(request.id, "I changed my mind"));
    assert.equal(byAgent.code, "PERMISSION_DENIED", byAgent.message);
    const noReason = await rpcError(approver.rejectApprovalRequest(request.id, ""));
    assert.equal(noReason.code, "INVALID_ARGUMENT", noReason.message);

    const rejected = await approver.rejectApprovalRequest(request.id, reason);
    const rejectedAt = performance.now();
    assert.equal(rejected.state, "REJECTED");
    assert.equal(rejected.rejectedBy, env("TOOLREG_APPROVER_ID"));
    assert.equal(rejected.rejectionReason, reason);

    const err = await waiting;
    assert.ok(err instanceof ApprovalWaitError, String(err));
    assert.equal(err.reason, "REJECTED");
    assert.equal(err.message, `approval request ${request.id} was rejected by alice: ${reason}`);
    assert.equal(err.request?.state, "REJECTED");
    assert.equal(err.request?.rejectionReason, reason);
    const lag = answeredAt - rejectedAt;
    assert.ok(lag < OLD_POLL_MS / 2, `waitForApproval answered ${lag.toFixed(0)} ms after the rejection`);

    // Final: waiting again fails at once, rejecting again is refused, and the
    // call (with the request or without) is denied with the reason.
    const again = await rejection(agent.waitForApproval(request.id, { timeoutMs: 5_000 }));
    assert.ok(again instanceof ApprovalWaitError && again.reason === "REJECTED", String(again));
    const twice = await rpcError(approver.rejectApprovalRequest(request.id, reason));
    assert.equal(twice.code, "FAILED_PRECONDITION", twice.message);
    for (const options of [{ approvalRequestId: request.id }, {}]) {
      const result = await agent.executeTool("write_file", args, options);
      assert.equal(result.status, "APPROVAL_DENIED", result.error);
      assert.ok(result.error.includes(reason), result.error);
    }
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
    assert.equal(unknown.code, "NOT_FOUND", "a watch the server refuses throws RpcError");
  });
});

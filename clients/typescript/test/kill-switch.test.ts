// The kill switch against the real server: setToolEnabled (admins) and
// deleteTool (the owner or an admin). A disabled tool stays listed with its
// reason, is offered to no model and every call gets TOOL_DISABLED; its open
// approval requests are VOIDED (a watch sees it, a wait ends with the
// reason); enabled again it runs; deleted, it is gone.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import { ApprovalWaitError, type ApprovalEvent, type ToolInput, type ToolregClient } from "toolreg-client";

import { closeAll, connect, rpcError, tokens, uniqueName } from "./helpers.js";

const WAIT_MS = 20_000; // every wait and watch here has a deadline: a missing event fails, never hangs

function toolInput(name: string, safetyLevel: "safe" | "dangerous" = "safe"): ToolInput {
  return {
    name,
    description: "Echoes its arguments (the kill-switch tests).",
    parameters: { type: "object" },
    safetyLevel,
    sandbox: { image: "toolreg/base", command: ["cat"], limits: { timeoutMs: 10_000 } },
  };
}

let ops: ToolregClient; // the operator: admin role
let admin: ToolregClient; // registers tools, but is no admin (its name is older than the role)
let agent: ToolregClient;
let approver: ToolregClient;

before(() => {
  ops = connect(tokens.ops);
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  approver = connect(tokens.approver);
});
after(closeAll);

/** Reads `events` until one of `type` about request `id` comes (others' events interleave). */
async function until(events: AsyncIterator<ApprovalEvent>, type: string, id: string): Promise<ApprovalEvent> {
  for (;;) {
    const next = await events.next();
    assert.ok(!next.done, `the watch ended before ${type}`);
    if (next.value.type === type && next.value.request?.id === id) return next.value;
  }
}

describe("setToolEnabled", () => {
  test("a disabled tool is listed with its reason, offered to no model, refused, and enabled again", async () => {
    const name = uniqueName("ts_kill");
    await admin.registerTool(toolInput(name));

    const off = await ops.setToolEnabled(name, false, { reason: "leaks data" });

    assert.equal(off.disabled, true);
    assert.equal(off.disabledReason, "leaks data");
    const listed = (await agent.listTools()).find((t) => t.name === name);
    assert.ok(listed, "a disabled tool stays listed");
    assert.equal(listed.disabled, true);
    assert.equal(listed.disabledReason, "leaks data");
    assert.equal((await agent.getTool(name)).disabled, true);
    const offered = (await agent.toolSchemas()).map((s) => (s.function as { name: string }).name);
    assert.ok(!offered.includes(name), "toolSchemas leaves a disabled tool out");
    const refused = await agent.executeTool(name, { n: 1 });
    assert.equal(refused.status, "TOOL_DISABLED");
    assert.equal(refused.success, false);
    assert.equal(refused.error, `Tool '${name}' is disabled: leaks data`);

    const on = await ops.setToolEnabled(name, true);

    assert.equal(on.disabled, false);
    assert.equal(on.disabledReason, "");
    const ran = await agent.executeTool(name, { n: 1 });
    assert.equal(ran.status, "OK", ran.error);
    assert.deepEqual(ran.data, { n: 1 });
    assert.ok((await agent.toolSchemas()).some((s) => (s.function as { name: string }).name === name));
  });

  test("only an admin may, a disabling says why, and an unknown tool is NOT_FOUND", async () => {
    const name = uniqueName("ts_kill_rules");
    await admin.registerTool(toolInput(name));
    for (const who of [admin, agent]) {
      const err = await rpcError(who.setToolEnabled(name, false, { reason: "mine to stop" }));
      assert.equal(err.code, "PERMISSION_DENIED", err.message);
    }
    const noReason = await rpcError(ops.setToolEnabled(name, false));
    assert.equal(noReason.code, "INVALID_ARGUMENT", noReason.message);
    assert.match(noReason.grpcMessage, /reason: must not be empty/);
    const unknown = await rpcError(ops.setToolEnabled(uniqueName("ts_nope"), true));
    assert.equal(unknown.code, "NOT_FOUND", unknown.message);
    assert.equal((await agent.getTool(name)).disabled, false);
  });

  test("its open approval requests are voided: a watch sees it, a wait ends with the reason", async () => {
    const name = uniqueName("ts_kill_danger");
    await ops.registerTool(toolInput(name, "dangerous"));
    const asked = await agent.executeTool(name, { n: 2 });
    assert.equal(asked.status, "APPROVAL_REQUIRED", asked.error);
    assert.ok(asked.approvalRequest);
    const request = asked.approvalRequest;
    const watch = approver.watchApprovalRequests({ timeoutMs: WAIT_MS });
    const waiting = agent.waitForApproval(request.id, { timeoutMs: WAIT_MS });
    waiting.catch(() => undefined); // awaited below; never an unhandled rejection meanwhile
    await until(watch, "CURRENT", request.id);

    await ops.setToolEnabled(name, false, { reason: "under review" });

    const why = `tool '${name}' was disabled: under review`;
    const voided = await until(watch, "VOIDED", request.id);
    assert.equal(voided.reason, why);
    assert.equal(voided.request?.state, "VOIDED");
    assert.equal(voided.request?.voidedReason, why);
    await watch.return(undefined);
    const err = await waiting.then(
      () => assert.fail("the wait resolved; the request was voided"),
      (e: unknown) => e,
    );
    assert.ok(err instanceof ApprovalWaitError, String(err));
    assert.equal(err.reason, "VOIDED");
    assert.equal(err.request?.voidedReason, why);
    assert.match(err.message, /is voided: tool .* was disabled: under review/);

    await ops.setToolEnabled(name, true);
    const denied = await agent.executeTool(name, { n: 2 }, { approvalRequestId: request.id });
    assert.equal(denied.status, "APPROVAL_DENIED");
    assert.equal(denied.error, `approval denied: approval request ${request.id} was voided: ${why}`);
    assert.equal((await agent.getApprovalRequest(request.id)).state, "VOIDED");
    await ops.deleteTool(name, { reason: "test over" });
  });
});

describe("deleteTool", () => {
  test("the owner deletes its tool; the name is then unknown; a bad reason or another client is refused", async () => {
    const name = uniqueName("ts_kill_delete");
    await admin.registerTool(toolInput(name));
    const notOwner = await rpcError(agent.deleteTool(name));
    assert.equal(notOwner.code, "PERMISSION_DENIED", notOwner.message);
    const badReason = await rpcError(admin.deleteTool(name, { reason: "two\nlines" }));
    assert.equal(badReason.code, "INVALID_ARGUMENT", badReason.message);

    assert.equal(await admin.deleteTool(name, { reason: "retired" }), undefined);

    assert.equal((await rpcError(agent.getTool(name))).code, "NOT_FOUND");
    assert.ok(!(await agent.listTools()).some((t) => t.name === name));
    assert.equal((await agent.executeTool(name, {})).status, "TOOL_NOT_FOUND");
    assert.equal((await rpcError(admin.deleteTool(name))).code, "NOT_FOUND");
    // The name is free: registered again, it is a new, enabled tool.
    const again = await admin.registerTool(toolInput(name));
    assert.equal(again.disabled, false);
    await ops.deleteTool(name); // an admin deletes anyone's tool
  });
});

// watchApprovalRequests against the real server: what is open first (CURRENT),
// SYNCED, then each change as it is stored; who may watch what; and leaving
// the loop early cancels the stream, so the server's watch count goes back.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import type { ApprovalEvent, ApprovalEventType, ToolregClient } from "toolreg-client";

import { approve, askForApproval, closeAll, connect, env, rpcError, tokens } from "./helpers.js";

const WATCH_MS = 20_000; // every watch here has a deadline: a missing event fails, never hangs
const PER_CLIENT_WATCHES = 8; // the server's cap of open watches per client (approvals/watch.py)

let agent: ToolregClient;
let otherAgent: ToolregClient; // used by this file alone: its open watches are this file's
let approver: ToolregClient;

before(() => {
  agent = connect(tokens.agent);
  otherAgent = connect(tokens.otherAgent);
  approver = connect(tokens.approver);
});
after(closeAll);

/** Reads `events` until SYNCED; returns what came before it (the CURRENT events). */
async function untilSynced(events: AsyncIterator<ApprovalEvent>): Promise<ApprovalEvent[]> {
  const current: ApprovalEvent[] = [];
  for (;;) {
    const next = await events.next();
    assert.ok(!next.done, "the watch ended before SYNCED");
    if (next.value.type === "SYNCED") {
      assert.equal(next.value.request, null, "SYNCED carries no request");
      return current;
    }
    assert.equal(next.value.type, "CURRENT", "only CURRENT events come before SYNCED");
    current.push(next.value);
  }
}

/** The next `count` events about request `id` (other tests' requests interleave). */
async function eventsOf(events: AsyncIterator<ApprovalEvent>, id: string, count: number): Promise<ApprovalEvent[]> {
  const seen: ApprovalEvent[] = [];
  while (seen.length < count) {
    const next = await events.next();
    assert.ok(!next.done, `the watch ended after ${seen.map((e) => e.type).join(", ")}`);
    if (next.value.request?.id === id) seen.push(next.value);
  }
  return seen;
}

const types = (events: ApprovalEvent[]): ApprovalEventType[] => events.map((e) => e.type);

describe("watchApprovalRequests", () => {
  test("CURRENT, then SYNCED, then OPENED, APPROVAL_ADDED, APPROVED as an approver approves", async () => {
    const { request: open } = await askForApproval(agent);
    const all = approver.watchApprovalRequests({ timeoutMs: WATCH_MS });
    try {
      const current = await untilSynced(all);
      const listed = current.find((e) => e.request?.id === open.id);
      assert.ok(listed, "a pending request the approver may approve is CURRENT");
      assert.equal(listed.request?.state, "PENDING");
      assert.equal(listed.request?.argumentsJson, "", "events carry the listed form");
      assert.equal(listed.seq, 0);
      assert.equal(listed.at, null);

      const { request } = await askForApproval(agent);
      const [opened] = await eventsOf(all, request.id, 1);
      assert.equal(opened?.type, "OPENED");
      assert.equal(opened?.request?.requestedBy, "agent");

      // The agent watches its own request meanwhile: its state now, SYNCED, then changes.
      const mine = agent.watchApprovalRequests({ requestId: request.id, timeoutMs: WATCH_MS });
      try {
        const [now, ...rest] = await untilSynced(mine);
        assert.equal(now?.request?.id, request.id);
        assert.equal(now?.request?.state, "PENDING");
        assert.equal(rest.length, 0);

        await approve(approver, request);
        const changes = await eventsOf(all, request.id, 2);
        assert.deepEqual(types(changes), ["APPROVAL_ADDED", "APPROVED"]);
        const [added, approved] = changes as [ApprovalEvent, ApprovalEvent];
        assert.equal(added.actor, env("TOOLREG_APPROVER_ID"));
        assert.equal(approved.request?.state, "APPROVED");
        assert.deepEqual(approved.request?.approvedBy, [env("TOOLREG_APPROVER_ID")]);
        assert.ok(opened && opened.seq > 0 && opened.seq < added.seq && added.seq < approved.seq, "in store order");
        assert.ok(added.at instanceof Date && added.at.getTime() > 0);
        assert.deepEqual(types(await eventsOf(mine, request.id, 2)), ["APPROVAL_ADDED", "APPROVED"]);
      } finally {
        await mine.return(undefined);
      }
    } finally {
      await all.return(undefined);
    }
  });

  test("an agent sees only its own requests: another agent's is NOT_FOUND", async () => {
    const { request } = await askForApproval(agent);
    const theirs = otherAgent.watchApprovalRequests({ requestId: request.id, timeoutMs: WATCH_MS });
    const err = await rpcError(theirs.next());
    assert.equal(err.code, "NOT_FOUND", err.message);
    const everything = otherAgent.watchApprovalRequests({ timeoutMs: WATCH_MS });
    try {
      assert.deepEqual(await untilSynced(everything), [], "the other agent has no requests of its own");
    } finally {
      await everything.return(undefined);
    }
    const unknown = await rpcError(agent.watchApprovalRequests({ requestId: "no-such-request" }).next());
    assert.equal(unknown.code, "NOT_FOUND", unknown.message);
  });

  test("leaving the loop early cancels the stream: the per-client cap is never exhausted", async () => {
    // Opened and abandoned one after another: more than the cap, so each must close.
    for (let i = 0; i < PER_CLIENT_WATCHES + 2; i++) {
      let synced = false;
      for await (const event of otherAgent.watchApprovalRequests({ timeoutMs: WATCH_MS })) {
        if (event.type === "SYNCED") {
          synced = true;
          break;
        }
      }
      assert.ok(synced, `watch ${i + 1} ended before SYNCED`);
    }
    // The cap is real: holding every watch allowed, one more is RESOURCE_EXHAUSTED.
    const held = Array.from({ length: PER_CLIENT_WATCHES }, () =>
      otherAgent.watchApprovalRequests({ timeoutMs: WATCH_MS }),
    );
    try {
      for (const watch of held) await untilSynced(watch);
      const over = await rpcError(otherAgent.watchApprovalRequests({ timeoutMs: WATCH_MS }).next());
      assert.equal(over.code, "RESOURCE_EXHAUSTED", over.message);
    } finally {
      await Promise.all(held.map((watch) => watch.return(undefined)));
    }
    // Abandoned together, they close as the server sees each cancel: a new watch
    // opens again soon (the cancels travel to the server while we retry).
    const until = performance.now() + 5_000;
    for (;;) {
      const watch = otherAgent.watchApprovalRequests({ timeoutMs: WATCH_MS });
      try {
        await untilSynced(watch);
        break;
      } catch (err) {
        const exhausted = err instanceof Error && "code" in err && err.code === "RESOURCE_EXHAUSTED";
        if (!exhausted || performance.now() > until) throw err;
        await new Promise((resolve) => setTimeout(resolve, 50));
      } finally {
        await watch.return(undefined);
      }
    }
  });
});

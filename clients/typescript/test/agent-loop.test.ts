// examples/agent-loop.ts against the real server, with a scripted model
// standing in for an LLM (its turns are fixed tool calls).
import { strict as assert } from "node:assert";
import { after, describe, test } from "node:test";

import type { ApprovalRequestView } from "toolreg-client";

import { runAgent, type Message, type Model, type ToolCall } from "../examples/agent-loop.js";
import { closeAll, connect, env, mintApproval, tokens, uniqueName } from "./helpers.js";

after(closeAll);

const call = (id: string, name: string, args: unknown): ToolCall => ({
  id,
  type: "function",
  function: { name, arguments: typeof args === "string" ? args : JSON.stringify(args) },
});

/** A model that plays `turns` in order and then says "done"; it checks the tools it is given. */
function scripted(turns: ToolCall[][]): { model: Model; seen: Message[][] } {
  const seen: Message[][] = [];
  const model: Model = async (messages, tools) => {
    const names = tools.map((t) => (t.function as { name: string }).name);
    assert.ok(names.includes("echo") && names.includes("write_file"), names.join());
    seen.push([...messages]);
    const next = turns[seen.length - 1];
    return next ? { role: "assistant", content: null, tool_calls: next } : { role: "assistant", content: "done" };
  };
  return { model, seen };
}

const toolReplies = (messages: Message[]) =>
  Object.fromEntries(messages.flatMap((m) => (m.role === "tool" ? [[m.tool_call_id, m.content]] : [])));

describe("the example agent loop", () => {
  test("runs each call, hands failures back as text, and waits for an approver", async () => {
    const agent = connect(tokens.agent);
    const approver = connect(tokens.approver);
    const path = `agent-loop/${uniqueName("notes")}.txt`;
    const { model, seen } = scripted([
      [
        call("c_echo", "echo", { message: "hello from the loop" }),
        call("c_bad", "word_count", { text: 42 }),
        call("c_unknown", "send_email", { to: "someone@example.com" }),
      ],
      [call("c_write", "write_file", { path, content: "written by the agent loop" })],
    ]);
    const asked: ApprovalRequestView[] = [];
    const approved: Promise<unknown>[] = [];
    const messages: Message[] = [{ role: "user", content: "Say hello, count, and write a note." }];
    const final = await runAgent(agent, model, messages, {
      approvalTimeoutMs: 30_000,
      onApprovalNeeded: (request) => {
        asked.push(request);
        // DEMO: the approver signs on its own connection while the loop waits.
        const token = mintApproval(env("TOOLREG_APPROVER_KEY_PEM"), env("TOOLREG_APPROVER_ID"), request);
        approved.push(approver.submitApproval(request.id, token));
      },
    });
    await Promise.all(approved);
    assert.deepEqual(final, { role: "assistant", content: "done" });
    assert.equal(seen.length, 3, "two turns of tool calls, then the answer");
    const replies = toolReplies(messages);
    assert.deepEqual(JSON.parse(replies.c_echo ?? ""), { message: "hello from the loop" });
    assert.match(replies.c_bad ?? "", /^Error \(INVALID_ARGUMENTS\): /);
    assert.match(replies.c_unknown ?? "", /^Error \(TOOL_NOT_FOUND\): .*send_email/);
    assert.equal(asked.length, 1);
    assert.equal(asked[0]?.toolName, "write_file");
    assert.deepEqual(JSON.parse(replies.c_write ?? ""), { path, bytes: "written by the agent loop".length });
  });

  test("an approval that does not come is handed back to the model", async () => {
    const agent = connect(tokens.agent);
    const { model } = scripted([[call("c_write", "write_file", { path: "agent-loop/never.txt", content: "x" })]]);
    const messages: Message[] = [{ role: "user", content: "Write a note." }];
    await runAgent(agent, model, messages, { approvalTimeoutMs: 300 });
    assert.match(toolReplies(messages).c_write ?? "", /^Error \(APPROVAL_REQUIRED\): approval request \S+ still pending/);
  });
});

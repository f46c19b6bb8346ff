// An agent loop over toolreg, for any model that speaks OpenAI-style tool
// calls: list the schemas, hand them to the model, run each tool call it
// makes, and hand every outcome back, waiting for approvers when a dangerous
// tool needs them. test/agent-loop.test.ts runs it against a real server with
// a scripted model.
import { ApprovalWaitError, ToolregClient, type ApprovalRequestView, type JsonValue } from "toolreg-client";

/** One tool call of an assistant turn (OpenAI chat completions format). */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

export type Message =
  | { role: "system" | "user"; content: string }
  | { role: "assistant"; content: string | null; tool_calls?: ToolCall[] }
  | { role: "tool"; tool_call_id: string; content: string };

/** Your model: the conversation and the tools in, the next assistant turn out. */
export type Model = (messages: Message[], tools: Array<{ [key: string]: JsonValue }>) => Promise<Message>;

export interface AgentOptions {
  /** How long to wait for approvers before handing the refusal to the model (ms). */
  approvalTimeoutMs?: number;
  /** Tell the humans: `toolreg approvals approve <id> --key KEY`. */
  onApprovalNeeded?: (request: ApprovalRequestView) => void;
  /** Characters of an error handed back to the model. */
  maxErrorChars?: number;
}

/** Runs the conversation until the model answers without tool calls; returns that answer. */
export async function runAgent(
  client: ToolregClient,
  model: Model,
  messages: Message[],
  { approvalTimeoutMs = 300_000, onApprovalNeeded, maxErrorChars = 500 }: AgentOptions = {},
): Promise<Message> {
  const tools = await client.toolSchemas({ format: "openai" });
  for (;;) {
    const reply = await model(messages, tools);
    messages.push(reply);
    if (reply.role !== "assistant" || !reply.tool_calls?.length) return reply;
    for (const call of reply.tool_calls) {
      const { name, arguments: args } = call.function; // the model's JSON text, sent as-is
      let result = await client.executeTool(name, args);
      let error = result.success ? undefined : `Error (${result.status}): ${result.error}`;
      if (result.status === "APPROVAL_REQUIRED" && result.approvalRequest) {
        const request = result.approvalRequest;
        onApprovalNeeded?.(request);
        try {
          await client.waitForApproval(request.id, { timeoutMs: approvalTimeoutMs });
          result = await client.executeTool(name, args, { approvalRequestId: request.id });
          error = result.success ? undefined : `Error (${result.status}): ${result.error}`;
        } catch (err) {
          if (!(err instanceof ApprovalWaitError)) throw err;
          error = `Error (APPROVAL_REQUIRED): ${err.message}`; // not approved: the model hears why
        }
      }
      const content = error === undefined ? result.content : error.slice(0, maxErrorChars);
      messages.push({ role: "tool", tool_call_id: call.id, content });
    }
  }
}

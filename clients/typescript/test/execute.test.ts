// executeTool and streamTool: every outcome of a call is a CallResult.
import { strict as assert } from "node:assert";
import { createServer, connect as connectTcp, type AddressInfo, type Socket } from "node:net";
import { execFileSync } from "node:child_process";
import { setTimeout as sleep } from "node:timers/promises";
import { after, before, describe, test } from "node:test";

import type { CallResult, StreamEvent, ToolregClient } from "toolreg-client";

import { closeAll, connect, env, rpcError, tokens, uniqueName } from "./helpers.js";

const TICKER = uniqueName("ts_ticker");
const FAILING = uniqueName("ts_failing");
const SLEEPER = uniqueName("ts_sleeper");
const LINGERER = uniqueName("ts_lingerer");
const MARKER = uniqueName("ts_marker"); // the lingerer's $0: finds its container in `docker ps`
const TALKER = uniqueName("ts_talker");
const LINES = 4;
const EMPTY = JSON.stringify({ type: "object", properties: {} });

let agent: ToolregClient;

before(async () => {
  const admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  const base = { parameters: EMPTY, categories: ["ts-client"] };
  await admin.registerTool({
    ...base,
    name: TICKER,
    description: "Prints a few numbered lines, one at a time, and a warning.",
    sandbox: {
      image: "toolreg/base",
      command: ["sh", "-c", `for i in $(seq 1 ${LINES}); do echo "line $i"; sleep 0.2; done; echo warned >&2`],
    },
  });
  await admin.registerTool({
    ...base,
    name: TALKER,
    description: "Prints, sleeps, prints.",
    sandbox: { image: "toolreg/base", command: ["sh", "-c", "echo one; sleep 1.5; echo two >&2; sleep 1; echo three"] },
  });
  await admin.registerTool({
    ...base,
    name: FAILING,
    description: "Always fails with exit code 3.",
    sandbox: { image: "toolreg/base", command: ["sh", "-c", "echo partial; echo 'boom: disk on fire' >&2; exit 3"] },
  });
  await admin.registerTool({
    ...base,
    name: SLEEPER,
    description: "Sleeps for a while.",
    sandbox: { image: "toolreg/base", command: ["sleep", "8"] },
  });
  await admin.registerTool({
    ...base,
    name: LINGERER,
    description: "Says it started, then sleeps.",
    sandbox: { image: "toolreg/base", command: ["sh", "-c", "echo started; sleep 9", MARKER] },
  });
});

/** Whether a container running the lingerer is up (the real engine, by its command line). */
function lingererRunning(): boolean {
  const commands = execFileSync("docker", ["ps", "--no-trunc", "--format", "{{.Command}}"], { encoding: "utf8" });
  return commands.includes(MARKER);
}
after(closeAll);

describe("executeTool", () => {
  test("echo succeeds; data is the parsed data_json", async () => {
    const args = { message: "héllo from typescript", n: Number.MAX_SAFE_INTEGER, nested: { list: [1, 2.5, null] } };
    const result = await agent.executeTool("echo", args);
    assert.equal(result.status, "OK", `${result.error} ${result.stderr}`);
    assert.equal(result.success, true);
    assert.equal(result.needsApproval, false);
    assert.equal(result.exitCode, 0);
    assert.equal(result.content, JSON.stringify(args));
    assert.deepEqual(result.data, args);
    assert.match(result.executionId, /\S/, "every call has an audit record");
    assert.equal(typeof result.durationMs, "number");
    assert.equal(result.approvalRequest, null);
  });

  test("arguments given as JSON text are sent as-is", async () => {
    const result = await agent.executeTool("echo", '{"message": "as text", "b": 1.0}');
    assert.equal(result.status, "OK", result.error);
    assert.deepEqual(result.data, { message: "as text", b: 1 });
  });

  test("a failing tool is a TOOL_ERROR result with its stderr, not an exception", async () => {
    const result = await agent.executeTool(FAILING);
    assert.equal(result.status, "TOOL_ERROR");
    assert.equal(result.success, false);
    assert.equal(result.exitCode, 3);
    assert.match(result.error, /boom: disk on fire/);
    assert.match(result.stderr, /boom: disk on fire/);
    assert.equal(result.content, "partial\n");
    assert.equal(result.data, undefined, "stdout that is not JSON has no data");
  });

  test("arguments failing the schema are an INVALID_ARGUMENTS result", async () => {
    const result = await agent.executeTool("echo", { message: 7 });
    assert.equal(result.status, "INVALID_ARGUMENTS");
    assert.equal(result.success, false);
    assert.match(result.error, /message/);
    const broken = await agent.executeTool("echo", "{");
    assert.equal(broken.status, "INVALID_ARGUMENTS");
  });

  test("an unknown tool is a TOOL_NOT_FOUND result", async () => {
    const result = await agent.executeTool("no_such_tool");
    assert.equal(result.status, "TOOL_NOT_FOUND");
    assert.match(result.error, /no_such_tool/);
  });

  test("timeoutMs is the RPC's deadline: DEADLINE_EXCEEDED", async () => {
    const started = performance.now();
    const err = await rpcError(agent.executeTool(SLEEPER, {}, { timeoutMs: 1_000 }));
    assert.equal(err.code, "DEADLINE_EXCEEDED", err.message);
    assert.ok(performance.now() - started < 10_000);
  });
});

describe("streamTool", () => {
  test("stdout and stderr chunks arrive first, then exactly one result", async () => {
    const events: StreamEvent[] = [];
    for await (const event of agent.streamTool(TICKER)) events.push(event);
    const kinds = events.map((e) => e.kind);
    assert.equal(kinds.filter((k) => k === "result").length, 1, kinds.join());
    assert.equal(kinds.at(-1), "result", kinds.join());
    const chunks = events.flatMap((e) => (e.kind === "stdout" ? [e.stdout] : []));
    assert.ok(chunks.length >= 2, `stdout must stream in several chunks: ${kinds.join()}`);
    const expected = Array.from({ length: LINES }, (_, i) => `line ${i + 1}\n`).join("");
    assert.equal(Buffer.concat(chunks).toString("utf8"), expected);
    const stderr = events.flatMap((e) => (e.kind === "stderr" ? [e.stderr] : []));
    assert.equal(Buffer.concat(stderr).toString("utf8"), "warned\n");
    const last = events.at(-1);
    assert.ok(last?.kind === "result");
    assert.equal(last.result.status, "OK", last.result.error);
    assert.equal(last.result.content, expected);
    assert.equal(last.result.data, undefined);
  });

  test("an unknown tool streams a single TOOL_NOT_FOUND result", async () => {
    const events: StreamEvent[] = [];
    for await (const event of agent.streamTool("no_such_tool")) events.push(event);
    assert.equal(events.length, 1);
    const [only] = events;
    assert.ok(only?.kind === "result");
    assert.equal(only.result.status, "TOOL_NOT_FOUND");
  });

  test("leaving the loop early with reattach off cancels the call: the server stops the container", async () => {
    let first: StreamEvent | undefined;
    for await (const event of agent.streamTool(LINGERER, {}, { reattach: false })) {
      first = event;
      assert.ok(lingererRunning(), "the tool's container runs while its output streams");
      break;
    }
    assert.ok(first?.kind === "stdout" && Buffer.from(first.stdout).toString() === "started\n");
    const started = performance.now();
    while (lingererRunning()) {
      assert.ok(performance.now() - started < 5_000, "the container outlived the cancelled call");
      await sleep(100);
    }
  });

  test("a refused request throws RpcError from the loop", async () => {
    const stranger = connect("not-a-known-token");
    const err = await rpcError(
      (async () => {
        for await (const _ of stranger.streamTool("echo", { message: "hi" })) {
          assert.fail("no event may arrive");
        }
      })(),
    );
    assert.equal(err.code, "UNAUTHENTICATED");
  });
});

/** A loopback TCP proxy to the server whose open connections a test can cut at once. */
async function cuttingProxy(): Promise<{ address: string; cut: () => void; close: () => void; connections: () => number }> {
  const [host, port] = env("TOOLREG_ADDRESS").split(":");
  const open = new Set<Socket>();
  let connections = 0;
  const server = createServer((client) => {
    connections += 1;
    const upstream = connectTcp(Number(port), host);
    for (const s of [client, upstream]) {
      open.add(s);
      s.on("error", () => s.destroy());
      s.on("close", () => open.delete(s));
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const cut = () => {
    for (const s of open) s.destroy();
  };
  return {
    address: `127.0.0.1:${(server.address() as AddressInfo).port}`,
    cut,
    close: () => {
      cut();
      server.close();
    },
    connections: () => connections,
  };
}

describe("re-attaching", () => {
  test("a stream cut mid-call is re-attached: every byte once, then the result", async () => {
    const proxy = await cuttingProxy();
    try {
      const client = connect(tokens.agent, { address: proxy.address });
      let stdout = "";
      let stderr = "";
      let result: CallResult | undefined;
      for await (const event of client.streamTool(TALKER, {}, { timeoutMs: 60_000 })) {
        if (event.kind === "stdout") {
          stdout += Buffer.from(event.stdout).toString();
          if (stdout === "one\n") proxy.cut(); // while the tool sleeps
        } else if (event.kind === "stderr") {
          stderr += Buffer.from(event.stderr).toString();
        } else {
          result = event.result;
        }
      }
      assert.equal(stdout, "one\nthree\n");
      assert.equal(stderr, "two\n");
      assert.ok(result?.success, result?.error);
      assert.equal(result?.content, "one\nthree\n");
      assert.ok(proxy.connections() >= 2, "the stream was cut and came back");
    } finally {
      proxy.close();
    }
  });
});

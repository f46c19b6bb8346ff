// registerTool, getTool, listTools and toolSchemas; request errors as RpcError.
import { strict as assert } from "node:assert";
import { inspect } from "node:util";
import { after, before, describe, test } from "node:test";

import { ToolregClient, type ToolDefinition, type ToolInput } from "toolreg-client";

import { closeAll, connect, env, rpcError, tokens, uniqueName } from "./helpers.js";

const NAME = uniqueName("ts_echo");
const CATEGORY = uniqueName("ts-cat").replaceAll("_", "-");
const PARAMETERS = { type: "object", properties: { message: { type: "string" } }, required: ["message"] };

function toolInput(overrides: Partial<ToolInput> = {}): ToolInput {
  return {
    name: NAME,
    description: "Echoes its arguments (registered from TypeScript).",
    parameters: PARAMETERS,
    safetyLevel: "safe",
    categories: [CATEGORY],
    sandbox: { image: "toolreg/base", command: ["cat"], limits: { timeoutMs: 10_000 } },
    ...overrides,
  };
}

let admin: ToolregClient;
let agent: ToolregClient;
let first: ToolDefinition;

before(async () => {
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  first = await admin.registerTool(toolInput());
});
after(closeAll);

describe("registerTool", () => {
  test("returns the stored definition with its digest and owner", () => {
    assert.equal(first.name, NAME);
    assert.match(first.digest, /^[0-9a-f]{64}$/);
    assert.equal(first.owner, "admin");
    assert.equal(first.safetyLevel, "safe");
    assert.deepEqual(first.categories, [CATEGORY]);
    assert.deepEqual(first.parameters, PARAMETERS);
    assert.equal(first.sandbox.limits.timeoutMs, 10_000); // int64 as a number
    assert.deepEqual(first.sandbox.command, ["cat"]);
  });

  test("re-registering the identical definition is idempotent", async () => {
    assert.deepEqual(await admin.registerTool(toolInput()), first);
  });

  test("a different definition is ALREADY_EXISTS unless replace", async () => {
    const other = uniqueName("ts_replace");
    const v1 = await admin.registerTool(toolInput({ name: other, categories: ["ts-other"] }));
    const changed = toolInput({ name: other, categories: ["ts-other"], description: "Version two." });
    const err = await rpcError(admin.registerTool(changed));
    assert.equal(err.code, "ALREADY_EXISTS", err.message);
    assert.match(err.grpcMessage, /already exists/);
    const v2 = await admin.registerTool(changed, { replace: true });
    assert.equal(v2.description, "Version two.");
    assert.notEqual(v2.digest, v1.digest);
  });

  test("guards are stored as given, and a call that fails one is INVALID_ARGUMENTS with its message", async () => {
    const guards = [{ condition: 'args.message.startsWith("hi")', message: "say hi first" }];
    const stored = await admin.registerTool(toolInput({ name: uniqueName("ts_guarded"), categories: ["ts-other"], guards }));
    assert.deepEqual(stored.guards, guards);
    assert.deepEqual((await agent.getTool(stored.name)).guards, guards);
    assert.deepEqual(first.guards, [], "a tool without guards has none");
    const refused = await agent.executeTool(stored.name, { message: "bye" });
    assert.equal(refused.status, "INVALID_ARGUMENTS", refused.error);
    assert.match(refused.error, /say hi first/);
  });

  test("parameters given as JSON text are stored as that text", async () => {
    const text = '{"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"string"}}}';
    const stored = await admin.registerTool(toolInput({ name: uniqueName("ts_text"), categories: ["ts-other"], parameters: text }));
    assert.equal(stored.parametersJson, text);
    assert.deepEqual(Object.keys(stored.parameters.properties as object), ["z", "a"]);
  });

  test("an invalid definition is INVALID_ARGUMENT with BadRequest field violations", async () => {
    const err = await rpcError(
      admin.registerTool({
        name: "Bad Name",
        description: "",
        parameters: { type: "object", required: ["x"] },
        sandbox: { image: "", command: [] },
      }),
    );
    assert.equal(err.code, "INVALID_ARGUMENT");
    const found = Object.fromEntries(err.fieldViolations.map((v) => [v.field, v.description]));
    for (const field of ["name", "description", "parameters_json", "sandbox.image", "sandbox.command"]) {
      assert.ok(field in found, `no violation for ${field}: ${JSON.stringify(found)}`);
    }
    assert.match(found.name ?? "", /snake_case/);
    assert.match(err.describe(), /^INVALID_ARGUMENT: .*\n {2}- name: /s);
  });

  test("the agent may not register: PERMISSION_DENIED", async () => {
    const err = await rpcError(agent.registerTool(toolInput({ name: uniqueName("ts_denied") })));
    assert.equal(err.code, "PERMISSION_DENIED", err.message);
    assert.deepEqual(err.fieldViolations, []);
  });
});

describe("getTool", () => {
  test("returns the tool by name", async () => {
    assert.deepEqual(await agent.getTool(NAME), first);
    const echo = await agent.getTool("echo");
    assert.equal(echo.owner, "[operator]");
    assert.equal(echo.sandbox.image, "toolreg/base");
    assert.deepEqual(echo.parameters.required, ["message"]);
  });

  test("an unknown name is RpcError NOT_FOUND", async () => {
    const err = await rpcError(agent.getTool("no_such_tool_here"));
    assert.equal(err.code, "NOT_FOUND");
    assert.equal(err.name, "RpcError");
    assert.match(err.grpcMessage, /no_such_tool_here/);
  });
});

describe("listTools", () => {
  test("without filters: every tool, sorted by name", async () => {
    const names = (await agent.listTools()).map((t) => t.name);
    assert.deepEqual(names, [...names].sort());
    for (const example of ["echo", "run_python", "word_count", "write_file", NAME]) {
      assert.ok(names.includes(example), `${example} missing from ${names.join()}`);
    }
  });

  test("maxLevel and categories filter, ANDed", async () => {
    const safe = await agent.listTools({ maxLevel: "safe" });
    assert.ok(safe.every((t) => t.safetyLevel === "safe"));
    const cautious = (await agent.listTools({ maxLevel: "cautious" })).map((t) => t.name);
    assert.ok(cautious.includes("run_python") && !cautious.includes("write_file"), cautious.join());
    const either = (await agent.listTools({ categories: [CATEGORY, "files"] })).map((t) => t.name);
    assert.deepEqual(either.sort(), [NAME, "write_file"].sort());
    const both = await agent.listTools({ categories: [CATEGORY, "files"], maxLevel: "cautious" });
    assert.deepEqual(both.map((t) => t.name), [NAME]);
    assert.deepEqual(await agent.listTools({ categories: ["no-such-category"] }), []);
  });
});

describe("toolSchemas", () => {
  test("openai is the default format", async () => {
    const schemas = await agent.toolSchemas({ categories: [CATEGORY] });
    assert.deepEqual(schemas, [
      { type: "function", function: { name: NAME, description: first.description, parameters: PARAMETERS } },
    ]);
    assert.deepEqual(await agent.toolSchemas({ format: "openai", categories: [CATEGORY] }), schemas);
  });

  test("anthropic and mcp", async () => {
    const [anthropic] = await agent.toolSchemas({ format: "anthropic", categories: [CATEGORY] });
    assert.deepEqual(anthropic, { name: NAME, description: first.description, input_schema: PARAMETERS });
    const [mcp] = await agent.toolSchemas({ format: "mcp", categories: [CATEGORY] });
    assert.equal(mcp?.name, NAME);
    assert.deepEqual(mcp?.inputSchema, PARAMETERS);
  });

  test("the level filter applies and an empty set is []", async () => {
    const names = (await agent.toolSchemas({ format: "mcp", maxLevel: "safe" })).map((s) => s.name);
    assert.ok(names.includes("echo") && !names.includes("write_file"), names.join());
    assert.deepEqual(await agent.toolSchemas({ categories: ["no-such-category"] }), []);
  });
});

describe("authentication", () => {
  test("an unknown token is RpcError UNAUTHENTICATED, and the token is never shown", async () => {
    const secret = `not-a-known-token-${uniqueName("x")}`;
    const stranger = connect(secret);
    const err = await rpcError(stranger.listTools());
    assert.equal(err.code, "UNAUTHENTICATED", err.message);
    for (const text of [err.message, err.describe(), inspect(err, { depth: 8 }), inspect(stranger, { depth: 8 })]) {
      assert.ok(!text.includes(secret), `the token leaked: ${text}`);
    }
    const exec = await rpcError(stranger.executeTool("echo", { message: "hi" }));
    assert.equal(exec.code, "UNAUTHENTICATED");
  });

  test("no token is UNAUTHENTICATED", async () => {
    const err = await rpcError(connect(undefined).getTool("echo"));
    assert.equal(err.code, "UNAUTHENTICATED");
  });

  test("options are checked when connecting", () => {
    assert.throws(
      () => ToolregClient.connect({ address: env("TOOLREG_ADDRESS"), tls: { cert: "-----BEGIN CERTIFICATE-----" } }),
      /both tls.cert and tls.key/,
    );
    assert.throws(() => ToolregClient.connect({ address: "http://127.0.0.1:1", tls: true }), /plain http/);
    assert.throws(() => ToolregClient.connect({ address: "127.0.0.1" }), /no port|Invalid URL/);
  });
});

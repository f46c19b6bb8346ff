// RegisterTool, GetTool, ListTools and GetToolSchemas from a Node.js client.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import { closeAll, connect, fieldViolations, grpc, rpcError, tokens, uniqueName } from "./lib/client.mjs";

const NAME = uniqueName("interop_echo");
const CATEGORY = uniqueName("interop-cat").replaceAll("_", "-");
const LEVELS = ["SAFETY_LEVEL_SAFE", "SAFETY_LEVEL_CAUTIOUS", "SAFETY_LEVEL_DANGEROUS"];

function toolMessage(overrides = {}) {
  return {
    name: NAME,
    description: "Echoes its arguments (registered from Node.js).",
    parameters_json: JSON.stringify({
      type: "object",
      properties: { message: { type: "string" } },
      required: ["message"],
    }),
    safety_level: "SAFETY_LEVEL_SAFE",
    categories: [CATEGORY],
    sandbox: { image: "toolreg/base", command: ["cat"], env: {}, limits: { timeout_ms: "10000" } },
    ...overrides,
  };
}

let admin;
let agent;
let first;

before(async () => {
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  first = await admin.RegisterTool({ tool: toolMessage() });
});
after(closeAll);

describe("RegisterTool", () => {
  test("returns the stored tool with its digest", () => {
    assert.equal(first.name, NAME);
    assert.match(first.digest, /^[0-9a-f]{64}$/);
    assert.equal(first.safety_level, "SAFETY_LEVEL_SAFE");
    assert.deepEqual(first.categories, [CATEGORY]);
    assert.equal(first.sandbox.limits.timeout_ms, "10000"); // int64 as a string
  });

  test("re-registering the identical definition is idempotent", async () => {
    const again = await admin.RegisterTool({ tool: toolMessage() });
    assert.deepEqual(again, first);
  });

  test("a different definition without replace is ALREADY_EXISTS", async () => {
    const err = await rpcError(
      admin.RegisterTool({ tool: toolMessage({ description: "A different description." }) }),
    );
    assert.equal(err.code, grpc.status.ALREADY_EXISTS, err.details);
    assert.match(err.details, /already exists/);
    assert.deepEqual(await agent.GetTool({ name: NAME }), first); // unchanged
  });

  test("replace=true overwrites and changes the digest", async () => {
    const other = uniqueName("interop_replace");
    const v1 = await admin.RegisterTool({ tool: toolMessage({ name: other, categories: ["interop"] }) });
    const v2 = await admin.RegisterTool({
      tool: toolMessage({ name: other, categories: ["interop"], description: "Version two." }),
      replace: true,
    });
    assert.equal(v2.description, "Version two.");
    assert.notEqual(v2.digest, v1.digest);
  });

  test("an invalid definition is INVALID_ARGUMENT with BadRequest field violations", async () => {
    const err = await rpcError(
      admin.RegisterTool({
        tool: toolMessage({
          name: "Bad Name",
          description: "",
          parameters_json: JSON.stringify({ type: "object", required: ["x"] }),
          sandbox: { image: "", command: [] },
        }),
      }),
    );
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT, err.details);
    const found = fieldViolations(err);
    for (const field of ["name", "description", "parameters_json", "sandbox.image", "sandbox.command"]) {
      assert.ok(field in found, `no violation for ${field}: ${JSON.stringify(found)}`);
    }
    assert.match(found.name, /snake_case/);
    assert.match(found.parameters_json, /x/);
    const missing = await rpcError(agent.GetTool({ name: "bad_name" }));
    assert.equal(missing.code, grpc.status.NOT_FOUND); // nothing stored
  });

  test("unparseable parameters_json names that field", async () => {
    const err = await rpcError(
      admin.RegisterTool({ tool: toolMessage({ name: uniqueName("interop_bad"), parameters_json: "{" }) }),
    );
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.match(fieldViolations(err).parameters_json, /not valid JSON/);
  });
});

describe("GetTool", () => {
  test("returns the tool by name", async () => {
    const got = await agent.GetTool({ name: NAME });
    assert.deepEqual(got, first);
    assert.deepEqual(JSON.parse(got.parameters_json).required, ["message"]);
  });

  test("an unknown name is NOT_FOUND", async () => {
    const err = await rpcError(agent.GetTool({ name: "no_such_tool_here" }));
    assert.equal(err.code, grpc.status.NOT_FOUND, err.details);
  });
});

describe("ListTools", () => {
  test("without filters lists every tool, sorted by name", async () => {
    const { tools } = await agent.ListTools({});
    const names = tools.map((t) => t.name);
    assert.deepEqual(names, [...names].sort());
    for (const example of ["echo", "run_python", "word_count", "write_file", NAME]) {
      assert.ok(names.includes(example), `${example} missing from ${names}`);
    }
  });

  test("max_safety_level keeps tools at or below it", async () => {
    const { tools } = await agent.ListTools({ max_safety_level: "SAFETY_LEVEL_SAFE" });
    const names = tools.map((t) => t.name);
    assert.ok(tools.every((t) => t.safety_level === "SAFETY_LEVEL_SAFE"), names.join());
    assert.ok(names.includes("echo") && names.includes(NAME));
    assert.ok(!names.includes("run_python") && !names.includes("write_file"));
    const cautious = await agent.ListTools({ max_safety_level: "SAFETY_LEVEL_CAUTIOUS" });
    const cautiousNames = cautious.tools.map((t) => t.name);
    assert.ok(cautiousNames.includes("run_python") && !cautiousNames.includes("write_file"));
    for (const t of cautious.tools) assert.ok(LEVELS.indexOf(t.safety_level) <= 1, t.name);
  });

  test("categories keeps tools having any of them; filters are ANDed", async () => {
    const mine = await agent.ListTools({ categories: [CATEGORY] });
    assert.deepEqual(mine.tools.map((t) => t.name), [NAME]);
    const either = await agent.ListTools({ categories: [CATEGORY, "files"] });
    assert.deepEqual(either.tools.map((t) => t.name).sort(), [NAME, "write_file"].sort());
    const both = await agent.ListTools({ categories: [CATEGORY, "files"], max_safety_level: "SAFETY_LEVEL_CAUTIOUS" });
    assert.deepEqual(both.tools.map((t) => t.name), [NAME]);
    const none = await agent.ListTools({ categories: ["no-such-category"] });
    assert.deepEqual(none.tools, []);
  });
});

describe("GetToolSchemas", () => {
  const schemas = async (format, filters = { categories: [CATEGORY] }) =>
    JSON.parse((await agent.GetToolSchemas({ format, ...filters })).schemas_json);
  const parameters = () => JSON.parse(first.parameters_json);

  test("OPENAI: type function with function.parameters", async () => {
    const [entry, ...rest] = await schemas("SCHEMA_FORMAT_OPENAI");
    assert.equal(rest.length, 0);
    assert.equal(entry.type, "function");
    assert.equal(entry.function.name, NAME);
    assert.equal(entry.function.description, first.description);
    assert.deepEqual(entry.function.parameters, parameters());
  });

  test("UNSPECIFIED is OPENAI", async () => {
    assert.deepEqual(await schemas("SCHEMA_FORMAT_UNSPECIFIED"), await schemas("SCHEMA_FORMAT_OPENAI"));
  });

  test("ANTHROPIC: name, description, input_schema", async () => {
    const [entry] = await schemas("SCHEMA_FORMAT_ANTHROPIC");
    assert.equal(entry.name, NAME);
    assert.equal(entry.description, first.description);
    assert.deepEqual(entry.input_schema, parameters());
  });

  test("MCP: name, description, inputSchema", async () => {
    const [entry] = await schemas("SCHEMA_FORMAT_MCP");
    assert.equal(entry.name, NAME);
    assert.deepEqual(entry.inputSchema, parameters());
  });

  test("the level filter applies and an empty set is []", async () => {
    const safe = await schemas("SCHEMA_FORMAT_MCP", { max_safety_level: "SAFETY_LEVEL_SAFE" });
    const names = safe.map((s) => s.name);
    assert.ok(names.includes("echo") && !names.includes("write_file"), names.join());
    assert.deepEqual(await schemas("SCHEMA_FORMAT_ANTHROPIC", { categories: ["no-such-category"] }), []);
  });
});

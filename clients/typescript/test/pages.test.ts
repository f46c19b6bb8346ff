// Pages (AIP-158): listTools, toolSchemas and listApprovalRequests follow
// nextPageToken to the end; the page-level methods give one page and its
// token; a token altered or used with other filters is INVALID_ARGUMENT.
import { strict as assert } from "node:assert";
import { after, before, describe, test } from "node:test";

import { ToolregClient, type ToolInput } from "toolreg-client";

import { askForApproval, closeAll, connect, rpcError, tokens, uniqueName } from "./helpers.js";

/** Whether `ids` appear in `listed` in this order (other tests' requests may sit between). */
function inOrder(listed: string[], ids: string[]): boolean {
  let at = 0;
  for (const id of listed) if (id === ids[at]) at += 1;
  return at === ids.length;
}

const COUNT = 130; // more than the server's default page of 100
const CATEGORY = uniqueName("ts-pages").replaceAll("_", "-");
const PREFIX = uniqueName("ts_page");
const NAMES = Array.from({ length: COUNT }, (_, i) => `${PREFIX}_${String(i).padStart(3, "0")}`);

function toolInput(name: string): ToolInput {
  return {
    name,
    description: "A tool of the paging tests.",
    parameters: { type: "object", properties: {} },
    safetyLevel: "safe",
    categories: [CATEGORY],
    sandbox: { image: "toolreg/base", command: ["cat"] },
  };
}

let admin: ToolregClient;
let agent: ToolregClient;
let approver: ToolregClient;

before(async () => {
  admin = connect(tokens.admin);
  agent = connect(tokens.agent);
  approver = connect(tokens.approver);
  for (let i = 0; i < NAMES.length; i += 10) {
    await Promise.all(NAMES.slice(i, i + 10).map((name) => admin.registerTool(toolInput(name))));
  }
});
after(closeAll);

describe("tools a page at a time", () => {
  test("listTools follows every page", async () => {
    const names = (await agent.listTools({ categories: [CATEGORY] })).map((t) => t.name);
    assert.deepEqual(names, NAMES);
    const small = (await agent.listTools({ categories: [CATEGORY], pageSize: 7 })).map((t) => t.name);
    assert.deepEqual(small, NAMES);
  });

  test("without a size, a page is the server's default, with a token to go on", async () => {
    const first = await agent.listToolsPage({ categories: [CATEGORY] });
    assert.equal(first.items.length, 100);
    assert.ok(first.nextPageToken);
    const rest = await agent.listToolsPage({ categories: [CATEGORY], pageToken: first.nextPageToken });
    assert.deepEqual([...first.items, ...rest.items].map((t) => t.name), NAMES);
    assert.equal(rest.nextPageToken, "");
  });

  test("listToolsPage walks the pages by hand", async () => {
    const seen: string[] = [];
    let pageToken = "";
    let pages = 0;
    do {
      const page = await agent.listToolsPage({ categories: [CATEGORY], pageSize: 7, pageToken });
      assert.ok(page.items.length <= 7);
      seen.push(...page.items.map((t) => t.name));
      pageToken = page.nextPageToken;
      pages += 1;
    } while (pageToken);
    assert.deepEqual(seen, NAMES);
    assert.equal(pages, Math.ceil(COUNT / 7));
  });

  test("toolSchemas concatenates the pages' arrays", async () => {
    const schemas = await agent.toolSchemas({ categories: [CATEGORY], format: "anthropic", pageSize: 40 });
    assert.deepEqual(schemas.map((s) => s.name), NAMES);
    assert.deepEqual(schemas[0]?.input_schema, { type: "object", properties: {} });
    const page = await agent.toolSchemasPage({ categories: [CATEGORY], pageSize: 3 });
    assert.deepEqual(page.items.map((s) => (s.function as { name: string }).name), NAMES.slice(0, 3));
    assert.ok(page.nextPageToken);
  });

  test("an altered token, or one of another query, is INVALID_ARGUMENT naming page_token", async () => {
    const { nextPageToken } = await agent.listToolsPage({ categories: [CATEGORY], pageSize: 2 });
    const altered = nextPageToken.slice(0, 8) + (nextPageToken[8] === "A" ? "B" : "A") + nextPageToken.slice(9);
    for (const call of [
      () => agent.listToolsPage({ categories: [CATEGORY], pageToken: altered }),
      () => agent.listToolsPage({ pageToken: nextPageToken }), // other filters
      () => agent.toolSchemasPage({ categories: [CATEGORY], pageToken: nextPageToken }), // another listing
      () => agent.listToolsPage({ pageToken: "not a token" }),
    ]) {
      const err = await rpcError(call());
      assert.equal(err.code, "INVALID_ARGUMENT", err.message);
      assert.deepEqual(err.fieldViolations.map((v) => v.field), ["page_token"]);
    }
    const err = await rpcError(agent.listToolsPage({ pageSize: -1 }));
    assert.deepEqual(err.fieldViolations.map((v) => v.field), ["page_size"]);
  });
});

describe("approval requests a page at a time", () => {
  test("listApprovalRequests follows the pages; limit caps the total", async () => {
    // Other test files open requests at the same time: what is asserted holds anyway.
    const asked = [await askForApproval(agent), await askForApproval(agent), await askForApproval(agent)];
    const ids = asked.map((a) => a.request.id).reverse(); // newest first
    const all = (await approver.listApprovalRequests({ pageSize: 1 })).map((r) => r.id);
    assert.ok(inOrder(all, ids), `${ids.join()} not in order in ${all.join()}`);
    assert.equal(new Set(all).size, all.length);
    const pending = (await approver.listApprovalRequests({ state: "PENDING", pageSize: 2 })).map((r) => r.id);
    assert.ok(inOrder(pending, ids));
    assert.equal((await approver.listApprovalRequests({ limit: 2 })).length, 2);

    const seen: string[] = [];
    let pageToken = "";
    let first = "";
    do {
      const page = await approver.listApprovalRequestsPage({ state: "PENDING", pageSize: 1, pageToken });
      assert.ok(page.items.length <= 1);
      seen.push(...page.items.map((r) => r.id));
      pageToken = page.nextPageToken;
      first ||= pageToken;
    } while (pageToken);
    assert.ok(inOrder(seen, ids));
    const err = await rpcError(approver.listApprovalRequestsPage({ state: "APPROVED", pageToken: first }));
    assert.equal(err.code, "INVALID_ARGUMENT");
    assert.deepEqual(err.fieldViolations.map((v) => v.field), ["page_token"]);
  });
});

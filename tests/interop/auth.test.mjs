// Bearer-token authentication and roles, seen from the typed Node.js client
// (toolreg-client): request errors carry their gRPC code by name.
import { strict as assert } from "node:assert";
import { after, describe, test } from "node:test";

import { clientError, closeAll, connectClient, tokens } from "./lib/client.mjs";

after(closeAll);

const TOOL = {
  name: "interop_denied",
  description: "Must never be stored.",
  parameters: { type: "object" },
  sandbox: { image: "toolreg/base", command: ["cat"] },
};

describe("authentication", () => {
  test("no token is UNAUTHENTICATED", async () => {
    const anonymous = connectClient(null);
    const err = await clientError(anonymous.listTools());
    assert.equal(err.code, "UNAUTHENTICATED", err.message);
    const exec = await clientError(anonymous.executeTool("echo", {}));
    assert.equal(exec.code, "UNAUTHENTICATED");
  });

  test("an unknown token is UNAUTHENTICATED", async () => {
    const err = await clientError(connectClient("not-a-known-token").getTool("echo"));
    assert.equal(err.code, "UNAUTHENTICATED", err.message);
  });

  test("the agent token may not RegisterTool: PERMISSION_DENIED", async () => {
    const agent = connectClient(tokens.agent);
    const err = await clientError(agent.registerTool(TOOL));
    assert.equal(err.code, "PERMISSION_DENIED", err.message);
    assert.match(err.grpcMessage, /register/);
    const missing = await clientError(agent.getTool(TOOL.name));
    assert.equal(missing.code, "NOT_FOUND");
  });

  test("the agent token may not list approval requests; the admin may not execute", async () => {
    const list = await clientError(connectClient(tokens.agent).listApprovalRequests());
    assert.equal(list.code, "PERMISSION_DENIED", list.message);
    const exec = await clientError(connectClient(tokens.admin).executeTool("echo", {}));
    assert.equal(exec.code, "PERMISSION_DENIED", exec.message);
  });

  test("the agent token reads the registry", async () => {
    const echo = await connectClient(tokens.agent).getTool("echo");
    assert.equal(echo.name, "echo");
    assert.equal(echo.safetyLevel, "safe");
  });
});

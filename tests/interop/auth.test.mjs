// Bearer-token authentication and roles, seen from a Node.js client.
import { strict as assert } from "node:assert";
import { after, describe, test } from "node:test";

import { closeAll, connect, grpc, rpcError, tokens } from "./lib/client.mjs";

after(closeAll);

const TOOL = {
  name: "interop_denied",
  description: "Must never be stored.",
  parameters_json: JSON.stringify({ type: "object" }),
  sandbox: { image: "toolreg/base", command: ["cat"] },
};

describe("authentication", () => {
  test("no token is UNAUTHENTICATED", async () => {
    const anonymous = connect(null);
    const err = await rpcError(anonymous.ListTools({}));
    assert.equal(err.code, grpc.status.UNAUTHENTICATED, err.details);
    const exec = await rpcError(anonymous.ExecuteTool({ name: "echo", arguments_json: "{}" }));
    assert.equal(exec.code, grpc.status.UNAUTHENTICATED);
  });

  test("an unknown token is UNAUTHENTICATED", async () => {
    const err = await rpcError(connect("not-a-known-token").GetTool({ name: "echo" }));
    assert.equal(err.code, grpc.status.UNAUTHENTICATED, err.details);
  });

  test("the agent token may not RegisterTool: PERMISSION_DENIED", async () => {
    const agent = connect(tokens.agent);
    const err = await rpcError(agent.RegisterTool({ tool: TOOL }));
    assert.equal(err.code, grpc.status.PERMISSION_DENIED, err.details);
    assert.match(err.details, /register/);
    const missing = await rpcError(agent.GetTool({ name: TOOL.name }));
    assert.equal(missing.code, grpc.status.NOT_FOUND);
  });

  test("the agent token may not list approval requests; the admin may not execute", async () => {
    const list = await rpcError(connect(tokens.agent).ListApprovalRequests({}));
    assert.equal(list.code, grpc.status.PERMISSION_DENIED, list.details);
    const exec = await rpcError(connect(tokens.admin).ExecuteTool({ name: "echo", arguments_json: "{}" }));
    assert.equal(exec.code, grpc.status.PERMISSION_DENIED, exec.details);
  });

  test("the agent token reads the registry", async () => {
    const echo = await connect(tokens.agent).GetTool({ name: "echo" });
    assert.equal(echo.name, "echo");
  });
});

// clientCredentials against a real identity provider (oidc-provider, over TLS
// with a CA made for the run) and a real `toolreg serve` that trusts it:
// tests/identity/test_login.py runs this file alone (it is not in test/*.test.ts,
// which the plain suite runs) and passes the provider's client in the environment.
import { strict as assert } from "node:assert";
import { after, test } from "node:test";

import { clientCredentials } from "toolreg-client";

import { closeAll, connect, env } from "../helpers.js";

after(closeAll);

test("an agent lists tools with a clientCredentials provider: asked per call, one token fetched", async () => {
  const provider = clientCredentials({
    tokenEndpoint: env("TOOLREG_IDP_TOKEN_ENDPOINT"),
    clientId: env("TOOLREG_IDP_CLIENT_ID"),
    clientSecret: env("TOOLREG_IDP_CLIENT_SECRET"),
    resource: env("TOOLREG_IDP_RESOURCE"),
    scope: env("TOOLREG_IDP_SCOPE"),
    ca: env("TOOLREG_IDP_CA_FILE"),
  });
  let asked = 0;
  const agent = connect(() => {
    asked += 1;
    return provider();
  });
  const tools = await agent.listTools();
  assert.ok(tools.some((t) => t.name === env("TOOLREG_TOOL_NAME")), JSON.stringify(tools.map((t) => t.name)));
  const schemas = await agent.toolSchemas({ format: "openai" });
  assert.ok(schemas.length > 0);
  await agent.getTool(env("TOOLREG_TOOL_NAME"));
  assert.ok(asked >= 3, `asked ${asked} times`); // one per RPC (a listing may take pages)
  assert.equal(provider.fetches, 1);
});

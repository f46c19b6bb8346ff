// TLS against real servers: one with a server certificate (clients by bearer
// token), one requiring client certificates (mTLS; the client is named by its
// certificate's subject). Both certificates name "localhost" and come from a
// throwaway CA the pytest driver makes.
import { strict as assert } from "node:assert";
import { readFileSync } from "node:fs";
import { after, describe, test } from "node:test";

import { ToolregClient, type ClientOptions } from "toolreg-client";

import { env, rpcError, tokens } from "./helpers.js";

const SERVER_NAME = "localhost"; // the servers listen on 127.0.0.1; their certificates name localhost

const open: ToolregClient[] = [];
after(() => open.forEach((c) => c.close()));

function client(options: ClientOptions): ToolregClient {
  const c = ToolregClient.connect(options);
  open.push(c);
  return c;
}

describe("TLS with a server certificate and a bearer token", () => {
  const address = () => env("TOOLREG_TLS_ADDRESS");

  test("the CA as a file path: list and execute", async () => {
    const agent = client({
      address: address(),
      token: tokens.agent,
      tls: { ca: env("TOOLREG_TLS_CA_FILE"), serverName: SERVER_NAME },
    });
    const names = (await agent.listTools()).map((t) => t.name);
    assert.ok(names.includes("echo"), names.join());
    const result = await agent.executeTool("echo", { message: "over TLS" });
    assert.equal(result.status, "OK", result.error);
    assert.deepEqual(result.data, { message: "over TLS" });
  });

  test("the CA as PEM text, and an https:// address", async () => {
    const pem = readFileSync(env("TOOLREG_TLS_CA_FILE"), "utf8");
    const agent = client({
      address: `https://${address()}`,
      token: tokens.agent,
      tls: { ca: pem, serverName: SERVER_NAME },
    });
    assert.equal((await agent.getTool("echo")).name, "echo");
  });

  test("verification is on by default: the system's CAs do not trust the server", async () => {
    const err = await rpcError(
      client({ address: address(), token: tokens.agent, tls: { serverName: SERVER_NAME } }).listTools(),
    );
    assert.equal(err.code, "UNAVAILABLE", err.message);
    assert.match(err.message, /certificate/i);
    const plain = await rpcError(client({ address: address(), token: tokens.agent, tls: true }).listTools());
    assert.equal(plain.code, "UNAVAILABLE", plain.message);
  });

  test("a certificate for another name is refused", async () => {
    const wrongName = client({
      address: address(),
      token: tokens.agent,
      tls: { ca: env("TOOLREG_TLS_CA_FILE"), serverName: "not-the-server.example" },
    });
    const err = await rpcError(wrongName.listTools());
    assert.equal(err.code, "UNAVAILABLE", err.message);
    assert.match(err.message, /not-the-server\.example/);
  });

  test("a plain-text client gets no answer from a TLS server", async () => {
    const err = await rpcError(client({ address: address(), token: tokens.agent }).listTools({ timeoutMs: 5_000 }));
    // The server drops the connection: gRPC over HTTP/2 reports the reset stream as CANCELLED.
    assert.ok(["UNAVAILABLE", "CANCELLED"].includes(err.code), err.message);
  });
});

describe("mutual TLS", () => {
  const address = () => env("TOOLREG_MTLS_ADDRESS");

  test("a client certificate and key identify the client (no token)", async () => {
    const agent = client({
      address: address(),
      tls: {
        ca: env("TOOLREG_TLS_CA_FILE"),
        cert: env("TOOLREG_TLS_CLIENT_CERT_FILE"),
        key: readFileSync(env("TOOLREG_TLS_CLIENT_KEY_FILE")), // bytes work as well
        serverName: SERVER_NAME,
      },
    });
    const names = (await agent.listTools()).map((t) => t.name);
    assert.ok(names.includes("echo"), names.join());
    const result = await agent.executeTool("echo", { message: "over mTLS" });
    assert.equal(result.status, "OK", result.error);
  });

  test("without a client certificate the server refuses the connection", async () => {
    const anonymous = client({
      address: address(),
      token: tokens.agent,
      tls: { ca: env("TOOLREG_TLS_CA_FILE"), serverName: SERVER_NAME },
    });
    const err = await rpcError(anonymous.listTools({ timeoutMs: 5_000 }));
    assert.ok(["UNAVAILABLE", "CANCELLED"].includes(err.code), err.message);
  });
});

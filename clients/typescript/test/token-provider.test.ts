// A token provider instead of a static token: asked before every call, its
// failure the call's; and clientCredentials against a token endpoint on
// loopback (caching, one fetch for concurrent calls, a new token before
// expiry, errors that name the OAuth error code and nothing secret).
import { strict as assert } from "node:assert";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, test } from "node:test";

import { clientCredentials, RpcError, TokenError } from "toolreg-client";

import { closeAll, connect, rejection, tokens } from "./helpers.js";

after(closeAll);

describe("a token provider", () => {
  test("is asked before every call, and may be async", async () => {
    let asked = 0;
    const agent = connect(async () => {
      asked += 1;
      return tokens.agent;
    });
    await agent.getTool("word_count");
    await agent.getTool("echo");
    assert.equal(asked, 2);
  });

  test("that throws fails the call with its message", async () => {
    const agent = connect(() => {
      throw new TokenError("token endpoint refused: HTTP 401 (invalid_client)");
    });
    const err = await rejection(agent.listTools());
    assert.ok(err instanceof RpcError, String(err));
    assert.match(err.message, /invalid_client/);
  });
});

interface Seen {
  form: URLSearchParams;
  authorization: string | undefined;
}

/** A token endpoint on loopback: answers the next scripted [status, body]; records each request. */
class TokenEndpoint {
  readonly seen: Seen[] = [];
  readonly answers: Array<[number, object]> = [];
  delayMs = 0;
  #server: Server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      this.seen.push({
        form: new URLSearchParams(Buffer.concat(chunks).toString()),
        authorization: req.headers.authorization,
      });
      const [status, body] = this.answers.shift() ?? [500, {}];
      setTimeout(() => {
        res.writeHead(status, { "content-type": "application/json" });
        res.end(JSON.stringify(body));
      }, this.delayMs);
    });
  });

  get url(): string {
    return `http://127.0.0.1:${(this.#server.address() as AddressInfo).port}/token`;
  }

  listen(): Promise<void> {
    return new Promise((resolve) => this.#server.listen(0, "127.0.0.1", resolve));
  }

  close(): Promise<void> {
    return new Promise((resolve) => this.#server.close(() => resolve()));
  }
}

describe("clientCredentials", () => {
  const endpoint = new TokenEndpoint();
  before(() => endpoint.listen());
  after(() => endpoint.close());

  const options = () => ({
    tokenEndpoint: endpoint.url,
    clientId: "agent 1",
    clientSecret: "s3cret:x",
    resource: "https://registry.example",
    scope: "toolreg",
  });

  test("fetches one token for concurrent and later calls, with the grant's form", async () => {
    endpoint.seen.length = 0;
    endpoint.delayMs = 50;
    endpoint.answers.push([200, { access_token: "token-1", expires_in: 300 }]);
    const provider = clientCredentials(options());
    const got = await Promise.all([provider(), provider(), provider()]);
    assert.deepEqual(got, ["token-1", "token-1", "token-1"]);
    assert.equal(await provider(), "token-1");
    assert.equal(provider.fetches, 1);
    assert.equal(endpoint.seen.length, 1);
    const [first] = endpoint.seen;
    assert.deepEqual(Object.fromEntries(first!.form), {
      grant_type: "client_credentials",
      resource: "https://registry.example",
      scope: "toolreg",
    });
    // RFC 6749 2.3.1: form-encoded, then Basic
    assert.equal(first!.authorization, `Basic ${Buffer.from("agent%201:s3cret%3Ax").toString("base64")}`);
    endpoint.delayMs = 0;
  });

  test("fetches a new token once the kept one is near expiry", async () => {
    endpoint.answers.push([200, { access_token: "short", expires_in: 20 }]); // inside the margin
    endpoint.answers.push([200, { access_token: "next", expires_in: 300 }]);
    const provider = clientCredentials(options());
    assert.equal(await provider(), "short");
    assert.equal(await provider(), "next");
    assert.equal(await provider(), "next");
    assert.equal(provider.fetches, 2);
  });

  test("a refusal names the HTTP status and error code, never the description or secret", async () => {
    endpoint.answers.push([401, { error: "invalid_client", error_description: "secret s3cret:x is wrong" }]);
    const provider = clientCredentials(options());
    const err = await rejection(provider());
    assert.ok(err instanceof TokenError);
    assert.equal(err.message, "token endpoint refused: HTTP 401 (invalid_client)");
    endpoint.answers.push([200, { token_type: "Bearer" }]);
    assert.match(String(await rejection(provider())), /no access_token/);
    endpoint.answers.push([200, { access_token: "after", expires_in: 300 }]);
    assert.equal(await provider(), "after"); // a failed fetch is tried again on the next call
  });

  test("wants https, except to loopback", () => {
    assert.throws(
      () => clientCredentials({ ...options(), tokenEndpoint: "http://idp.example/token" }),
      /https/,
    );
  });
});

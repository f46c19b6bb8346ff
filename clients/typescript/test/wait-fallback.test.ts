// waitForApproval against servers the real one cannot stand in for: one that
// cannot watch (UNIMPLEMENTED: the wait polls), and one whose watches end
// early (normally, or ABORTED: the wait watches again, and still never polls).
// A real gRPC server over HTTP/2 (Connect's Node adapter), in this process,
// answering from a script.
import { strict as assert } from "node:assert";
import { createServer, type Http2Server } from "node:http2";
import type { AddressInfo } from "node:net";
import { after, describe, test } from "node:test";

import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter, type ServiceImpl } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { ApprovalWaitError, RpcError, ToolregClient } from "toolreg-client";
import { ApprovalEventType, ApprovalRequestSchema, ToolRegistry } from "toolreg-client/gen/registry";

import { rejection } from "./helpers.js";

const ID = "req-1";
const request = (state: string, more: MessageInitShape<typeof ApprovalRequestSchema> = {}) =>
  create(ApprovalRequestSchema, { id: ID, toolName: "write_file", approvalsRequired: 1, ...more, state });

const servers: Http2Server[] = [];
const clients: ToolregClient[] = [];
after(() => {
  for (const client of clients) client.close();
  for (const server of servers) server.close();
});

/** A server implementing `impl` (every other method: UNIMPLEMENTED), and a client of it. */
async function serve(impl: Partial<ServiceImpl<typeof ToolRegistry>>): Promise<ToolregClient> {
  const routes = (router: ConnectRouter) => router.service(ToolRegistry, impl);
  const server = createServer(connectNodeAdapter({ routes }));
  servers.push(server);
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  const client = ToolregClient.connect({ address: `127.0.0.1:${port}` });
  clients.push(client);
  return client;
}

const pause = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const untilAborted = (signal: AbortSignal) =>
  new Promise((resolve) => signal.addEventListener("abort", resolve, { once: true }));

describe("waitForApproval's fallbacks", () => {
  test("a server that cannot watch is polled every pollMs", async () => {
    let gets = 0;
    const client = await serve({
      getApprovalRequest: () => request(++gets < 3 ? "PENDING" : "APPROVED", { argumentsJson: "{}" }),
    });
    const approved = await client.waitForApproval(ID, { timeoutMs: 10_000, pollMs: 50 });
    assert.equal(approved.state, "APPROVED");
    assert.equal(approved.argumentsJson, "{}");
    assert.equal(gets, 4, "two polls PENDING, one APPROVED, then the request read whole");

    gets = -1_000; // PENDING from now on
    const started = performance.now();
    const err = await rejection(client.waitForApproval(ID, { timeoutMs: 300, pollMs: 50 }));
    assert.ok(err instanceof ApprovalWaitError && err.reason === "TIMEOUT", String(err));
    assert.ok(gets > -1_000 + 3, `polled every 50 ms for 300 ms (${gets + 1_000} polls)`);
    assert.ok(performance.now() - started < 2_000);
  });

  test("a watch the server ends, or ABORTs, is watched again; no polling", async () => {
    let watches = 0;
    let gets = 0;
    const client = await serve({
      async *watchApprovalRequests(req) {
        assert.equal(req.requestId, ID);
        const n = ++watches;
        yield { type: ApprovalEventType.CURRENT, request: request("PENDING") };
        yield { type: ApprovalEventType.SYNCED };
        if (n === 1) return; // the server ended the stream (e.g. stopping)
        if (n === 2) throw new ConnectError("this watch fell too far behind; watch again", Code.Aborted);
        await pause(100);
        yield { type: ApprovalEventType.APPROVAL_ADDED, actor: "alice", request: request("APPROVED"), seq: 7n };
      },
      getApprovalRequest: () => {
        gets++;
        return request("APPROVED", { argumentsJson: "{}" });
      },
    });
    const approved = await client.waitForApproval(ID, { timeoutMs: 10_000, pollMs: 60_000 });
    assert.equal(approved.state, "APPROVED");
    assert.equal(watches, 3);
    assert.equal(gets, 1, "read whole once approved; never polled");
  });

  test("a watch that fails otherwise fails the wait at once", async () => {
    let watches = 0;
    const client = await serve({
      // eslint-disable-next-line require-yield
      async *watchApprovalRequests() {
        watches++;
        throw new ConnectError("not yours", Code.PermissionDenied);
      },
    });
    const err = await rejection(client.waitForApproval(ID, { timeoutMs: 10_000 }));
    assert.ok(err instanceof RpcError && err.code === "PERMISSION_DENIED", String(err));
    assert.equal(watches, 1);
  });

  test("leaving a stream early clears its deadline timer (it would keep the process alive)", async () => {
    const client = await serve({
      // Both run until the client cancels (the server's own timers then end too).
      async *watchApprovalRequests(_req, ctx) {
        yield { type: ApprovalEventType.SYNCED };
        await untilAborted(ctx.signal);
      },
      async *streamExecuteTool(_req, ctx) {
        yield { event: { case: "stdout", value: new TextEncoder().encode("started\n") } };
        await untilAborted(ctx.signal);
      },
    });
    const timers = () => process.getActiveResourcesInfo().filter((kind) => kind === "Timeout").length;
    const before = timers();
    for await (const event of client.watchApprovalRequests({ timeoutMs: 60_000 })) {
      assert.equal(event.type, "SYNCED");
      break;
    }
    for await (const event of client.streamTool("sleeper", {}, { timeoutMs: 60_000 })) {
      assert.equal(event.kind, "stdout");
      break;
    }
    await pause(200); // the server's side sees the cancels
    assert.equal(timers(), before, "no timer is left behind");
  });

  test("watchApprovalRequests skips an event type this client does not know", async () => {
    const client = await serve({
      async *watchApprovalRequests() {
        yield { type: 99 as ApprovalEventType, request: request("PENDING") };
        yield { type: ApprovalEventType.SYNCED };
        yield { type: ApprovalEventType.REJECTED, actor: "alice", reason: "no", request: request("REJECTED") };
      },
    });
    const seen = [];
    for await (const event of client.watchApprovalRequests()) seen.push(event);
    assert.deepEqual(
      seen.map((e) => [e.type, e.request?.state ?? null, e.reason]),
      [
        ["SYNCED", null, ""],
        ["REJECTED", "REJECTED", "no"],
      ],
    );
  });
});

// What the tests share: the servers' addresses and credentials from the
// environment (tests/integration/test_typescript_client.py sets them), clients
// closed after each file, and an approver's token minted here in Node.
import { strict as assert } from "node:assert";
import { createHash, createPrivateKey, randomBytes, sign } from "node:crypto";

import {
  RpcError,
  ToolregClient,
  type ApprovalRequestView,
  type ClientOptions,
  type TokenProvider,
} from "toolreg-client";

/** A variable the pytest driver sets; a missing one fails the test (never a skip). */
export function env(name: string): string {
  const value = process.env[name];
  assert.ok(value, `set ${name} (tests/integration/test_typescript_client.py does)`);
  return value;
}

export const tokens = {
  get agent() {
    return env("TOOLREG_AGENT_TOKEN");
  },
  /** Another agent (watch tests only): it may not see the first one's requests. */
  get otherAgent() {
    return env("TOOLREG_OTHER_AGENT_TOKEN");
  },
  get admin() {
    return env("TOOLREG_ADMIN_TOKEN");
  },
  /** The operator (admin role): the kill switch, and tools of any level. */
  get ops() {
    return env("TOOLREG_OPS_TOKEN");
  },
  get approver() {
    return env("TOOLREG_APPROVER_TOKEN");
  },
};

const open: ToolregClient[] = [];

/** A client of the plain (no TLS) server; more options for the TLS servers. */
export function connect(token: string | TokenProvider | undefined, options: ClientOptions = {}): ToolregClient {
  const client = ToolregClient.connect({ address: env("TOOLREG_ADDRESS"), token, ...options });
  open.push(client);
  return client;
}

export function closeAll(): void {
  while (open.length) open.pop()?.close();
}

/** Awaits a promise that must reject and returns the reason. */
export async function rejection(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  assert.fail("the promise resolved; a rejection was expected");
}

/**
 * A fresh write_file call that needs approval (the policy wants one approver
 * of group security), made by `agent`; its arguments, their canonical JSON,
 * and the approval request.
 */
export async function askForApproval(agent: ToolregClient) {
  const file = `ts-client/${uniqueName("note")}.txt`;
  const args = { path: file, content: "from typescript" };
  const result = await agent.executeTool("write_file", args);
  assert.equal(result.status, "APPROVAL_REQUIRED", result.error);
  assert.equal(result.success, false);
  assert.equal(result.needsApproval, true);
  assert.ok(result.approvalRequest, "APPROVAL_REQUIRED carries the approval request");
  // RFC 8785 for this ASCII-only object: keys sorted, no whitespace.
  const canonical = JSON.stringify({ content: args.content, path: file });
  return { args, canonical, request: result.approvalRequest };
}

/** Signs `request` as the approver (the test's key) and submits the token. */
export async function approve(approver: ToolregClient, request: ApprovalRequestView): Promise<ApprovalRequestView> {
  const seen = await approver.getApprovalRequest(request.id);
  const token = mintApproval(env("TOOLREG_APPROVER_KEY_PEM"), env("TOOLREG_APPROVER_ID"), seen);
  return approver.submitApproval(request.id, token);
}

/** Awaits a call that must fail with an RpcError and returns it. */
export async function rpcError(promise: Promise<unknown>): Promise<RpcError> {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof RpcError, `not an RpcError: ${String(err)}`);
    return err;
  }
  assert.fail("the call succeeded; an error was expected");
}

/** A name no other test file (or run) uses. */
export const uniqueName = (prefix: string): string => `${prefix}_${randomBytes(4).toString("hex")}`;

export const sha256Hex = (text: string): string => createHash("sha256").update(text, "utf8").digest("hex");

const b64url = (data: string | Buffer): string => Buffer.from(data).toString("base64url");

/**
 * An approval token (JWT, EdDSA, one approver) for `request`, bound to it:
 * what `toolreg approvals approve` does, from the approver's Ed25519 key
 * (PKCS8 PEM). The tests stand in for a human approver here.
 */
export function mintApproval(privateKeyPem: string, issuer: string, request: ApprovalRequestView): string {
  const now = Math.floor(Date.now() / 1000);
  const header = { alg: "EdDSA", typ: "toolreg-approval+jwt" };
  const claims = {
    iss: issuer,
    aud: request.audience,
    sub: request.toolName,
    tool_digest: request.toolDigest,
    args_digest: request.argumentsDigest,
    requester: request.requestedBy,
    iat: now,
    exp: now + Math.min(300, request.maxTokenTtlS),
    jti: b64url(randomBytes(16)),
    req: request.id,
  };
  const input = `${b64url(JSON.stringify(header))}.${b64url(JSON.stringify(claims))}`;
  const signature = sign(null, Buffer.from(input), createPrivateKey(privateKeyPem));
  return `${input}.${b64url(signature)}`;
}

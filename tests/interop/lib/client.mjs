// What a Node.js agent runtime needs to talk to toolreg, two ways:
// - `connect`: the .proto loaded at run time with @grpc/grpc-js (no generated
//   code), bearer tokens as call metadata, and the google.rpc details decoded
//   from the status trailer by hand: proves the bare .proto is enough;
// - `connectClient`: the typed client package (clients/typescript, generated
//   from the same .proto with protobuf-es, Connect's gRPC transport).
import { strict as assert } from "node:assert";
import { randomBytes, createHash, createPrivateKey, sign } from "node:crypto";
import path from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";
import { RpcError, ToolregClient } from "toolreg-client";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PROTO_ROOT = path.resolve(HERE, "..", "..", "..", "proto");
const CALL_TIMEOUT_MS = 60_000; // per RPC: executions start a fresh container

// google/protobuf/timestamp.proto is not under proto/: protobufjs (which
// proto-loader uses) ships the well-known types and resolves the import.
const definition = protoLoader.loadSync("toolregistry/v1/registry.proto", {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT],
});
const pkg = grpc.loadPackageDefinition(definition);
export const ToolRegistry = pkg.toolregistry.v1.ToolRegistry;

const rpcTypes = new protobuf.Root().loadSync(path.join(HERE, "..", "rpc_status.proto"), {
  keepCase: true,
});
const StatusType = rpcTypes.lookupType("google.rpc.Status");
const BadRequestType = rpcTypes.lookupType("google.rpc.BadRequest");
const BAD_REQUEST_URL = "type.googleapis.com/google.rpc.BadRequest";

function requiredEnv(name) {
  const value = process.env[name];
  assert.ok(value, `set ${name} (the pytest wrapper tests/integration/test_interop_node.py does)`);
  return value;
}

export const address = () => requiredEnv("TOOLREG_ADDRESS");
export const tokens = {
  get agent() {
    return requiredEnv("TOOLREG_AGENT_TOKEN");
  },
  get admin() {
    return requiredEnv("TOOLREG_ADMIN_TOKEN");
  },
  get approver() {
    return requiredEnv("TOOLREG_APPROVER_TOKEN");
  },
};

const openClients = [];

/** A client whose every call carries `authorization: Bearer <token>` (none when token is null). */
export function connect(token) {
  const raw = new ToolRegistry(address(), grpc.credentials.createInsecure());
  openClients.push(raw);
  const metadata = () => {
    const md = new grpc.Metadata();
    if (token) md.set("authorization", `Bearer ${token}`);
    return md;
  };
  const deadline = () => new Date(Date.now() + CALL_TIMEOUT_MS);
  const unary = (method) => (request) =>
    new Promise((resolve, reject) => {
      raw[method](request, metadata(), { deadline: deadline() }, (err, response) =>
        err ? reject(err) : resolve(response),
      );
    });
  return {
    RegisterTool: unary("RegisterTool"),
    GetTool: unary("GetTool"),
    ListTools: unary("ListTools"),
    GetToolSchemas: unary("GetToolSchemas"),
    ExecuteTool: unary("ExecuteTool"),
    ListApprovalRequests: unary("ListApprovalRequests"),
    GetApprovalRequest: unary("GetApprovalRequest"),
    SubmitApproval: unary("SubmitApproval"),
    /** Every event of the stream, in order. */
    StreamExecuteTool: (request) =>
      new Promise((resolve, reject) => {
        const events = [];
        const call = raw.StreamExecuteTool(request, metadata(), { deadline: deadline() });
        call.on("data", (event) => events.push(event));
        call.on("error", reject);
        call.on("end", () => resolve(events));
      }),
  };
}

/** The typed client (toolreg-client) with `token` as its bearer token (none when null). */
export function connectClient(token) {
  const client = ToolregClient.connect({ address: address(), token: token ?? undefined, timeoutMs: CALL_TIMEOUT_MS });
  openClients.push(client);
  return client;
}

export function closeAll() {
  while (openClients.length) openClients.pop().close();
}

/** Await a call that must fail; returns the grpc-js ServiceError. */
export async function rpcError(promise) {
  try {
    await promise;
  } catch (err) {
    assert.ok(typeof err.code === "number", `not a gRPC error: ${err}`);
    return err;
  }
  assert.fail("the call succeeded, an error was expected");
}

/** The google.rpc.Status from the `grpc-status-details-bin` trailer, or null. */
export function statusDetails(err) {
  const [bin] = err.metadata?.get("grpc-status-details-bin") ?? [];
  return bin ? StatusType.toObject(StatusType.decode(bin), { defaults: true }) : null;
}

/** field path -> rule, from every BadRequest detail of an INVALID_ARGUMENT error. */
export function fieldViolations(err) {
  const status = statusDetails(err);
  assert.ok(status, "INVALID_ARGUMENT must carry google.rpc.Status details");
  assert.equal(status.code, grpc.status.INVALID_ARGUMENT);
  const out = {};
  for (const any of status.details) {
    if (any.type_url !== BAD_REQUEST_URL) continue;
    const bad = BadRequestType.decode(any.value);
    for (const v of bad.field_violations) out[v.field] = v.description;
  }
  return out;
}

/** Await a typed-client call that must fail; returns its RpcError (code by name). */
export async function clientError(promise) {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof RpcError, `not an RpcError: ${err}`);
    return err;
  }
  assert.fail("the call succeeded, an error was expected");
}

/** A name no other test file (or run) uses. */
export const uniqueName = (prefix) => `${prefix}_${randomBytes(4).toString("hex")}`;

const b64url = (data) => Buffer.from(data).toString("base64url");
export const sha256Hex = (text) => createHash("sha256").update(text, "utf8").digest("hex");

/**
 * An approval token (JWT, EdDSA) for an approval request (the typed client's
 * view of it), minted here in Node from the approver's Ed25519 private key
 * (PKCS8 PEM): shows the token format is language-neutral.
 */
export function mintApproval(privateKeyPem, issuer, request, ttlS = 300) {
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
    exp: now + ttlS,
    jti: b64url(randomBytes(16)),
    req: request.id,
  };
  const input = `${b64url(JSON.stringify(header))}.${b64url(JSON.stringify(claims))}`;
  const signature = sign(null, Buffer.from(input), createPrivateKey(privateKeyPem));
  return `${input}.${b64url(signature)}`;
}

export { grpc };

// Errors: a tool call's outcome is a CallResult, never an error. A failed
// request throws RpcError (its gRPC code by name, the server's message and
// the google.rpc.BadRequest field violations); waitForApproval throws
// ApprovalWaitError.
import { ConnectError } from "@connectrpc/connect";

import { BadRequestSchema } from "./gen/google/rpc/error_details_pb.js";
import type { ApprovalRequestView } from "./types.js";

/** The canonical gRPC status code names, indexed by code number. */
const CODE_NAMES = [
  "OK",
  "CANCELLED",
  "UNKNOWN",
  "INVALID_ARGUMENT",
  "DEADLINE_EXCEEDED",
  "NOT_FOUND",
  "ALREADY_EXISTS",
  "PERMISSION_DENIED",
  "RESOURCE_EXHAUSTED",
  "FAILED_PRECONDITION",
  "ABORTED",
  "OUT_OF_RANGE",
  "UNIMPLEMENTED",
  "INTERNAL",
  "UNAVAILABLE",
  "DATA_LOSS",
  "UNAUTHENTICATED",
] as const;

/** A gRPC status code by its canonical name, e.g. "NOT_FOUND". */
export type GrpcCode = (typeof CODE_NAMES)[number];

/** One broken rule of an INVALID_ARGUMENT error: the field path and the rule. */
export interface FieldViolation {
  field: string;
  description: string;
}

/** A request the server (or the connection) refused. */
export class RpcError extends Error {
  override readonly name = "RpcError";
  /** The gRPC status code by name. */
  readonly code: GrpcCode;
  /** The server's message, without the code. */
  readonly grpcMessage: string;
  /** From the `google.rpc.BadRequest` details of INVALID_ARGUMENT errors; else empty. */
  readonly fieldViolations: readonly FieldViolation[];

  constructor(code: GrpcCode, grpcMessage: string, fieldViolations: FieldViolation[] = [], cause?: unknown) {
    super(`${code}: ${grpcMessage}`, cause === undefined ? undefined : { cause });
    this.code = code;
    this.grpcMessage = grpcMessage;
    this.fieldViolations = Object.freeze([...fieldViolations]);
  }

  /** One readable line, plus one line per field violation. */
  describe(): string {
    return [this.message, ...this.fieldViolations.map((v) => `  - ${v.field}: ${v.description}`)].join("\n");
  }
}

// Node's codes for a TLS handshake or certificate check that failed (OpenSSL's
// verify errors, ERR_TLS_*, ERR_SSL_*).
const TLS_FAILURE = /^(ERR_TLS_|ERR_SSL_)|CERT|^UNABLE_TO_|SELF_SIGNED|^HOSTNAME_MISMATCH$/;

function tlsFailure(err: unknown): boolean {
  for (let reason = err, depth = 0; reason instanceof Error && depth < 8; depth++) {
    const code = (reason as { code?: unknown }).code;
    if (typeof code === "string" && TLS_FAILURE.test(code)) return true;
    reason = reason.cause;
  }
  return false;
}

/** Any error of a call (transport, status, abort) as an RpcError. */
export function toRpcError(err: unknown): RpcError {
  if (err instanceof RpcError) return err;
  const ce = ConnectError.from(err);
  // A connection that failed its TLS checks is UNAVAILABLE, as gRPC's own
  // clients report it (Connect says INTERNAL): the request never reached a server.
  const code = tlsFailure(ce) ? "UNAVAILABLE" : (CODE_NAMES[ce.code] ?? "UNKNOWN");
  const violations = ce
    .findDetails(BadRequestSchema)
    .flatMap((bad) => bad.fieldViolations.map((v) => ({ field: v.field, description: v.description })));
  return new RpcError(code, ce.rawMessage, violations, err);
}

/** Why waitForApproval gave up. */
export type ApprovalWaitReason = "REJECTED" | "VOIDED" | "EXPIRED" | "CONSUMED" | "TIMEOUT";

/**
 * waitForApproval gave up: an approver rejected the request (the message
 * names who and gives their reason, as do `request.rejectedBy` and
 * `request.rejectionReason`), it was voided (its tool deleted or disabled:
 * `request.voidedReason`), it expired, was already used, or the wait timed
 * out. `request` is the last state seen (null if the wait timed out before
 * the first answer).
 */
export class ApprovalWaitError extends Error {
  override readonly name = "ApprovalWaitError";
  readonly reason: ApprovalWaitReason;
  readonly request: ApprovalRequestView | null;

  constructor(message: string, reason: ApprovalWaitReason, request: ApprovalRequestView | null) {
    super(message);
    this.reason = reason;
    this.request = request;
  }
}

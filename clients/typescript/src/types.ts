// The domain types of the client: what its methods take and return. They
// mirror the Python client (registry_server/client/registry_client.py) with
// TypeScript names; protobuf messages stay inside the client.

/** A tool's safety level, as the Python client and the manifests spell it. */
export type SafetyLevel = "safe" | "cautious" | "dangerous";

/** The LLM tool formats GetToolSchemas exports. */
export type SchemaFormat = "openai" | "anthropic" | "mcp";

/**
 * The outcome of a tool call, by name (the Python client's `Status` values;
 * on the wire `EXECUTION_STATUS_<name>`).
 */
export type Status =
  | "OK"
  | "TOOL_NOT_FOUND"
  | "INVALID_ARGUMENTS"
  | "APPROVAL_REQUIRED"
  | "APPROVAL_DENIED"
  | "TOOL_ERROR"
  | "TIMEOUT"
  | "RESOURCE_EXHAUSTED"
  | "SANDBOX_ERROR"
  /** An admin disabled the tool (`error` gives the reason). */
  | "TOOL_DISABLED"
  /** A deny rule of the policy refused the call (`error` names the rule and its reason). */
  | "POLICY_DENIED"
  /** CancelExecution stopped the call (`error` says who and why). */
  | "CANCELLED";

/** The states of an approval request (REJECTED, VOIDED, CONSUMED and EXPIRED are final). */
export type ApprovalState = "PENDING" | "APPROVED" | "CONSUMED" | "REJECTED" | "VOIDED" | "EXPIRED";

/**
 * What an `ApprovalEvent` says happened (on the wire
 * `APPROVAL_EVENT_TYPE_<name>`): CURRENT (open when the watch began), SYNCED
 * (every CURRENT event has been sent), then the changes.
 */
export type ApprovalEventType =
  | "CURRENT"
  | "SYNCED"
  | "OPENED"
  | "APPROVAL_ADDED"
  | "APPROVED"
  | "REJECTED"
  | "CONSUMED"
  | "EXPIRED"
  /** Its tool was deleted or disabled (`reason` says which, and why). */
  | "VOIDED";

/** A JSON value as `JSON.parse` returns it. */
export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/** One page of a listing (AIP-158) and the token of the next: "" on the last page. */
export interface Page<T> {
  items: T[];
  nextPageToken: string;
}

/** 0 = the profile default for the tool's level; never above the policy ceiling. */
export interface ResourceLimits {
  memoryMb: number;
  cpuMillis: number;
  pids: number;
  timeoutMs: number;
  outputBytes: number;
}

export interface SecretInjection {
  host: string;
  port: number;
  header: string;
  format: string;
}

/** A server-held secret a tool uses, by name (never its value). */
export interface SecretRef {
  name: string;
  /** "header" (egress proxy adds it) or "file" (mounted at /run/secrets/NAME). */
  deliver: string;
  inject: SecretInjection | null;
}

export interface ToolSandbox {
  image: string;
  command: string[];
  env: Record<string, string>;
  limits: ResourceLimits;
}

/**
 * A condition a tool's calls must meet (CEL over `args`, checked after the
 * JSON Schema): when it is false the call is refused with INVALID_ARGUMENTS
 * and `message`.
 */
export interface ToolGuard {
  /** A CEL expression over `args`, e.g. `args.path.startsWith("/work/")`. */
  condition: string;
  /** What the caller is told when it is false. */
  message: string;
}

/** A stored tool definition, as the server returns it. */
export interface ToolDefinition {
  name: string;
  description: string;
  /** The JSON Schema of the arguments, parsed. */
  parameters: { [key: string]: JsonValue };
  /** The schema as the server holds it (the author's key order kept). */
  parametersJson: string;
  safetyLevel: SafetyLevel;
  categories: string[];
  sandbox: ToolSandbox;
  warmPool: number;
  /** "host:port" entries the tool may reach through the egress proxy. */
  egress: string[];
  secrets: SecretRef[];
  /** sha256 hex of the RFC 8785 canonical JSON of the definition. */
  digest: string;
  /** The client that registered it, or "[operator]". */
  owner: string;
  /** An admin disabled it (the kill switch): listed, but every call is refused with TOOL_DISABLED. */
  disabled: boolean;
  /** Why it was disabled ("" when it is not). */
  disabledReason: string;
  /** Conditions every call must meet, in the author's order (the first that fails is reported). */
  guards: ToolGuard[];
}

/** A definition to register. Omitted fields take the server's defaults. */
export interface ToolInput {
  name: string;
  description: string;
  /**
   * A JSON Schema object, or its JSON text (sent as-is, so the key order
   * and the digest are exactly the author's).
   */
  parameters: { [key: string]: unknown } | string;
  /** Default "safe". */
  safetyLevel?: SafetyLevel;
  categories?: string[];
  sandbox: {
    image: string;
    command: string[];
    env?: Record<string, string>;
    limits?: Partial<ResourceLimits>;
  };
  warmPool?: number;
  egress?: string[];
  secrets?: Array<{ name: string; deliver?: string; inject?: Partial<SecretInjection> }>;
  /** Conditions every call must meet (type-checked by the server at registration). */
  guards?: ToolGuard[];
}

/**
 * One approval rule of the policy that applies to a request's call, and why:
 * every rule that matches the tool and whose condition holds applies at once.
 */
export interface AppliedRule {
  /** The policy's name for the rule, "rule N" (its place, from 1) when it has none, or "default". */
  name: string;
  /** What it matches: "tool deploy", "category prod", "level dangerous", or "default for dangerous tools". */
  match: string;
  /** Its `when` (CEL), "" when it has none. */
  condition: string;
  approvalsRequired: number;
  /** The approver groups that count; empty: any approver. */
  groups: string[];
}

/** An approval request for a dangerous call (the domain form of ApprovalRequest). */
export interface ApprovalRequestView {
  id: string;
  toolName: string;
  toolDigest: string;
  /** The canonical arguments; empty in listings (read one with getApprovalRequest). */
  argumentsJson: string;
  argumentsDigest: string;
  requestedBy: string;
  approvalsRequired: number;
  approvedBy: string[];
  state: ApprovalState;
  createdAt: Date;
  expiresAt: Date;
  /** What an approver's token must carry as `aud`. */
  audience: string;
  /** The longest token lifetime (exp - iat) the policy accepts, in seconds. */
  maxTokenTtlS: number;
  /** Distinct approvers still needed. */
  approvalsMissing: number;
  /** The definition approvers sign; null in listings (its schema is left out). */
  tool: ToolDefinition | null;
  /** Set when `state` is REJECTED: the approver who rejected it, and why. */
  rejectedBy: string;
  rejectionReason: string;
  /** Set when `state` is VOIDED: why (its tool was deleted or disabled). */
  voidedReason: string;
  /**
   * The approval rules that apply to this call, and why (recomputed from its
   * arguments, requester and creation time); empty when the server does not
   * say (an older one, or the request's tool is gone).
   */
  appliedRules: AppliedRule[];
}

/** One item of `watchApprovalRequests` (the domain form of ApprovalEvent). */
export interface ApprovalEvent {
  type: ApprovalEventType;
  /**
   * The request as it is after this event, in its listed form (no
   * `argumentsJson`, `tool` null: read it whole with getApprovalRequest);
   * null for SYNCED.
   */
  request: ApprovalRequestView | null;
  /** The approver who added an approval (APPROVAL_ADDED) or rejected (REJECTED); else empty. */
  actor: string;
  /** REJECTED: the approver's reason; VOIDED: why; else empty. */
  reason: string;
  /** When it happened; null for CURRENT and SYNCED. */
  at: Date | null;
  /** The event's place in the store's order (0 for CURRENT and SYNCED). */
  seq: number;
}

/** The outcome of one tool call (the domain form of ToolResult). */
export interface CallResult {
  success: boolean;
  status: Status;
  /** stdout as text, for the model. */
  content: string;
  /**
   * stdout parsed as JSON when it is a JSON value (so `null` when the tool
   * printed `null`); undefined when it is not JSON.
   */
  data: JsonValue | undefined;
  /** An LLM-readable reason when not success. */
  error: string;
  exitCode: number;
  stderr: string;
  durationMs: number;
  outputTruncated: boolean;
  /** The audit record of this call. */
  executionId: string;
  /** Set with APPROVAL_REQUIRED. */
  approvalRequest: ApprovalRequestView | null;
  /** status === "APPROVAL_REQUIRED". */
  needsApproval: boolean;
}

/** One event of `streamTool`: a chunk of stdout or stderr, or (last) the result. */
export type StreamEvent =
  | { kind: "stdout"; stdout: Uint8Array }
  | { kind: "stderr"; stderr: Uint8Array }
  | { kind: "result"; result: CallResult };

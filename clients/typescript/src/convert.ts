// The one place where protobuf messages become domain objects and back.
import { create } from "@bufbuild/protobuf";
import { timestampDate, type Timestamp } from "@bufbuild/protobuf/wkt";

import {
  ApprovalEventType as PbApprovalEventType,
  ExecutionStatus,
  SafetyLevel as PbSafetyLevel,
  SchemaFormat as PbSchemaFormat,
  ToolSchema,
  type ApprovalEvent as PbApprovalEvent,
  type ApprovalRequest,
  type Tool,
  type ToolResult,
} from "./gen/toolregistry/v1/registry_pb.js";
import type {
  ApprovalEvent,
  ApprovalEventType,
  ApprovalRequestView,
  ApprovalState,
  CallResult,
  JsonValue,
  SafetyLevel,
  SchemaFormat,
  Status,
  ToolDefinition,
  ToolInput,
} from "./types.js";

const LEVEL_TO_PB: Record<SafetyLevel, PbSafetyLevel> = {
  safe: PbSafetyLevel.SAFE,
  cautious: PbSafetyLevel.CAUTIOUS,
  dangerous: PbSafetyLevel.DANGEROUS,
};

const FORMAT_TO_PB: Record<SchemaFormat, PbSchemaFormat> = {
  openai: PbSchemaFormat.OPENAI,
  anthropic: PbSchemaFormat.ANTHROPIC,
  mcp: PbSchemaFormat.MCP,
};

const STATUS_FROM_PB: Partial<Record<ExecutionStatus, Status>> = {
  [ExecutionStatus.OK]: "OK",
  [ExecutionStatus.TOOL_NOT_FOUND]: "TOOL_NOT_FOUND",
  [ExecutionStatus.INVALID_ARGUMENTS]: "INVALID_ARGUMENTS",
  [ExecutionStatus.APPROVAL_REQUIRED]: "APPROVAL_REQUIRED",
  [ExecutionStatus.APPROVAL_DENIED]: "APPROVAL_DENIED",
  [ExecutionStatus.TOOL_ERROR]: "TOOL_ERROR",
  [ExecutionStatus.TIMEOUT]: "TIMEOUT",
  [ExecutionStatus.RESOURCE_EXHAUSTED]: "RESOURCE_EXHAUSTED",
  [ExecutionStatus.SANDBOX_ERROR]: "SANDBOX_ERROR",
  [ExecutionStatus.TOOL_DISABLED]: "TOOL_DISABLED",
  [ExecutionStatus.POLICY_DENIED]: "POLICY_DENIED",
  [ExecutionStatus.CANCELLED]: "CANCELLED",
};

const EVENT_TYPE_FROM_PB: Partial<Record<PbApprovalEventType, ApprovalEventType>> = {
  [PbApprovalEventType.CURRENT]: "CURRENT",
  [PbApprovalEventType.SYNCED]: "SYNCED",
  [PbApprovalEventType.OPENED]: "OPENED",
  [PbApprovalEventType.APPROVAL_ADDED]: "APPROVAL_ADDED",
  [PbApprovalEventType.APPROVED]: "APPROVED",
  [PbApprovalEventType.REJECTED]: "REJECTED",
  [PbApprovalEventType.CONSUMED]: "CONSUMED",
  [PbApprovalEventType.EXPIRED]: "EXPIRED",
  [PbApprovalEventType.VOIDED]: "VOIDED",
};

export function levelToPb(level: SafetyLevel | undefined): PbSafetyLevel {
  if (level === undefined) return PbSafetyLevel.UNSPECIFIED; // no limit / the server's default
  const value = LEVEL_TO_PB[level];
  if (value === undefined) throw new TypeError(`unknown safety level ${JSON.stringify(level)}`);
  return value;
}

export function levelFromPb(value: PbSafetyLevel): SafetyLevel {
  switch (value) {
    case PbSafetyLevel.CAUTIOUS:
      return "cautious";
    case PbSafetyLevel.DANGEROUS:
      return "dangerous";
    default:
      return "safe"; // UNSPECIFIED means SAFE
  }
}

export function formatToPb(format: SchemaFormat | undefined): PbSchemaFormat {
  if (format === undefined) return PbSchemaFormat.OPENAI;
  const value = FORMAT_TO_PB[format];
  if (value === undefined) throw new TypeError(`unknown schema format ${JSON.stringify(format)}`);
  return value;
}

/** An unknown status (a newer server's) is still a failure: SANDBOX_ERROR, as in Python. */
export function statusFromPb(value: ExecutionStatus): Status {
  return STATUS_FROM_PB[value] ?? "SANDBOX_ERROR";
}

/** A ToolResult's data_json parsed; undefined when it is empty or not JSON. */
export function dataFromPb(dataJson: string): JsonValue | undefined {
  if (!dataJson) return undefined;
  try {
    return JSON.parse(dataJson) as JsonValue;
  } catch {
    return undefined;
  }
}

/** Arguments as JSON text: a string is sent as-is (the model's own JSON, judged by the server). */
export function argumentsText(args: { [key: string]: unknown } | string): string {
  return typeof args === "string" ? args : JSON.stringify(args);
}

function int64(value: number | undefined, field: string): bigint {
  if (value === undefined) return 0n;
  if (!Number.isSafeInteger(value)) throw new TypeError(`${field} must be an integer, got ${value}`);
  return BigInt(value);
}

export function toolToPb(tool: ToolInput): Tool {
  const limits = tool.sandbox.limits ?? {};
  return create(ToolSchema, {
    name: tool.name,
    description: tool.description,
    parametersJson: argumentsText(tool.parameters),
    safetyLevel: levelToPb(tool.safetyLevel),
    categories: tool.categories ?? [],
    sandbox: {
      image: tool.sandbox.image,
      command: tool.sandbox.command,
      env: tool.sandbox.env ?? {},
      limits: {
        memoryMb: int64(limits.memoryMb, "sandbox.limits.memoryMb"),
        cpuMillis: int64(limits.cpuMillis, "sandbox.limits.cpuMillis"),
        pids: int64(limits.pids, "sandbox.limits.pids"),
        timeoutMs: int64(limits.timeoutMs, "sandbox.limits.timeoutMs"),
        outputBytes: int64(limits.outputBytes, "sandbox.limits.outputBytes"),
      },
    },
    warmPool: tool.warmPool ?? 0,
    network: { egress: tool.egress ?? [] },
    secrets: (tool.secrets ?? []).map((ref) => ({
      name: ref.name,
      deliver: ref.deliver ?? "",
      ...(ref.inject ? { inject: { ...ref.inject } } : {}),
    })),
    guards: (tool.guards ?? []).map((guard) => ({ condition: guard.condition, message: guard.message })),
  });
}

/** The domain form of a Tool the server sent. Throws when its schema is not a JSON object. */
export function toolFromPb(msg: Tool): ToolDefinition {
  const parameters: unknown = JSON.parse(msg.parametersJson);
  if (parameters === null || typeof parameters !== "object" || Array.isArray(parameters)) {
    throw new TypeError(`tool ${msg.name}: parameters_json is not a JSON object`);
  }
  const limits = msg.sandbox?.limits;
  return {
    name: msg.name,
    description: msg.description,
    parameters: parameters as { [key: string]: JsonValue },
    parametersJson: msg.parametersJson,
    safetyLevel: levelFromPb(msg.safetyLevel),
    categories: [...msg.categories],
    sandbox: {
      image: msg.sandbox?.image ?? "",
      command: [...(msg.sandbox?.command ?? [])],
      env: { ...(msg.sandbox?.env ?? {}) },
      limits: {
        memoryMb: Number(limits?.memoryMb ?? 0n),
        cpuMillis: Number(limits?.cpuMillis ?? 0n),
        pids: Number(limits?.pids ?? 0n),
        timeoutMs: Number(limits?.timeoutMs ?? 0n),
        outputBytes: Number(limits?.outputBytes ?? 0n),
      },
    },
    warmPool: msg.warmPool,
    egress: [...(msg.network?.egress ?? [])],
    secrets: msg.secrets.map((ref) => ({
      name: ref.name,
      deliver: ref.deliver,
      inject: ref.inject
        ? {
            host: ref.inject.host,
            port: ref.inject.port,
            header: ref.inject.header,
            format: ref.inject.format,
          }
        : null,
    })),
    digest: msg.digest,
    owner: msg.owner,
    disabled: msg.disabled,
    disabledReason: msg.disabledReason,
    guards: msg.guards.map((guard) => ({ condition: guard.condition, message: guard.message })),
  };
}

function date(ts: Timestamp | undefined): Date {
  return ts ? timestampDate(ts) : new Date(0);
}

/** The request's definition when it came in full (a listing leaves its schema out). */
function shownTool(msg: ApprovalRequest): ToolDefinition | null {
  if (!msg.tool || !msg.tool.parametersJson) return null;
  try {
    return toolFromPb(msg.tool);
  } catch {
    return null;
  }
}

export function approvalFromPb(msg: ApprovalRequest): ApprovalRequestView {
  return {
    id: msg.id,
    toolName: msg.toolName,
    toolDigest: msg.toolDigest,
    argumentsJson: msg.argumentsJson,
    argumentsDigest: msg.argumentsDigest,
    requestedBy: msg.requestedBy,
    approvalsRequired: msg.approvalsRequired,
    approvedBy: [...msg.approvedBy],
    state: msg.state as ApprovalState,
    createdAt: date(msg.createdAt),
    expiresAt: date(msg.expiresAt),
    audience: msg.audience,
    maxTokenTtlS: msg.maxTokenTtlS,
    approvalsMissing: msg.approvalsMissing,
    tool: shownTool(msg),
    rejectedBy: msg.rejectedBy,
    rejectionReason: msg.rejectionReason,
    voidedReason: msg.voidedReason,
    appliedRules: msg.appliedRules.map((rule) => ({
      name: rule.name,
      match: rule.match,
      condition: rule.condition,
      approvalsRequired: rule.approvalsRequired,
      groups: [...rule.groups],
    })),
  };
}

/** The domain form of an ApprovalEvent; null for an event type this client
 * does not know (a newer server's): not ours to interpret. */
export function approvalEventFromPb(msg: PbApprovalEvent): ApprovalEvent | null {
  const type = EVENT_TYPE_FROM_PB[msg.type];
  if (type === undefined) return null;
  return {
    type,
    request: msg.request ? approvalFromPb(msg.request) : null,
    actor: msg.actor,
    reason: msg.reason,
    at: msg.at ? timestampDate(msg.at) : null,
    seq: Number(msg.seq),
  };
}

export function resultFromPb(msg: ToolResult): CallResult {
  const status = statusFromPb(msg.status);
  return {
    success: msg.success,
    status,
    content: msg.content,
    data: dataFromPb(msg.dataJson),
    error: msg.error,
    exitCode: msg.exitCode,
    stderr: msg.stderr,
    durationMs: Number(msg.durationMs),
    outputTruncated: msg.outputTruncated,
    executionId: msg.executionId,
    approvalRequest: msg.approvalRequest ? approvalFromPb(msg.approvalRequest) : null,
    needsApproval: status === "APPROVAL_REQUIRED",
  };
}

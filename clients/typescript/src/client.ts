// ToolregClient: one method per RPC, taking and returning domain objects.
import type { MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client } from "@connectrpc/connect";

import {
  approvalFromPb,
  argumentsText,
  formatToPb,
  levelToPb,
  resultFromPb,
  toolFromPb,
  toolToPb,
} from "./convert.js";
import { ApprovalWaitError, toRpcError } from "./errors.js";
import { ExecuteToolRequestSchema, ToolRegistry } from "./gen/toolregistry/v1/registry_pb.js";
import { openConnection, type Connection, type ConnectionOptions } from "./transport.js";
import type {
  ApprovalRequestView,
  ApprovalState,
  CallResult,
  JsonValue,
  SafetyLevel,
  SchemaFormat,
  StreamEvent,
  ToolDefinition,
  ToolInput,
} from "./types.js";

export const DEFAULT_TIMEOUT_MS = 30_000; // milliseconds for registry calls; executions get their own
export const DEFAULT_POLL_MS = 1_000; // milliseconds between GetApprovalRequest polls while waiting

export interface ClientOptions extends ConnectionOptions {
  /** Deadline of every registry call (not executions), in milliseconds. Default 30 s. */
  timeoutMs?: number;
}

/** Per-call options of the registry methods. */
export interface CallOptions {
  /** Overrides the client's deadline for this call, in milliseconds. */
  timeoutMs?: number;
  /** Cancels the call (it then throws RpcError CANCELLED). */
  signal?: AbortSignal;
}

export interface ExecuteOptions {
  /** Signed approval tokens (JWT, EdDSA) for a dangerous tool. */
  approvalTokens?: string[];
  /** An approval request whose submitted tokens approve this call. */
  approvalRequestId?: string;
  /** Deadline of the RPC in milliseconds; default none (the tool's own limit applies). */
  timeoutMs?: number;
  /** Cancels the call; the server stops the container. */
  signal?: AbortSignal;
}

export interface ToolFilter {
  /** Tools at or below this level (default: no limit). */
  maxLevel?: SafetyLevel;
  /** Tools having at least one of these categories (default: all). */
  categories?: string[];
}

export interface WaitOptions {
  /** Give up after this many milliseconds (ApprovalWaitError, reason TIMEOUT). */
  timeoutMs: number;
  /** Milliseconds between polls; default 1000. */
  pollMs?: number;
  /** Stops waiting: rejects with the signal's reason. */
  signal?: AbortSignal;
}

type Arguments = { [key: string]: unknown } | string;

/** A client of a toolreg server. Create it with `ToolregClient.connect`; `close()` when done. */
export class ToolregClient {
  /** The address this client talks to. */
  readonly address: string;
  /** The generated Connect client, for message-level calls. */
  readonly stub: Client<typeof ToolRegistry>;
  readonly #connection: Connection;
  readonly #timeoutMs: number;

  private constructor(connection: Connection, timeoutMs: number) {
    this.#connection = connection;
    this.#timeoutMs = timeoutMs;
    this.address = connection.address;
    this.stub = createClient(ToolRegistry, connection.transport);
  }

  /**
   * A client for `address` (default: $TOOLREG_ADDRESS or 127.0.0.1:50051).
   * `token` is sent as `authorization: Bearer`. `tls: true` uses TLS verified
   * against the system's CAs; `tls: {ca, cert, key}` gives PEMs (text, bytes
   * or file paths; cert + key = mutual TLS). The connection opens on the
   * first call.
   */
  static connect(options: ClientOptions = {}): ToolregClient {
    return new ToolregClient(openConnection(options), options.timeoutMs ?? DEFAULT_TIMEOUT_MS);
  }

  /** Ends the connection; calls still running fail. */
  close(): void {
    this.#connection.close();
  }

  #opts(options: CallOptions | undefined): { timeoutMs: number; signal?: AbortSignal } {
    return { timeoutMs: whole(options?.timeoutMs ?? this.#timeoutMs), signal: options?.signal };
  }

  /** RegisterTool; returns the stored definition (with its digest and owner).
   * Throws RpcError: INVALID_ARGUMENT (fieldViolations name each rule), ALREADY_EXISTS, PERMISSION_DENIED. */
  async registerTool(
    tool: ToolInput,
    options: CallOptions & { replace?: boolean } = {},
  ): Promise<ToolDefinition> {
    const request = { tool: toolToPb(tool), replace: options.replace ?? false };
    return toolFromPb(await this.#call(() => this.stub.registerTool(request, this.#opts(options))));
  }

  /** GetTool. Throws RpcError NOT_FOUND for an unknown name. */
  async getTool(name: string, options?: CallOptions): Promise<ToolDefinition> {
    return toolFromPb(await this.#call(() => this.stub.getTool({ name }, this.#opts(options))));
  }

  /** ListTools, sorted by name; the filters are ANDed. */
  async listTools(filter: ToolFilter & CallOptions = {}): Promise<ToolDefinition[]> {
    const request = { maxSafetyLevel: levelToPb(filter.maxLevel), categories: filter.categories ?? [] };
    const response = await this.#call(() => this.stub.listTools(request, this.#opts(filter)));
    return response.tools.map(toolFromPb);
  }

  /** GetToolSchemas, parsed: the list to hand to a model as its tools (default format openai). */
  async toolSchemas(
    options: ToolFilter & CallOptions & { format?: SchemaFormat } = {},
  ): Promise<Array<{ [key: string]: JsonValue }>> {
    const request = {
      format: formatToPb(options.format),
      maxSafetyLevel: levelToPb(options.maxLevel),
      categories: options.categories ?? [],
    };
    const response = await this.#call(() => this.stub.getToolSchemas(request, this.#opts(options)));
    const parsed: unknown = JSON.parse(response.schemasJson);
    if (!Array.isArray(parsed)) throw new TypeError("GetToolSchemas did not return a JSON array");
    return parsed as Array<{ [key: string]: JsonValue }>;
  }

  /**
   * ExecuteTool. Every outcome of the call (unknown tool, invalid arguments,
   * approval required, tool error, timeout, ...) is a CallResult; only a
   * failed request (UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...) throws RpcError.
   * `args` is an object, or JSON text sent as-is (e.g. the model's own).
   */
  async executeTool(name: string, args: Arguments = {}, options: ExecuteOptions = {}): Promise<CallResult> {
    const request = executeRequest(name, args, options);
    const call = { timeoutMs: whole(options.timeoutMs), signal: options.signal };
    return resultFromPb(await this.#call(() => this.stub.executeTool(request, call)));
  }

  /**
   * StreamExecuteTool: stdout/stderr chunks as the tool writes them, then one
   * event with the result. Leaving the loop early cancels the call.
   */
  async *streamTool(name: string, args: Arguments = {}, options: ExecuteOptions = {}): AsyncGenerator<StreamEvent> {
    const request = executeRequest(name, args, options);
    // Our own signal: leaving the loop early must cancel the RPC (Connect's
    // iterator does not), so the server stops the container.
    const cancel = new AbortController();
    const onAbort = () => cancel.abort(options.signal?.reason);
    if (options.signal?.aborted) onAbort();
    options.signal?.addEventListener("abort", onAbort, { once: true });
    let finished = false;
    const call = { timeoutMs: whole(options.timeoutMs), signal: cancel.signal };
    try {
      for await (const msg of this.stub.streamExecuteTool(request, call)) {
        const event = msg.event;
        switch (event.case) {
          case "stdout":
            yield { kind: "stdout", stdout: event.value };
            break;
          case "stderr":
            yield { kind: "stderr", stderr: event.value };
            break;
          case "result":
            yield { kind: "result", result: resultFromPb(event.value) };
            break;
          default:
            break; // an event kind a newer server added: not ours to interpret
        }
      }
      finished = true;
    } catch (err) {
      throw toRpcError(err);
    } finally {
      options.signal?.removeEventListener("abort", onAbort);
      if (!finished) cancel.abort(new Error("the caller stopped reading the stream"));
    }
  }

  /** ListApprovalRequests, newest first (state: PENDING, APPROVED, CONSUMED, EXPIRED; default all). */
  async listApprovalRequests(
    options: CallOptions & { state?: ApprovalState; limit?: number } = {},
  ): Promise<ApprovalRequestView[]> {
    const request = { state: options.state ?? "", limit: options.limit ?? 0 };
    const response = await this.#call(() => this.stub.listApprovalRequests(request, this.#opts(options)));
    return response.requests.map(approvalFromPb);
  }

  /** GetApprovalRequest, with the full arguments. Throws RpcError NOT_FOUND for an unknown id. */
  async getApprovalRequest(id: string, options?: CallOptions): Promise<ApprovalRequestView> {
    return approvalFromPb(await this.#call(() => this.stub.getApprovalRequest({ id }, this.#opts(options))));
  }

  /** SubmitApproval: attaches one signed token; returns the updated request.
   * A token that does not approve this request throws RpcError PERMISSION_DENIED (the message says why). */
  async submitApproval(requestId: string, token: string, options?: CallOptions): Promise<ApprovalRequestView> {
    const request = { requestId, token };
    return approvalFromPb(await this.#call(() => this.stub.submitApproval(request, this.#opts(options))));
  }

  /**
   * Polls GetApprovalRequest until the request is APPROVED and returns it.
   * Throws ApprovalWaitError when it is EXPIRED or CONSUMED, or after
   * `timeoutMs`; RpcError when a poll itself fails; the signal's reason when
   * aborted.
   */
  async waitForApproval(id: string, options: WaitOptions): Promise<ApprovalRequestView> {
    const { timeoutMs, pollMs = DEFAULT_POLL_MS, signal } = options;
    const deadline = performance.now() + timeoutMs;
    for (;;) {
      signal?.throwIfAborted();
      const remaining = deadline - performance.now();
      const last = await this.getApprovalRequest(id, {
        signal,
        timeoutMs: Math.min(this.#timeoutMs, Math.max(remaining, pollMs)),
      }).catch((err: unknown) => {
        signal?.throwIfAborted(); // an abort during the poll is the caller's, not a failed poll
        throw err;
      });
      if (last.state === "APPROVED") return last;
      if (last.state === "EXPIRED" || last.state === "CONSUMED") {
        throw new ApprovalWaitError(`approval request ${id} is ${last.state.toLowerCase()}`, last.state, last);
      }
      const left = deadline - performance.now();
      if (left <= 0) {
        throw new ApprovalWaitError(
          `approval request ${id} still ${last.state.toLowerCase()} after ${timeoutMs} ms` +
            ` (${last.approvedBy.length} of ${last.approvalsRequired} approvals)`,
          "TIMEOUT",
          last,
        );
      }
      await sleep(Math.min(pollMs, left), signal);
    }
  }

  async #call<T>(fn: () => Promise<T>): Promise<T> {
    try {
      return await fn();
    } catch (err) {
      throw toRpcError(err);
    }
  }
}

function executeRequest(
  name: string,
  args: Arguments,
  options: ExecuteOptions,
): MessageInitShape<typeof ExecuteToolRequestSchema> {
  return {
    name,
    argumentsJson: argumentsText(args),
    approvalTokens: options.approvalTokens ?? [],
    approvalRequestId: options.approvalRequestId ?? "",
  };
}

/** Whole milliseconds: the grpc-timeout header takes integers only. */
function whole(ms: number): number;
function whole(ms: number | undefined): number | undefined;
function whole(ms: number | undefined): number | undefined {
  return ms === undefined ? undefined : Math.max(1, Math.ceil(ms));
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

// ToolregClient: one method per RPC, taking and returning domain objects.
import type { MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client } from "@connectrpc/connect";

import {
  approvalEventFromPb,
  approvalFromPb,
  argumentsText,
  formatToPb,
  levelToPb,
  resultFromPb,
  toolFromPb,
  toolToPb,
} from "./convert.js";
import { ApprovalWaitError, RpcError, toRpcError } from "./errors.js";
import {
  ExecuteToolRequestSchema,
  ToolRegistry,
  type ApprovalEvent as PbApprovalEvent,
} from "./gen/toolregistry/v1/registry_pb.js";
import { brokeInTransit, pauseBefore, REATTACH_HEADERS, REATTACH_TRIES } from "./reattach.js";
import { openConnection, type Connection, type ConnectionOptions } from "./transport.js";
import type {
  ApprovalEvent,
  ApprovalRequestView,
  ApprovalState,
  CallResult,
  JsonValue,
  Page,
  SafetyLevel,
  SchemaFormat,
  StreamEvent,
  ToolDefinition,
  ToolInput,
} from "./types.js";

export const DEFAULT_TIMEOUT_MS = 30_000; // milliseconds for registry calls; executions get their own
export const DEFAULT_POLL_MS = 1_000; // milliseconds between polls, against a server that cannot watch
// A watch that ended less than QUICK_END_MS after it began is watched again only
// after REWATCH_PAUSE_MS: a server ending every watch at once is not hammered.
const QUICK_END_MS = 1_000;
const REWATCH_PAUSE_MS = 250;

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
  /**
   * Cancels the call. The server stops the container at once for executeTool,
   * and for streamTool with `reattach: false`; with re-attachment on it runs
   * to its own end.
   */
  signal?: AbortSignal;
  /**
   * streamTool only: re-attach when the stream breaks in transit mid-call
   * (AttachExecution); default true.
   */
  reattach?: boolean;
}

type StreamCall = { timeoutMs?: number; signal: AbortSignal };

export interface ToolFilter {
  /** Tools at or below this level (default: no limit). */
  maxLevel?: SafetyLevel;
  /** Tools having at least one of these categories (default: all). */
  categories?: string[];
}

/** Which page of a listing (AIP-158). */
export interface PageOptions {
  /** Items per page; 0 or absent = the server's default (100 tools, 50 approval requests), above its maximum = the maximum. */
  pageSize?: number;
  /** A previous page's `nextPageToken`, with the same filters; absent = the first page. */
  pageToken?: string;
}

export interface WaitOptions {
  /** Give up after this many milliseconds (ApprovalWaitError, reason TIMEOUT). */
  timeoutMs: number;
  /**
   * Milliseconds between GetApprovalRequest polls; default 1000. Used only
   * against a server that cannot watch (WatchApprovalRequests UNIMPLEMENTED):
   * otherwise the wait follows the watch stream and never polls.
   */
  pollMs?: number;
  /** Stops waiting: rejects with the signal's reason. */
  signal?: AbortSignal;
}

export interface WatchOptions {
  /** Only this request's events (an agent waiting for its own); default: every request the caller may see. */
  requestId?: string;
  /** Ends the watch after this many milliseconds (the loop then throws RpcError DEADLINE_EXCEEDED); default none. */
  timeoutMs?: number;
  /** Ends the watch (the loop then throws RpcError CANCELLED). */
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
   * `token` is sent as `authorization: Bearer`: a string, or a provider
   * asked before every call (`clientCredentials(...)`, or your own function).
   * `tls: true` uses TLS verified against the system's CAs; `tls: {ca, cert,
   * key}` gives PEMs (text, bytes or file paths; cert + key = mutual TLS).
   * The connection opens on the first call.
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

  /**
   * DeleteTool (the tool's owner or an admin): it is no longer listed or run,
   * its warm containers go, its open approval requests are VOIDED with
   * `reason` (at most 1,000 characters, no control characters); a call
   * already running finishes. Throws RpcError: NOT_FOUND, PERMISSION_DENIED,
   * INVALID_ARGUMENT.
   */
  async deleteTool(name: string, options: CallOptions & { reason?: string } = {}): Promise<void> {
    const request = { name, reason: options.reason ?? "" };
    await this.#call(() => this.stub.deleteTool(request, this.#opts(options)));
  }

  /**
   * SetToolEnabled, the kill switch (admins): `enabled: false` disables the
   * tool for `reason` (required: every refused call, TOOL_DISABLED, and every
   * voided approval request says it); `true` makes it callable again.
   * Returns the tool as it is now (`disabled`, `disabledReason`). Throws
   * RpcError: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT.
   */
  async setToolEnabled(
    name: string,
    enabled: boolean,
    options: CallOptions & { reason?: string } = {},
  ): Promise<ToolDefinition> {
    const request = { name, enabled, reason: options.reason ?? "" };
    return toolFromPb(await this.#call(() => this.stub.setToolEnabled(request, this.#opts(options))));
  }

  /** ListTools, every page, sorted by name; the filters are ANDed. `pageSize`: tools asked for per page. */
  async listTools(filter: ToolFilter & CallOptions & { pageSize?: number } = {}): Promise<ToolDefinition[]> {
    return follow((pageToken) => this.listToolsPage({ ...filter, pageToken }));
  }

  /** One page of ListTools, and the token of the next ("" on the last); pass the same filters with it. */
  async listToolsPage(filter: ToolFilter & CallOptions & PageOptions = {}): Promise<Page<ToolDefinition>> {
    const request = {
      maxSafetyLevel: levelToPb(filter.maxLevel),
      categories: filter.categories ?? [],
      pageSize: filter.pageSize ?? 0,
      pageToken: filter.pageToken ?? "",
    };
    const response = await this.#call(() => this.stub.listTools(request, this.#opts(filter)));
    return { items: response.tools.map(toolFromPb), nextPageToken: response.nextPageToken };
  }

  /** GetToolSchemas, parsed, every page: the list to hand to a model as its tools (default format openai). */
  async toolSchemas(
    options: ToolFilter & CallOptions & { format?: SchemaFormat; pageSize?: number } = {},
  ): Promise<Array<{ [key: string]: JsonValue }>> {
    return follow((pageToken) => this.toolSchemasPage({ ...options, pageToken }));
  }

  /** One page of GetToolSchemas, parsed, and the token of the next ("" on the last). */
  async toolSchemasPage(
    options: ToolFilter & CallOptions & PageOptions & { format?: SchemaFormat } = {},
  ): Promise<Page<{ [key: string]: JsonValue }>> {
    const request = {
      format: formatToPb(options.format),
      maxSafetyLevel: levelToPb(options.maxLevel),
      categories: options.categories ?? [],
      pageSize: options.pageSize ?? 0,
      pageToken: options.pageToken ?? "",
    };
    const response = await this.#call(() => this.stub.getToolSchemas(request, this.#opts(options)));
    const parsed: unknown = JSON.parse(response.schemasJson);
    if (!Array.isArray(parsed)) throw new TypeError("GetToolSchemas did not return a JSON array");
    return { items: parsed as Array<{ [key: string]: JsonValue }>, nextPageToken: response.nextPageToken };
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
   * event with the result. A stream that breaks in transit once the call has
   * started is re-attached on its own (AttachExecution, from the bytes already
   * received): every byte comes once, then the result. With re-attachment on
   * (the default) the server lets a started call run on when its stream ends,
   * so leaving the loop early or aborting stops reading, not the tool (it ends
   * at its own timeout); `reattach: false` cancels the call instead.
   */
  async *streamTool(name: string, args: Arguments = {}, options: ExecuteOptions = {}): AsyncGenerator<StreamEvent> {
    const request = executeRequest(name, args, options);
    const reattach = options.reattach ?? true;
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    const headers = reattach ? REATTACH_HEADERS : {};
    let open = (call: StreamCall) => this.stub.streamExecuteTool(request, { ...call, headers });
    let executionId = "";
    const offsets = { stdout: 0n, stderr: 0n };
    let failures = 0;
    for (;;) {
      try {
        const timeoutMs = deadline === undefined ? undefined : Math.max(1, deadline - Date.now());
        for await (const msg of this.#stream(open, { timeoutMs, signal: options.signal })) {
          const event = msg.event;
          switch (event.case) {
            case "started":
              executionId = event.value.executionId;
              break;
            case "stdout":
              offsets.stdout += BigInt(event.value.length);
              failures = 0;
              yield { kind: "stdout", stdout: event.value };
              break;
            case "stderr":
              offsets.stderr += BigInt(event.value.length);
              failures = 0;
              yield { kind: "stderr", stderr: event.value };
              break;
            case "result":
              yield { kind: "result", result: resultFromPb(event.value) };
              return;
            default:
              break; // an event kind a newer server added: not ours to interpret
          }
        }
        return;
      } catch (err) {
        const failed = toRpcError(err);
        const aborted = options.signal?.aborted ?? false;
        if (!reattach || !executionId || !brokeInTransit(failed, aborted) || failures >= REATTACH_TRIES) {
          throw failed;
        }
        failures += 1;
      }
      await sleep(pauseBefore(failures), options.signal);
      const attach = { executionId, stdoutOffset: offsets.stdout, stderrOffset: offsets.stderr };
      open = (call: StreamCall) => this.stub.attachExecution(attach, call);
    }
  }

  /**
   * CancelExecution: stop a call `streamTool` started (its `started` event's
   * execution id): this client's own, or any as an admin. The sandbox is
   * killed and removed; the call's result is CANCELLED, naming who and why
   * (`reason`: at most 1,000 characters, no control characters). Throws
   * RpcError: NOT_FOUND (unknown, or another client's), FAILED_PRECONDITION
   * (already ended), INVALID_ARGUMENT.
   */
  async cancelExecution(executionId: string, options: CallOptions & { reason?: string } = {}): Promise<void> {
    const request = { executionId, reason: options.reason ?? "" };
    await this.#call(() => this.stub.cancelExecution(request, this.#opts(options)));
  }

  /**
   * ListApprovalRequests, newest first (state: PENDING, APPROVED, CONSUMED, REJECTED, VOIDED, EXPIRED; default all),
   * every page: at most `limit` (default all), `pageSize` per page (default `limit`, else the server's).
   */
  async listApprovalRequests(
    options: CallOptions & { state?: ApprovalState; limit?: number; pageSize?: number } = {},
  ): Promise<ApprovalRequestView[]> {
    const pageSize = options.pageSize || options.limit || 0;
    return follow((pageToken) => this.listApprovalRequestsPage({ ...options, pageSize, pageToken }), options.limit);
  }

  /** One page of ListApprovalRequests, and the token of the next ("" on the last); pass the same state with it. */
  async listApprovalRequestsPage(
    options: CallOptions & PageOptions & { state?: ApprovalState } = {},
  ): Promise<Page<ApprovalRequestView>> {
    const request = { state: options.state ?? "", pageSize: options.pageSize ?? 0, pageToken: options.pageToken ?? "" };
    const response = await this.#call(() => this.stub.listApprovalRequests(request, this.#opts(options)));
    return { items: response.requests.map(approvalFromPb), nextPageToken: response.nextPageToken };
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
   * RejectApprovalRequest: refuses the request for good, telling the agent
   * `reason` (1 to 1,000 characters, no control characters; also recorded in
   * the audit log). Returns the REJECTED request. Throws RpcError:
   * PERMISSION_DENIED (not an approver eligible for the tool, or an admin),
   * FAILED_PRECONDITION (already consumed, rejected or expired), NOT_FOUND,
   * INVALID_ARGUMENT (an empty or invalid reason).
   */
  async rejectApprovalRequest(requestId: string, reason: string, options?: CallOptions): Promise<ApprovalRequestView> {
    const request = { requestId, reason };
    return approvalFromPb(await this.#call(() => this.stub.rejectApprovalRequest(request, this.#opts(options))));
  }

  /**
   * WatchApprovalRequests: the open requests the caller may see (PENDING or
   * APPROVED, as CURRENT events; with `requestId`, that request whatever its
   * state), one SYNCED event, then every change as it is stored (OPENED,
   * APPROVAL_ADDED, APPROVED, REJECTED, CONSUMED, EXPIRED, VOIDED). An approver
   * sees what it may approve, an agent its own requests, an admin all. Requests
   * come in their listed form (read one whole with getApprovalRequest).
   *
   * Runs until the server ends it (the loop then ends; watch again), the
   * deadline (`timeoutMs`: RpcError DEADLINE_EXCEEDED) or the signal
   * (RpcError CANCELLED). Leaving the loop early (`break`, `return`, a throw)
   * cancels the stream, so the server closes the watch at once. Throws
   * RpcError: NOT_FOUND (`requestId` names no request the caller may see),
   * RESOURCE_EXHAUSTED (the caller, or the server, has as many watches open
   * as it allows), ABORTED (this reader fell too far behind: watch again).
   */
  async *watchApprovalRequests(options: WatchOptions = {}): AsyncGenerator<ApprovalEvent> {
    for await (const msg of this.#watch(options)) {
      const event = approvalEventFromPb(msg);
      if (event) yield event; // null: an event type a newer server added, not ours to interpret
    }
  }

  /**
   * Waits until the request is APPROVED and returns it (read whole), following
   * WatchApprovalRequests: no polling, the answer comes the moment the last
   * approver signs. Throws ApprovalWaitError when it is REJECTED (the message
   * carries the approver's reason), VOIDED (its tool deleted or disabled, with
   * why), EXPIRED or CONSUMED, or after `timeoutMs` (TIMEOUT); RpcError when
   * the server fails (e.g. NOT_FOUND); the signal's reason when aborted. A watch the server ends (stopping, or ABORTED) is
   * watched again. Only a server that cannot watch (UNIMPLEMENTED) is polled,
   * every `pollMs`.
   */
  async waitForApproval(id: string, options: WaitOptions): Promise<ApprovalRequestView> {
    const { timeoutMs, signal } = options;
    const deadline = performance.now() + timeoutMs;
    for (let left = timeoutMs; left > 0; left = deadline - performance.now()) {
      signal?.throwIfAborted();
      const began = performance.now();
      let seen: ApprovalRequestView | null = null;
      try {
        for await (const msg of this.#watch({ requestId: id, timeoutMs: left, signal })) {
          if (!msg.request) continue; // SYNCED
          const request = approvalFromPb(msg.request);
          if (settled(request)) {
            seen = request;
            break; // ends the watch
          }
        }
      } catch (err) {
        signal?.throwIfAborted(); // an abort is the caller's, not a failed watch
        if (!(err instanceof RpcError)) throw err;
        if (err.code === "UNIMPLEMENTED") return this.#pollForApproval(id, deadline, options);
        if (err.code !== "DEADLINE_EXCEEDED" && err.code !== "ABORTED") throw err;
      }
      if (seen) return this.#approvedOrThrow(id, seen, signal);
      // The watch ended (the server stopping, a reader that fell behind, the
      // deadline): watch again while there is time.
      const lived = performance.now() - began;
      const remaining = deadline - performance.now();
      if (lived < QUICK_END_MS && remaining > 0) await sleep(Math.min(REWATCH_PAUSE_MS, remaining), signal);
    }
    const last = await this.#getForWait(id, signal);
    if (settled(last)) return this.#approvedOrThrow(id, last, signal);
    throw stillWaiting(id, last, timeoutMs);
  }

  #watch(options: WatchOptions): AsyncGenerator<PbApprovalEvent> {
    const request = { requestId: options.requestId ?? "" };
    return this.#stream((call) => this.stub.watchApprovalRequests(request, call), options);
  }

  async #pollForApproval(id: string, deadline: number, options: WaitOptions): Promise<ApprovalRequestView> {
    const { timeoutMs, pollMs = DEFAULT_POLL_MS, signal } = options;
    for (;;) {
      const remaining = deadline - performance.now();
      const last = await this.#getForWait(id, signal, Math.max(remaining, pollMs));
      if (settled(last)) return this.#approvedOrThrow(id, last, signal);
      const left = deadline - performance.now();
      if (left <= 0) throw stillWaiting(id, last, timeoutMs);
      await sleep(Math.min(pollMs, left), signal);
    }
  }

  /** The request whole, once settled: APPROVED is returned, any other state thrown. */
  async #approvedOrThrow(
    id: string,
    seen: ApprovalRequestView,
    signal: AbortSignal | undefined,
  ): Promise<ApprovalRequestView> {
    if (seen.state === "APPROVED") return this.#getForWait(id, signal);
    if (seen.state === "REJECTED") {
      throw new ApprovalWaitError(
        `approval request ${id} was rejected by ${seen.rejectedBy}: ${seen.rejectionReason}`,
        "REJECTED",
        seen,
      );
    }
    if (seen.state === "VOIDED") {
      throw new ApprovalWaitError(`approval request ${id} is voided: ${seen.voidedReason}`, "VOIDED", seen);
    }
    const state = seen.state as "EXPIRED" | "CONSUMED"; // settled() let no other state through
    throw new ApprovalWaitError(`approval request ${id} is ${state.toLowerCase()}`, state, seen);
  }

  async #getForWait(id: string, signal: AbortSignal | undefined, timeoutMs?: number): Promise<ApprovalRequestView> {
    signal?.throwIfAborted();
    const deadline = Math.min(this.#timeoutMs, timeoutMs ?? this.#timeoutMs);
    return this.getApprovalRequest(id, { signal, timeoutMs: deadline }).catch((err: unknown) => {
      signal?.throwIfAborted(); // an abort during the call is the caller's, not a failed call
      throw err;
    });
  }

  /**
   * A server stream as an async generator of its messages. Leaving the loop
   * early cancels the RPC (Connect's own iterator does not), so the server
   * ends its side; `options.signal` cancels it too; errors are RpcErrors.
   */
  async *#stream<T>(
    start: (call: { timeoutMs?: number; signal: AbortSignal }) => AsyncIterable<T>,
    options: { timeoutMs?: number; signal?: AbortSignal },
  ): AsyncGenerator<T> {
    const cancel = new AbortController();
    const onAbort = () => cancel.abort(options.signal?.reason);
    if (options.signal?.aborted) onAbort();
    options.signal?.addEventListener("abort", onAbort, { once: true });
    const messages = start({ timeoutMs: whole(options.timeoutMs), signal: cancel.signal })[Symbol.asyncIterator]();
    let ended = false; // the stream ended or failed: Connect has settled the call
    try {
      for (;;) {
        let next: IteratorResult<T>;
        try {
          next = await messages.next();
        } catch (err) {
          ended = true;
          throw toRpcError(err);
        }
        if (next.done) {
          ended = true;
          return;
        }
        yield next.value;
      }
    } finally {
      options.signal?.removeEventListener("abort", onAbort);
      if (!ended) {
        cancel.abort(new Error("the caller stopped reading the stream"));
        // Connect clears the call's deadline timer only when a read fails or
        // the stream ends: read the cancelled stream out, or the timer would
        // keep the process alive until the deadline.
        try {
          while (!(await messages.next()).done);
        } catch {
          // the cancellation itself
        }
      }
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

/**
 * Every item of a paged listing: `fetch(token)` gives a page ("" = the first).
 * Stops on the empty token, or at `limit` items; a server that answers a
 * token with the same token again is an error, not an endless loop.
 */
async function follow<T>(fetch: (pageToken: string) => Promise<Page<T>>, limit?: number): Promise<T[]> {
  const items: T[] = [];
  const seen = new Set<string>();
  let token = "";
  for (;;) {
    const page = await fetch(token);
    items.push(...page.items);
    if (limit && items.length >= limit) return items.slice(0, limit);
    token = page.nextPageToken;
    if (!token) return items;
    if (seen.has(token)) throw new Error("the server repeated a page token; the listing does not advance");
    seen.add(token);
  }
}

/** Whether waiting is over: approved, or in a state that never changes. */
function settled(request: ApprovalRequestView): boolean {
  return ["APPROVED", "REJECTED", "VOIDED", "EXPIRED", "CONSUMED"].includes(request.state);
}

function stillWaiting(id: string, last: ApprovalRequestView, timeoutMs: number): ApprovalWaitError {
  return new ApprovalWaitError(
    `approval request ${id} still ${last.state.toLowerCase()} after ${timeoutMs} ms` +
      ` (${last.approvedBy.length} of ${last.approvalsRequired} approvals)`,
    "TIMEOUT",
    last,
  );
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

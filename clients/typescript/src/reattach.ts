// Streamed calls that survive a broken stream: when StreamExecuteTool's stream
// breaks in transit after the call started, re-attach (AttachExecution) from
// the bytes already received, a bounded number of times with backoff, so the
// caller gets every byte once and the result. A status the server answered
// (PERMISSION_DENIED, RESOURCE_EXHAUSTED, ...) is thrown as it is.
import type { RpcError } from "./errors.js";

/** StreamExecuteTool request header: keep a started call running when its stream breaks. */
export const REATTACH_HEADERS: Record<string, string> = { "toolreg-reattach": "1" };
/** Re-attachments in a row without any new output before giving up. */
export const REATTACH_TRIES = 5;
const FIRST_PAUSE_MS = 200; // before the first re-attachment; doubled for each next
const MAX_PAUSE_MS = 3_000;

/** Whether the stream was lost on the way rather than ended by the server's answer. */
export function brokeInTransit(err: RpcError, abortedByCaller: boolean): boolean {
  if (abortedByCaller) return false;
  if (err.code === "UNAVAILABLE") return true;
  // A reset HTTP/2 stream or a socket closed under it (Connect reports these
  // as INTERNAL, CANCELLED or UNKNOWN with the transport's own message).
  if (err.code === "INTERNAL" || err.code === "CANCELLED" || err.code === "UNKNOWN") {
    return /stream|socket|ECONNRESET|EPIPE|closed|GOAWAY|RST/i.test(err.grpcMessage);
  }
  return false;
}

/** The pause before re-attachment number `failures` (1, 2, ...), in milliseconds. */
export function pauseBefore(failures: number): number {
  return Math.min(FIRST_PAUSE_MS * 2 ** (failures - 1), MAX_PAUSE_MS);
}

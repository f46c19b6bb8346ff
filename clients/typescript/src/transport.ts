// The connection: real gRPC over HTTP/2 (Connect's gRPC transport on
// node:http2), TLS verified against the given CA (or the system's), an
// optional client certificate for mTLS, and a bearer token as call metadata.
import { readFileSync } from "node:fs";
import type { SecureClientSessionOptions } from "node:http2";

import type { Interceptor, Transport } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

export const ADDRESS_ENV = "TOOLREG_ADDRESS";
export const DEFAULT_ADDRESS = "127.0.0.1:50051";

/** PEM text or bytes, or the path of a PEM file. */
export type PemSource = string | Uint8Array;

export interface TlsOptions {
  /** The CA that signed the server's certificate (default: the system's CAs). */
  ca?: PemSource;
  /** A client certificate, with `key`: mutual TLS. */
  cert?: PemSource;
  key?: PemSource;
  /** The name to check the server's certificate against (default: the address's host). */
  serverName?: string;
}

/**
 * Gives the bearer token to send now; asked before every call, so a token it
 * refreshes is used from the next call on (e.g. `clientCredentials(...)`).
 */
export type TokenProvider = () => string | Promise<string>;

export interface ConnectionOptions {
  /** "host:port" (default: $TOOLREG_ADDRESS, else 127.0.0.1:50051), or an http:// or https:// URL. */
  address?: string;
  /** Sent as `authorization: Bearer <token>` on every call; never logged. A provider is asked per call. */
  token?: string | TokenProvider;
  /** TLS: `true` verifies the server against the system's CAs; an object gives PEMs. */
  tls?: true | TlsOptions;
}

export interface Connection {
  address: string;
  transport: Transport;
  close(): void;
}

export function defaultAddress(): string {
  return process.env[ADDRESS_ENV] || DEFAULT_ADDRESS;
}

export function pem(value: PemSource | undefined, what: string): Buffer | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== "string") return Buffer.from(value);
  if (value.includes("-----BEGIN ")) return Buffer.from(value, "utf8");
  try {
    return readFileSync(value);
  } catch (err) {
    const reason = err instanceof Error ? err.message : String(err);
    throw new Error(`cannot read the ${what} from ${value}: ${reason}`);
  }
}

/** The base URL of the server: https when TLS is asked for. */
function baseUrl(address: string, tls: boolean): string {
  const url = /^[a-z]+:\/\//i.test(address) ? new URL(address) : new URL(`${tls ? "https" : "http"}://${address}`);
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new Error(`unsupported address ${address}: give host:port or an http(s):// URL`);
  }
  if (tls && url.protocol === "http:") {
    throw new Error(`address ${address} is plain http but TLS options were given`);
  }
  if (!url.port) throw new Error(`address ${address} has no port`);
  return url.origin;
}

function bearer(token: string | TokenProvider): Interceptor {
  return (next) => async (req) => {
    const value = typeof token === "string" ? token : await token();
    if (typeof value !== "string" || !value) throw new Error("the token provider gave no token");
    req.header.set("authorization", `Bearer ${value}`);
    return next(req);
  };
}

export function openConnection(options: ConnectionOptions): Connection {
  const address = options.address || defaultAddress();
  const tlsOptions = options.tls === true ? {} : options.tls;
  const url = baseUrl(address, tlsOptions !== undefined);
  const nodeOptions: SecureClientSessionOptions = {};
  if (url.startsWith("https:") && tlsOptions) {
    const cert = pem(tlsOptions.cert, "client certificate");
    const key = pem(tlsOptions.key, "client key");
    if ((cert === undefined) !== (key === undefined)) {
      throw new Error("mutual TLS needs both tls.cert and tls.key");
    }
    const ca = pem(tlsOptions.ca, "TLS CA");
    if (ca) nodeOptions.ca = ca;
    if (cert && key) Object.assign(nodeOptions, { cert, key });
    if (tlsOptions.serverName) nodeOptions.servername = tlsOptions.serverName;
  }
  // Our own session manager, so close() can end the HTTP/2 connection.
  const sessions = new Http2SessionManager(url, {}, nodeOptions);
  const transport = createGrpcTransport({
    baseUrl: url,
    sessionManager: sessions,
    interceptors: options.token ? [bearer(options.token)] : [],
  });
  return {
    address,
    transport,
    close: () => sessions.abort(),
  };
}

// Access tokens from the organization's identity provider (the registry's
// policy names which it trusts): `clientCredentials` gets an agent's by the
// OAuth 2.0 client-credentials grant (RFC 6749 4.4), with the registry as the
// resource (RFC 8707), keeps it, and gets a new one before it expires. Pass it
// as `token` to `ToolregClient.connect`: it is asked on every call.
//
// The client secret and the tokens are never logged or put in an error: a
// failed fetch names the endpoint's HTTP status and OAuth `error` code only.
import * as http from "node:http";
import * as https from "node:https";

import { pem, type PemSource, type TokenProvider } from "./transport.js";

export const REFRESH_MARGIN_MS = 30_000; // milliseconds before expiry when a token is fetched again
export const DEFAULT_LIFETIME_MS = 60_000; // assumed when the answer names no expires_in
const FETCH_TIMEOUT_MS = 10_000; // milliseconds for one token request
const MAX_ANSWER_BYTES = 64 * 1024; // bytes of a token endpoint's answer

/** The identity provider gave no token (the message holds no secret). */
export class TokenError extends Error {
  override readonly name = "TokenError";
}

export interface ClientCredentialsOptions {
  /** The provider's token endpoint: https (plain http only to loopback). */
  tokenEndpoint: string;
  clientId: string;
  clientSecret: string;
  /** The registry's audience (RFC 8707 resource indicator). */
  resource?: string;
  /** Space-separated scopes to ask for. */
  scope?: string;
  /** The CA of the provider's TLS certificate (PEM text or bytes, or a file path); default: the system's. */
  ca?: PemSource;
}

/** A token provider that also says how many tokens it fetched. */
export interface ClientCredentialsProvider {
  (): Promise<string>;
  /** Tokens fetched from the provider so far. */
  readonly fetches: number;
}

function loopbackHttp(url: URL): boolean {
  return url.protocol === "http:" && ["127.0.0.1", "localhost", "[::1]"].includes(url.hostname);
}

/**
 * Client-credentials tokens for one client and resource. A token is kept
 * until it is within REFRESH_MARGIN_MS of expiry; then the next call fetches
 * a new one (calls arriving meanwhile wait for that same fetch).
 */
export function clientCredentials(options: ClientCredentialsOptions): ClientCredentialsProvider {
  const endpoint = new URL(options.tokenEndpoint);
  if (endpoint.protocol !== "https:" && !loopbackHttp(endpoint)) {
    throw new Error("tokenEndpoint must be an https:// URL (http only to loopback)");
  }
  const ca = pem(options.ca, "identity provider's CA");
  const form = new URLSearchParams({ grant_type: "client_credentials" });
  if (options.resource) form.set("resource", options.resource);
  if (options.scope) form.set("scope", options.scope);
  // RFC 6749 2.3.1: the id and secret are form-encoded before Basic.
  const basic = Buffer.from(
    `${encodeURIComponent(options.clientId)}:${encodeURIComponent(options.clientSecret)}`,
  ).toString("base64");
  let token: string | undefined;
  let expiresAt = 0;
  let fetching: Promise<string> | undefined;
  let fetches = 0;

  async function fetchToken(): Promise<string> {
    fetches += 1;
    const answer = await postForm(endpoint, form.toString(), { authorization: `Basic ${basic}` }, ca);
    const fresh = readAnswer(answer);
    token = fresh.token;
    expiresAt = Date.now() + fresh.lifetimeMs;
    return fresh.token;
  }

  const provider = async (): Promise<string> => {
    if (token !== undefined && Date.now() < expiresAt - REFRESH_MARGIN_MS) return token;
    fetching ??= fetchToken().finally(() => {
      fetching = undefined;
    });
    return fetching;
  };
  Object.defineProperty(provider, "fetches", { get: () => fetches, enumerable: true });
  return provider as ClientCredentialsProvider;
}

interface Answer {
  status: number;
  body: Buffer;
}

function readAnswer(answer: Answer): { token: string; lifetimeMs: number } {
  let body: unknown;
  try {
    body = JSON.parse(answer.body.toString("utf8"));
  } catch {
    body = undefined;
  }
  const fields = typeof body === "object" && body !== null ? (body as Record<string, unknown>) : undefined;
  if (answer.status !== 200 || fields === undefined) {
    const code = fields?.error;
    const shown = typeof code === "string" && /^[A-Za-z_][A-Za-z0-9_]*$/.test(code) ? code : "no error code";
    throw new TokenError(`token endpoint refused: HTTP ${answer.status} (${shown})`);
  }
  const token = fields.access_token;
  if (typeof token !== "string" || !token) {
    throw new TokenError("token endpoint's answer has no access_token");
  }
  const seconds = fields.expires_in;
  const lifetimeMs = typeof seconds === "number" && seconds > 0 ? seconds * 1000 : DEFAULT_LIFETIME_MS;
  return { token, lifetimeMs };
}

/** POSTs a form (node:https, so a private CA needs no global setting); no redirects followed. */
function postForm(url: URL, form: string, headers: Record<string, string>, ca: Buffer | undefined): Promise<Answer> {
  const request = url.protocol === "https:" ? https.request : http.request;
  return new Promise((resolve, reject) => {
    const req = request(
      url,
      {
        method: "POST",
        headers: {
          ...headers,
          "content-type": "application/x-www-form-urlencoded",
          "content-length": Buffer.byteLength(form),
          accept: "application/json",
        },
        timeout: FETCH_TIMEOUT_MS,
        ...(ca ? { ca } : {}),
      },
      (res) => {
        const chunks: Buffer[] = [];
        let size = 0;
        res.on("data", (chunk: Buffer) => {
          size += chunk.length;
          if (size > MAX_ANSWER_BYTES) {
            req.destroy();
            reject(new TokenError("token endpoint's answer is too large"));
            return;
          }
          chunks.push(chunk);
        });
        res.on("end", () => resolve({ status: res.statusCode ?? 0, body: Buffer.concat(chunks) }));
        res.on("error", () => reject(new TokenError("token endpoint's answer broke off")));
      },
    );
    req.on("timeout", () => req.destroy(new Error("timeout")));
    req.on("error", (err: NodeJS.ErrnoException) => {
      reject(new TokenError(`token endpoint unreachable (${err.code ?? err.message})`));
    });
    req.end(form);
  });
}

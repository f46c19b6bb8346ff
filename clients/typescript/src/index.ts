// toolreg-client: a typed client for the toolreg gRPC registry.
export {
  ToolregClient,
  DEFAULT_POLL_MS,
  DEFAULT_TIMEOUT_MS,
  type CallOptions,
  type ClientOptions,
  type ExecuteOptions,
  type PageOptions,
  type ToolFilter,
  type WaitOptions,
  type WatchOptions,
} from "./client.js";
export {
  ApprovalWaitError,
  RpcError,
  type ApprovalWaitReason,
  type FieldViolation,
  type GrpcCode,
} from "./errors.js";
export {
  ADDRESS_ENV,
  DEFAULT_ADDRESS,
  defaultAddress,
  type ConnectionOptions,
  type PemSource,
  type TlsOptions,
  type TokenProvider,
} from "./transport.js";
export {
  clientCredentials,
  REFRESH_MARGIN_MS,
  TokenError,
  type ClientCredentialsOptions,
  type ClientCredentialsProvider,
} from "./tokens.js";
export type {
  AppliedRule,
  ApprovalEvent,
  ApprovalEventType,
  ApprovalRequestView,
  ApprovalState,
  CallResult,
  JsonValue,
  Page,
  ResourceLimits,
  SafetyLevel,
  SchemaFormat,
  SecretInjection,
  SecretRef,
  Status,
  StreamEvent,
  ToolDefinition,
  ToolGuard,
  ToolInput,
  ToolSandbox,
} from "./types.js";

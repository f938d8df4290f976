export {
  IdempotencyClient,
  type CallOptions,
  type ClientOptions,
  type CompletedAt,
  type KeyState,
  type Lease,
  type MarkProcessedResult,
  type ProcessedEvent,
  type RetryOptions,
  type RunOnceOptions,
  type RunOnceResult,
  type TlsOptions,
  type TryStartOutcome,
  type TryStartRequest,
} from './client';
export { bytesCodec, jsonCodec, type Codec } from './codec';
export * from './errors';
export { fingerprintOf } from './fingerprint';
export type { FieldViolation } from './status-details';

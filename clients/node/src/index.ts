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
export { canonicalJson, canonicalJsonText, CanonicalJsonError, type CanonicalJsonErrorReason } from './canonical';
export { bytesCodec, jsonCodec, type Codec } from './codec';
export { DEFAULTS } from './defaults';
export * from './errors';
export { fingerprintOf, fingerprintOfJson } from './fingerprint';
export type { FieldViolation } from './status-details';

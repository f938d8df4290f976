// The shapes at the client's surface: options, requests, answers and the lease. Plain data, so
// that the calls (client.ts) and runOnce (run-once.ts) share them without depending on each other.
import type * as grpc from '@grpc/grpc-js';

import type { Codec } from './codec';

export interface TlsOptions {
  /** PEM root certificates to trust; the system's roots when absent. */
  rootCerts?: Buffer;
  /** PEM private key and certificate chain, for mutual TLS. */
  privateKey?: Buffer;
  certChain?: Buffer;
}

export interface RetryOptions {
  /** The first step of the pauses after a transient failure. Default 50 ms. */
  initialBackoffMs: number;
  /** The largest step. Default 2000 ms. */
  maxBackoffMs: number;
  /** How each step grows from the one before. Default 2. */
  multiplier: number;
  /** All the tries of one call, pauses included, stop within this. Default 30000 ms. */
  totalMs: number;
}

export interface ClientOptions {
  /** Bearer token, sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** `true` for TLS with the system's roots, an object for custom roots or mutual TLS. Default: plaintext. */
  tls?: boolean | TlsOptions;
  /** Deadline of each single call, in milliseconds. Default 10000. */
  callTimeoutMs?: number;
  /**
   * Retries of runOnce's calls on UNAVAILABLE, DEADLINE_EXCEEDED, RATE_LIMITED and OVERLOADED,
   * and of markProcessed on RATE_LIMITED and OVERLOADED.
   */
  retry?: Partial<RetryOptions>;
  /** Extra @grpc/grpc-js channel options; they override this client's defaults. */
  channelOptions?: grpc.ChannelOptions;
}

/** Per-call options of the one-RPC methods. */
export interface CallOptions {
  /** Cancels the call: it rejects with the signal's reason. */
  signal?: AbortSignal;
  /** Overrides the client's `callTimeoutMs` for this call. */
  timeoutMs?: number;
}

export interface TryStartRequest {
  namespace: string;
  key: string;
  fingerprint?: Uint8Array;
  leaseTtlMs?: number;
  retentionMs?: number;
  attemptId?: string;
  /** How long the service may hold the call for another holder (0–60 000; default 0: at once). */
  waitMs?: number;
}

export type TryStartOutcome =
  | { kind: 'started'; leaseToken: bigint; leaseExpiresAt: Date; attempt: number; checkpoint: Buffer | undefined }
  | { kind: 'inProgress'; leaseExpiresAt: Date; attempt: number }
  | { kind: 'completed'; response: Buffer; completedAt: Date; expiresAt: Date }
  | { kind: 'fingerprintMismatch' };

export type KeyState =
  | { kind: 'absent' }
  | { kind: 'inProgress'; leaseExpiresAt: Date; attempt: number; fingerprint: Buffer }
  | { kind: 'completed'; response: Buffer; fingerprint: Buffer; completedAt: Date; expiresAt: Date };

/**
 * The calls runOnce makes on a lease, as the client answers them: what run-once.ts needs from
 * IdempotencyClient, stated here so that the two modules do not import each other.
 */
export interface LeaseCalls {
  tryStart(request: TryStartRequest, options?: CallOptions): Promise<TryStartOutcome>;
  complete(
    namespace: string,
    key: string,
    leaseToken: bigint,
    response: Uint8Array,
    options?: CallOptions & { retentionMs?: number },
  ): Promise<CompletedAt>;
  release(namespace: string, key: string, leaseToken: bigint, options?: CallOptions): Promise<void>;
  extendLease(
    namespace: string,
    key: string,
    leaseToken: bigint,
    options?: CallOptions & { leaseTtlMs?: number; checkpoint?: Uint8Array },
  ): Promise<Date>;
  lookup(namespace: string, key: string, options?: CallOptions): Promise<KeyState>;
}

export interface CompletedAt {
  completedAt: Date;
  expiresAt: Date;
}

export interface ProcessedEvent {
  eventId: string;
  alreadyProcessed: boolean;
  processedAt: Date;
}

export interface MarkProcessedResult {
  /** The ids seen for the first time, in request order: handle these. */
  newEventIds: string[];
  /** One entry per requested id, in request order. */
  events: ProcessedEvent[];
}

/** What runOnce hands the work: the claim, and the means to keep and use it. */
export interface Lease {
  readonly namespace: string;
  readonly key: string;
  /** The fencing token; pass it to systems that can reject a stale writer. */
  readonly token: bigint;
  /** 1 for a fresh claim, one more for every takeover of an expired lease. */
  readonly attempt: number;
  /** The last checkpoint a previous holder saved, handed over on takeover. */
  readonly checkpoint: Buffer | undefined;
  /** When the lease runs out unless extended (the heartbeat moves it). */
  readonly expiresAt: Date;
  /**
   * Aborts when the work must stop: the lease was lost (the reason is a LeaseLostError; someone
   * else owns the key now), or the caller's own signal aborted.
   */
  readonly signal: AbortSignal;
  /** Saves a checkpoint for whoever takes the key over, and extends the lease. */
  saveCheckpoint(checkpoint: Uint8Array): Promise<void>;
}

export interface RunOnceOptions<T> {
  /** The request, fingerprinted as SHA-256 of its bytes or of its RFC 8785 canonical JSON. */
  request?: unknown;
  /** A fingerprint of your own (at most 64 bytes); it wins over `request`. Default: empty. */
  fingerprint?: Uint8Array;
  /** The lease, in milliseconds. Default 30000. */
  leaseTtlMs?: number;
  /** How long the key is kept, in milliseconds. Default: the server's (24 h unless configured). */
  retentionMs?: number;
  /**
   * How long to wait for another holder to finish before throwing InProgressError. Default 0.
   * The service holds the TryStart until the holder finishes (at most 60 s per TryStart).
   */
  waitMs?: number;
  /** Pause between heartbeats (ExtendLease). Default: a third of `leaseTtlMs`; 0 turns them off. */
  heartbeatIntervalMs?: number;
  /** Identifies this logical attempt so that a retried TryStart gets its own claim back. Default: a random UUID. */
  attemptId?: string;
  /** Cancels waiting and retrying, and aborts the work's signal. */
  signal?: AbortSignal;
  /** How the result is stored and replayed. Default: JSON. */
  codec?: Codec<T>;
  /**
   * Decides which failures of the work are final results (Stripe stores 4xx answers): return
   * the result to store and return, or undefined to release the key and rethrow.
   */
  errorAsResult?: (error: unknown) => T | undefined;
}

export interface RunOnceResult<T> {
  value: T;
  /** True when the value is a stored result replayed from an earlier run. */
  replayed: boolean;
}

// The coordinator's client: one Promise per RPC, typed answers and typed errors, and the calls
// that wrap the whole protocol (runOnce, processOnce, markProcessed).
import { randomUUID } from 'node:crypto';
import * as grpc from '@grpc/grpc-js';

import { Backoff, sleep } from './backoff';
import { jsonCodec, type Codec } from './codec';
import {
  AlreadyCompletedError,
  FingerprintMismatchError,
  InProgressError,
  KeyNotFoundError,
  LeaseLostError,
  RateLimitedError,
  errorFromStatus,
  isTransient,
  type CoordinatorError,
} from './errors';
import { fingerprintOf } from './fingerprint';
import { proto, type IdempotencyServiceClient } from './protocol';
import type { Duration } from './generated/google/protobuf/Duration';
import type { Timestamp__Output } from './generated/google/protobuf/Timestamp';
import type { CompleteResponse__Output } from './generated/idempotency/v1/CompleteResponse';
import type { ExtendLeaseResponse__Output } from './generated/idempotency/v1/ExtendLeaseResponse';
import type { LookupResponse__Output } from './generated/idempotency/v1/LookupResponse';
import type { MarkProcessedResponse__Output } from './generated/idempotency/v1/MarkProcessedResponse';
import type { ReleaseResponse__Output } from './generated/idempotency/v1/ReleaseResponse';
import type { TryStartResponse__Output } from './generated/idempotency/v1/TryStartResponse';

export interface TlsOptions {
  /** PEM root certificates to trust; the system's roots when absent. */
  rootCerts?: Buffer;
  /** PEM private key and certificate chain, for mutual TLS. */
  privateKey?: Buffer;
  certChain?: Buffer;
}

export interface RetryOptions {
  /** Ceiling of the first pause after a transient failure. Default 50 ms. */
  initialBackoffMs: number;
  /** Largest pause between two tries. Default 2000 ms. */
  maxBackoffMs: number;
  /** Total time a call may spend retrying before its last error is thrown. Default 15000 ms. */
  totalMs: number;
}

export interface ClientOptions {
  /** Bearer token, sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** `true` for TLS with the system's roots, an object for custom roots or mutual TLS. Default: plaintext. */
  tls?: boolean | TlsOptions;
  /** Deadline of each single call, in milliseconds. Default 5000. */
  callTimeoutMs?: number;
  /** Retries of TryStart, Complete and Release on UNAVAILABLE, deadlines and rate limiting. */
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

const DEFAULT_CALL_TIMEOUT_MS = 5_000;
const DEFAULT_LEASE_TTL_MS = 30_000;
const DEFAULT_RETRY: RetryOptions = { initialBackoffMs: 50, maxBackoffMs: 2_000, totalMs: 15_000 };
// Pauses before asking again when the service answered in_progress without waiting (it is at
// its waiter limit): often at first, at most once a second.
const IN_PROGRESS_POLL = { initialMs: 100, maxMs: 1_000 };
const MIN_POLL_MS = 25;
/** The longest wait one TryStart may ask the service for. */
const MAX_SERVER_WAIT_MS = 60_000;
/** What is left of the caller's limit when a waiting TryStart comes back that is too little to ask again for. */
const WAIT_SLACK_MS = 20;

/** What a TryStart sent now asks the service to wait: what is left of the limit, at most 60 s. */
function serverWaitMs(waitEnds: number): number {
  return Math.max(0, Math.min(MAX_SERVER_WAIT_MS, waitEnds - Date.now()));
}
// A failed heartbeat (other than a lost lease) is tried again this soon, if the interval is longer.
const HEARTBEAT_RETRY_MS = 1_000;

const DEFAULT_CHANNEL_OPTIONS: grpc.ChannelOptions = {
  // grpc-js backs reconnection off from 1 s up to 120 s; a coordinator that restarts (a
  // deploy) should be found again within a fraction of a second, while runOnce is still
  // retrying, and never later than 2 s.
  'grpc.initial_reconnect_backoff_ms': 250,
  'grpc.max_reconnect_backoff_ms': 2_000,
};

export class IdempotencyClient {
  private readonly stub: IdempotencyServiceClient;
  private readonly token: string | undefined;
  private readonly callTimeoutMs: number;
  private readonly retry: RetryOptions;

  /** @param address `host:port` of the coordinator, e.g. `127.0.0.1:50051`. */
  constructor(address: string, options: ClientOptions = {}) {
    this.token = options.token;
    this.callTimeoutMs = options.callTimeoutMs ?? DEFAULT_CALL_TIMEOUT_MS;
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.stub = new proto.idempotency.v1.IdempotencyService(address, channelCredentials(options.tls), {
      ...DEFAULT_CHANNEL_OPTIONS,
      ...options.channelOptions,
    });
  }

  /** Closes the channel; calls after this fail. */
  close(): void {
    this.stub.close();
  }

  // ---- One call per RPC -------------------------------------------------------------------

  async tryStart(request: TryStartRequest, options: CallOptions = {}): Promise<TryStartOutcome> {
    const answer = await this.unary<TryStartResponse__Output>(
      (metadata, callOptions, callback) =>
        this.stub.tryStart(
          {
            namespace: request.namespace,
            key: request.key,
            fingerprint: request.fingerprint,
            leaseTtl: durationFromMs('leaseTtlMs', request.leaseTtlMs),
            retention: durationFromMs('retentionMs', request.retentionMs),
            attemptId: request.attemptId,
            wait: request.waitMs ? durationFromMs('waitMs', request.waitMs) : undefined,
          },
          metadata,
          callOptions,
          callback,
        ),
      options,
    );
    switch (answer.outcome) {
      case 'started': {
        const started = answer.started!;
        return {
          kind: 'started',
          leaseToken: BigInt(started.leaseToken ?? 0),
          leaseExpiresAt: dateFromTimestamp(started.leaseExpiresAt),
          attempt: started.attempt ?? 0,
          checkpoint: started._checkpoint === 'checkpoint' ? (started.checkpoint ?? Buffer.alloc(0)) : undefined,
        };
      }
      case 'inProgress': {
        const inProgress = answer.inProgress!;
        return {
          kind: 'inProgress',
          leaseExpiresAt: dateFromTimestamp(inProgress.leaseExpiresAt),
          attempt: inProgress.attempt ?? 0,
        };
      }
      case 'completed': {
        const completed = answer.completed!;
        return {
          kind: 'completed',
          response: completed.response ?? Buffer.alloc(0),
          completedAt: dateFromTimestamp(completed.completedAt),
          expiresAt: dateFromTimestamp(completed.expiresAt),
        };
      }
      case 'fingerprintMismatch':
        return { kind: 'fingerprintMismatch' };
      default:
        throw new Error(`TryStart answered no outcome the client knows (${String(answer.outcome)})`);
    }
  }

  async complete(
    namespace: string,
    key: string,
    leaseToken: bigint,
    response: Uint8Array,
    options: CallOptions & { retentionMs?: number } = {},
  ): Promise<CompletedAt> {
    const answer = await this.unary<CompleteResponse__Output>(
      (metadata, callOptions, callback) =>
        this.stub.complete(
          {
            namespace,
            key,
            leaseToken: leaseToken.toString(),
            response,
            retention: durationFromMs('retentionMs', options.retentionMs),
          },
          metadata,
          callOptions,
          callback,
        ),
      options,
    );
    return { completedAt: dateFromTimestamp(answer.completedAt), expiresAt: dateFromTimestamp(answer.expiresAt) };
  }

  async release(namespace: string, key: string, leaseToken: bigint, options: CallOptions = {}): Promise<void> {
    await this.unary<ReleaseResponse__Output>(
      (metadata, callOptions, callback) =>
        this.stub.release({ namespace, key, leaseToken: leaseToken.toString() }, metadata, callOptions, callback),
      options,
    );
  }

  /** Moves the lease's expiry to now + leaseTtlMs (and saves `checkpoint` when given). */
  async extendLease(
    namespace: string,
    key: string,
    leaseToken: bigint,
    options: CallOptions & { leaseTtlMs?: number; checkpoint?: Uint8Array } = {},
  ): Promise<Date> {
    const answer = await this.unary<ExtendLeaseResponse__Output>(
      (metadata, callOptions, callback) =>
        this.stub.extendLease(
          {
            namespace,
            key,
            leaseToken: leaseToken.toString(),
            leaseTtl: durationFromMs('leaseTtlMs', options.leaseTtlMs),
            checkpoint: options.checkpoint,
          },
          metadata,
          callOptions,
          callback,
        ),
      options,
    );
    return dateFromTimestamp(answer.leaseExpiresAt);
  }

  async lookup(namespace: string, key: string, options: CallOptions = {}): Promise<KeyState> {
    const answer = await this.unary<LookupResponse__Output>(
      (metadata, callOptions, callback) => this.stub.lookup({ namespace, key }, metadata, callOptions, callback),
      options,
    );
    switch (answer.state) {
      case 'absent':
        return { kind: 'absent' };
      case 'inProgress': {
        const inProgress = answer.inProgress!;
        return {
          kind: 'inProgress',
          leaseExpiresAt: dateFromTimestamp(inProgress.leaseExpiresAt),
          attempt: inProgress.attempt ?? 0,
          fingerprint: inProgress.fingerprint ?? Buffer.alloc(0),
        };
      }
      case 'completed': {
        const completed = answer.completed!;
        return {
          kind: 'completed',
          response: completed.response ?? Buffer.alloc(0),
          fingerprint: completed.fingerprint ?? Buffer.alloc(0),
          completedAt: dateFromTimestamp(completed.completedAt),
          expiresAt: dateFromTimestamp(completed.expiresAt),
        };
      }
      default:
        throw new Error(`Lookup answered no state the client knows (${String(answer.state)})`);
    }
  }

  /**
   * Records that `consumer` handled `eventIds` (1-1000, atomically) and says which are new.
   * This records *that* events were handled; for an effect that must happen exactly once, use
   * processOnce, which claims the event before the effect.
   */
  async markProcessed(
    consumer: string,
    eventIds: readonly string[],
    options: CallOptions & { retentionMs?: number } = {},
  ): Promise<MarkProcessedResult> {
    const answer = await this.unary<MarkProcessedResponse__Output>(
      (metadata, callOptions, callback) =>
        this.stub.markProcessed(
          { consumer, eventIds: [...eventIds], retention: durationFromMs('retentionMs', options.retentionMs) },
          metadata,
          callOptions,
          callback,
        ),
      options,
    );
    const events = answer.results.map((result) => ({
      eventId: result.eventId ?? '',
      alreadyProcessed: result.alreadyProcessed ?? false,
      processedAt: dateFromTimestamp(result.processedAt),
    }));
    return {
      newEventIds: events.filter((event) => !event.alreadyProcessed).map((event) => event.eventId),
      events,
    };
  }

  // ---- The protocol in one call -------------------------------------------------------------

  /**
   * Runs `work` at most once per (namespace, key) to completion, and returns its result, or
   * the stored result of the run that completed before (`replayed: true`).
   *
   * Throws InProgressError when another caller holds the key beyond `waitMs`,
   * FingerprintMismatchError when the key was used for a different request, LeaseLostError
   * when this caller's lease was taken over while the work ran, and the work's own error
   * (after releasing the key, so that a retry starts fresh).
   */
  async runOnce<T>(
    namespace: string,
    key: string,
    work: (lease: Lease) => Promise<T> | T,
    options: RunOnceOptions<T> = {},
  ): Promise<RunOnceResult<T>> {
    const codec = options.codec ?? jsonCodec<T>();
    const leaseTtlMs = options.leaseTtlMs ?? DEFAULT_LEASE_TTL_MS;
    const request: TryStartRequest = {
      namespace,
      key,
      fingerprint:
        options.fingerprint ?? (options.request !== undefined ? fingerprintOf(options.request) : Buffer.alloc(0)),
      leaseTtlMs,
      retentionMs: options.retentionMs,
      // One id for this logical attempt, kept across retries of TryStart: a claim whose answer
      // was lost is given back to us instead of locking us out until its lease runs out.
      attemptId: options.attemptId ?? randomUUID(),
    };
    const outcome = await this.claim(request, options.waitMs ?? 0, options.signal);
    switch (outcome.kind) {
      case 'completed':
        return { value: codec.decode(outcome.response), replayed: true };
      case 'fingerprintMismatch':
        throw new FingerprintMismatchError();
      case 'inProgress':
        throw new InProgressError(outcome.leaseExpiresAt, outcome.attempt);
      case 'started':
        if (options.signal?.aborted) {
          // Cancelled while the claim was being made: give it back at once.
          await this.releaseQuietly(namespace, key, outcome.leaseToken);
          throw options.signal.reason;
        }
        return this.runHolding(request, outcome, work, codec, {
          leaseTtlMs,
          heartbeatIntervalMs: options.heartbeatIntervalMs ?? leaseTtlMs / 3,
          retentionMs: options.retentionMs,
          signal: options.signal,
          errorAsResult: options.errorAsResult,
        });
    }
  }

  /** runOnce for a consumed event: the consumer is the namespace, the event id the key. */
  processOnce<T>(
    consumer: string,
    eventId: string,
    work: (lease: Lease) => Promise<T> | T,
    options: RunOnceOptions<T> = {},
  ): Promise<RunOnceResult<T>> {
    return this.runOnce(consumer, eventId, work, options);
  }

  /**
   * TryStart until the answer is not `inProgress` or `waitMs` has passed: the one place that
   * waits for a holder. Each TryStart asks the service to wait (what is left of `waitMs`, at most
   * 60 s) and is given that long on top of the call timeout; a service that answers `inProgress`
   * clearly before the wait it was asked for (it is at its waiter limit) is asked again after a
   * short pause, so that a full service is not hammered.
   */
  private async claim(request: TryStartRequest, waitMs: number, signal: AbortSignal | undefined): Promise<TryStartOutcome> {
    const waitEnds = Date.now() + waitMs;
    const poll = new Backoff(IN_PROGRESS_POLL);
    for (;;) {
      const askedAt = Date.now();
      const askedWaitMs = serverWaitMs(waitEnds);
      let outcome: TryStartOutcome;
      try {
        outcome = await this.withRetries(() => {
          // Recomputed for every try, so that a retry never waits past the limit.
          const wait = serverWaitMs(waitEnds);
          return this.tryStart({ ...request, waitMs: wait }, { timeoutMs: this.callTimeoutMs + wait, signal });
        }, signal);
      } catch (error) {
        if (signal?.aborted) {
          await this.giveBackAfterAbort(request);
          throw signal.reason;
        }
        throw error;
      }
      const remainingMs = waitEnds - Date.now();
      if (outcome.kind !== 'inProgress' || remainingMs < WAIT_SLACK_MS) return outcome;
      if (Date.now() - askedAt < askedWaitMs / 2) {
        await sleep(Math.min(remainingMs, poll.nextDelayMs(MIN_POLL_MS)), signal);
      }
    }
  }

  /**
   * After the caller's signal cancelled a TryStart in flight (a wait for a holder ends at once):
   * that TryStart may still have claimed the key, so one more TryStart with the same attempt_id
   * and no wait finds such a claim (or claims the key if it is free) and releases it. Failing
   * that, a claim runs out with its lease.
   */
  private async giveBackAfterAbort(request: TryStartRequest): Promise<void> {
    try {
      const outcome = await this.tryStart({ ...request, waitMs: 0 });
      if (outcome.kind === 'started') await this.releaseQuietly(request.namespace, request.key, outcome.leaseToken);
    } catch {
      // Deliberately ignored; see above.
    }
  }

  private async runHolding<T>(
    request: TryStartRequest,
    started: Extract<TryStartOutcome, { kind: 'started' }>,
    work: (lease: Lease) => Promise<T> | T,
    codec: Codec<T>,
    options: {
      leaseTtlMs: number;
      heartbeatIntervalMs: number;
      retentionMs: number | undefined;
      signal: AbortSignal | undefined;
      errorAsResult: ((error: unknown) => T | undefined) | undefined;
    },
  ): Promise<RunOnceResult<T>> {
    const { namespace, key } = request;
    const token = started.leaseToken;
    const lease = new HeldLease(this, namespace, key, started, options.leaseTtlMs, options.signal);
    const heartbeat = new Heartbeat(lease, options.heartbeatIntervalMs);
    let value: T;
    try {
      value = await work(lease);
    } catch (workError) {
      await heartbeat.stop();
      // The work failed because it lost the lease (its signal aborted): the new holder owns the
      // key, so there is nothing to release and "lease lost" is the answer.
      if (lease.lostError) throw lease.lostError;
      const finalResult = options.errorAsResult?.(workError);
      if (finalResult === undefined) {
        await this.releaseQuietly(namespace, key, token);
        throw workError;
      }
      value = finalResult;
    } finally {
      await heartbeat.stop();
      lease.detach();
    }
    if (lease.lostError) throw lease.lostError;
    await this.completeHeld(namespace, key, token, codec.encode(value), options.retentionMs);
    return { value, replayed: false };
  }

  /**
   * Complete, retried on transient failures (a repeated Complete with the same response
   * succeeds again). ALREADY_COMPLETED counts as success when the stored response is ours: an
   * earlier try of this same Complete got through.
   */
  private async completeHeld(
    namespace: string,
    key: string,
    token: bigint,
    response: Uint8Array,
    retentionMs: number | undefined,
  ): Promise<void> {
    try {
      await this.withRetries(() => this.complete(namespace, key, token, response, { retentionMs }), undefined);
    } catch (error) {
      if (!(error instanceof AlreadyCompletedError)) throw error;
      const state = await this.withRetries(() => this.lookup(namespace, key), undefined);
      if (state.kind !== 'completed' || !state.response.equals(response)) throw error;
    }
  }

  /**
   * Release after the work failed, so that a retry starts fresh. A Release that cannot be made
   * is not the caller's problem to handle: the work's error is the answer, and the lease runs
   * out on its own.
   */
  private async releaseQuietly(namespace: string, key: string, token: bigint): Promise<void> {
    try {
      await this.withRetries(() => this.release(namespace, key, token), undefined);
    } catch {
      // Deliberately ignored; see above.
    }
  }

  /**
   * Repeats `call` while it fails with UNAVAILABLE, a deadline or a rate limit, with backoff,
   * for at most `retry.totalMs`. Only for calls that are safe to repeat.
   */
  private async withRetries<R>(call: () => Promise<R>, signal: AbortSignal | undefined): Promise<R> {
    const giveUpAt = Date.now() + this.retry.totalMs;
    const backoff = new Backoff({ initialMs: this.retry.initialBackoffMs, maxMs: this.retry.maxBackoffMs });
    for (;;) {
      try {
        return await call();
      } catch (error) {
        if (!(isTransient(error) || error instanceof RateLimitedError)) throw error;
        const delayMs = backoff.nextDelayMs((error as CoordinatorError).retryDelayMs ?? 0);
        if (Date.now() + delayMs > giveUpAt) throw error;
        await sleep(delayMs, signal);
      }
    }
  }

  private unary<R>(
    start: (metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<R>) => grpc.ClientUnaryCall,
    options: CallOptions,
  ): Promise<R> {
    const { signal } = options;
    return new Promise<R>((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const metadata = new grpc.Metadata();
      if (this.token !== undefined) metadata.set('authorization', `Bearer ${this.token}`);
      let cancelled = false;
      const onAbort = () => {
        cancelled = true;
        call.cancel();
        reject(signal?.reason);
      };
      const call = start(metadata, { deadline: Date.now() + (options.timeoutMs ?? this.callTimeoutMs) }, (error, answer) => {
        signal?.removeEventListener('abort', onAbort);
        if (cancelled) return;
        if (error) reject(errorFromStatus(error));
        else resolve(answer as R);
      });
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }
}

/** The lease runOnce holds while the work runs. */
class HeldLease implements Lease {
  readonly token: bigint;
  readonly attempt: number;
  readonly checkpoint: Buffer | undefined;
  expiresAt: Date;
  lostError: LeaseLostError | undefined;
  private readonly controller = new AbortController();
  private readonly callerSignal: AbortSignal | undefined;
  private readonly onCallerAbort = () => this.controller.abort(this.callerSignal?.reason);

  constructor(
    private readonly client: IdempotencyClient,
    readonly namespace: string,
    readonly key: string,
    started: Extract<TryStartOutcome, { kind: 'started' }>,
    private readonly leaseTtlMs: number,
    callerSignal: AbortSignal | undefined,
  ) {
    this.token = started.leaseToken;
    this.attempt = started.attempt;
    this.checkpoint = started.checkpoint;
    this.expiresAt = started.leaseExpiresAt;
    this.callerSignal = callerSignal;
    if (callerSignal?.aborted) this.onCallerAbort();
    else callerSignal?.addEventListener('abort', this.onCallerAbort, { once: true });
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** Extends the lease, optionally saving a checkpoint; a lost lease aborts the work. */
  async extend(checkpoint?: Uint8Array): Promise<void> {
    try {
      this.expiresAt = await this.client.extendLease(this.namespace, this.key, this.token, {
        leaseTtlMs: this.leaseTtlMs,
        checkpoint,
      });
    } catch (error) {
      if (error instanceof LeaseLostError || error instanceof KeyNotFoundError || error instanceof AlreadyCompletedError) {
        this.markLost(error);
        throw this.lostError;
      }
      throw error;
    }
  }

  saveCheckpoint(checkpoint: Uint8Array): Promise<void> {
    if (this.lostError) return Promise.reject(this.lostError);
    return this.extend(checkpoint);
  }

  /** Stops following the caller's signal once the run is over. */
  detach(): void {
    this.callerSignal?.removeEventListener('abort', this.onCallerAbort);
  }

  private markLost(cause: CoordinatorError): void {
    if (this.lostError) return;
    // A key that vanished or was completed under our token is lost to us just the same.
    this.lostError =
      cause instanceof LeaseLostError
        ? cause
        : new LeaseLostError(
            `the lease on this key is lost: ${cause.message}`,
            cause.code,
            { reason: cause.reason, fieldViolations: [], retryDelayMs: undefined },
            { cause },
          );
    this.controller.abort(this.lostError);
  }
}

/** Extends a lease every interval while the work runs, until stopped or the lease is lost. */
class Heartbeat {
  private timer: NodeJS.Timeout | undefined;
  private beating: Promise<void> | undefined;
  private stopped = false;

  constructor(
    private readonly lease: HeldLease,
    private readonly intervalMs: number,
  ) {
    if (intervalMs > 0) this.schedule(intervalMs);
  }

  /** Stops beating and waits for a beat in flight, so that no ExtendLease races the Complete. */
  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.timer);
    await this.beating;
  }

  private schedule(delayMs: number): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.beating = this.beat();
    }, delayMs);
  }

  private async beat(): Promise<void> {
    try {
      await this.lease.extend();
      this.schedule(this.intervalMs);
    } catch {
      // A lost lease has aborted the work: no more beats. Anything else (the coordinator or its
      // store briefly unreachable) does not mean the lease is gone: a holder nobody replaced
      // may still extend, so try again soon.
      if (!this.lease.lostError) this.schedule(Math.min(this.intervalMs, HEARTBEAT_RETRY_MS));
    }
  }
}

function channelCredentials(tls: ClientOptions['tls']): grpc.ChannelCredentials {
  if (!tls) return grpc.credentials.createInsecure();
  if (tls === true) return grpc.credentials.createSsl();
  return grpc.credentials.createSsl(tls.rootCerts ?? null, tls.privateKey ?? null, tls.certChain ?? null);
}

function durationFromMs(name: string, ms: number | undefined): Duration | undefined {
  if (ms === undefined) return undefined;
  if (!Number.isFinite(ms)) throw new RangeError(`${name} must be a finite number of milliseconds (got ${ms})`);
  const wholeMs = Math.round(ms);
  const seconds = Math.trunc(wholeMs / 1000);
  return { seconds, nanos: (wholeMs - seconds * 1000) * 1_000_000 };
}

function dateFromTimestamp(timestamp: Timestamp__Output | undefined): Date {
  if (!timestamp) return new Date(0);
  return new Date(Number(timestamp.seconds ?? 0) * 1000 + Math.floor((timestamp.nanos ?? 0) / 1e6));
}

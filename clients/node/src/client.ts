// The coordinator's client: one Promise per RPC, typed answers and typed errors, markProcessed,
// and runOnce and processOnce, which run-once.ts carries out.
import * as grpc from '@grpc/grpc-js';

import { errorFromStatus } from './errors';
import { proto, type IdempotencyServiceClient } from './protocol';
import { RunOnce } from './run-once';
import type {
  CallOptions,
  ClientOptions,
  CompletedAt,
  KeyState,
  Lease,
  MarkProcessedResult,
  RetryOptions,
  RunOnceOptions,
  RunOnceResult,
  TryStartOutcome,
  TryStartRequest,
} from './types';
import type { Duration } from './generated/google/protobuf/Duration';
import type { Timestamp__Output } from './generated/google/protobuf/Timestamp';
import type { CompleteResponse__Output } from './generated/idempotency/v1/CompleteResponse';
import type { ExtendLeaseResponse__Output } from './generated/idempotency/v1/ExtendLeaseResponse';
import type { LookupResponse__Output } from './generated/idempotency/v1/LookupResponse';
import type { MarkProcessedResponse__Output } from './generated/idempotency/v1/MarkProcessedResponse';
import type { ReleaseResponse__Output } from './generated/idempotency/v1/ReleaseResponse';
import type { TryStartResponse__Output } from './generated/idempotency/v1/TryStartResponse';

export type * from './types';

const DEFAULT_CALL_TIMEOUT_MS = 5_000;
const DEFAULT_RETRY: RetryOptions = { initialBackoffMs: 50, maxBackoffMs: 2_000, totalMs: 15_000 };

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
  private readonly run: RunOnce;

  /** @param address `host:port` of the coordinator, e.g. `127.0.0.1:50051`. */
  constructor(address: string, options: ClientOptions = {}) {
    this.token = options.token;
    this.callTimeoutMs = options.callTimeoutMs ?? DEFAULT_CALL_TIMEOUT_MS;
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.run = new RunOnce(this, this.retry, this.callTimeoutMs);
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
  runOnce<T>(
    namespace: string,
    key: string,
    work: (lease: Lease) => Promise<T> | T,
    options: RunOnceOptions<T> = {},
  ): Promise<RunOnceResult<T>> {
    return this.run.runOnce(namespace, key, work, options);
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

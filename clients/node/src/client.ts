// The coordinator's client: one Promise per RPC, typed answers and typed errors, markProcessed,
// and runOnce and processOnce, which run-once.ts carries out.
import * as grpc from '@grpc/grpc-js';

import { retrying } from './backoff';
import { DEFAULTS } from './defaults';
import { errorFromStatus, isRefusedAtTheDoor } from './errors';
import { proto, type IdempotencyServiceClient } from './protocol';
import { RunOnce } from './run-once';
import type {
  CallOptions,
  ClientOptions,
  CompletedAt,
  KeyState,
  LeaseCalls,
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

export type * from './types';

const DEFAULT_RETRY: RetryOptions = {
  initialBackoffMs: DEFAULTS.retry.initialBackoffMs,
  maxBackoffMs: DEFAULTS.retry.maxBackoffMs,
  multiplier: DEFAULTS.retry.multiplier,
  totalMs: DEFAULTS.retry.budgetMs,
};

/** The service's methods, by their names on the generated client. */
type Rpc = 'tryStart' | 'complete' | 'release' | 'extendLease' | 'lookup' | 'markProcessed';
/** What `method` is sent, and what it answers (read from the generated client's signatures). */
type RequestOf<M extends Rpc> = Parameters<IdempotencyServiceClient[M]>[0];
type AnswerOf<M extends Rpc> =
  Parameters<IdempotencyServiceClient[M]>[1] extends grpc.requestCallback<infer A> ? A : never;
type UnaryMethod<M extends Rpc> = (
  request: RequestOf<M>,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: grpc.requestCallback<AnswerOf<M>>,
) => grpc.ClientUnaryCall;

const DEFAULT_CHANNEL_OPTIONS: grpc.ChannelOptions = {
  // grpc-js backs reconnection off from 1 s up to 120 s; a coordinator that restarts (a
  // deploy) should be found again within a fraction of a second, while runOnce is still
  // retrying, and never later than 2 s.
  'grpc.initial_reconnect_backoff_ms': 250,
  'grpc.max_reconnect_backoff_ms': 2_000,
};

export class IdempotencyClient implements LeaseCalls {
  private readonly stub: IdempotencyServiceClient;
  private readonly token: string | undefined;
  private readonly callTimeoutMs: number;
  private readonly retry: RetryOptions;
  private readonly run: RunOnce;

  /** @param address `host:port` of the coordinator, e.g. `127.0.0.1:50051`. */
  constructor(address: string, options: ClientOptions = {}) {
    this.token = options.token;
    this.callTimeoutMs = options.callTimeoutMs ?? DEFAULTS.callTimeoutMs;
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
    const answer = await this.unary(
      'tryStart',
      {
        namespace: request.namespace,
        key: request.key,
        fingerprint: request.fingerprint,
        leaseTtl: durationFromMs('leaseTtlMs', request.leaseTtlMs),
        retention: durationFromMs('retentionMs', request.retentionMs),
        attemptId: request.attemptId,
        wait: request.waitMs ? durationFromMs('waitMs', request.waitMs) : undefined,
      },
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
      case 'inProgress':
        return { kind: 'inProgress', ...holderOf(answer.inProgress!) };
      case 'completed': {
        const completed = answer.completed!;
        return { kind: 'completed', response: completed.response ?? Buffer.alloc(0), ...completionTimes(completed) };
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
    const retention = durationFromMs('retentionMs', options.retentionMs);
    const answer = await this.unary('complete', { ...heldKey(namespace, key, leaseToken), response, retention }, options);
    return completionTimes(answer);
  }

  async release(namespace: string, key: string, leaseToken: bigint, options: CallOptions = {}): Promise<void> {
    await this.unary('release', heldKey(namespace, key, leaseToken), options);
  }

  /** Moves the lease's expiry to now + leaseTtlMs (and saves `checkpoint` when given). */
  async extendLease(
    namespace: string,
    key: string,
    leaseToken: bigint,
    options: CallOptions & { leaseTtlMs?: number; checkpoint?: Uint8Array } = {},
  ): Promise<Date> {
    const leaseTtl = durationFromMs('leaseTtlMs', options.leaseTtlMs);
    const answer = await this.unary(
      'extendLease',
      { ...heldKey(namespace, key, leaseToken), leaseTtl, checkpoint: options.checkpoint },
      options,
    );
    return dateFromTimestamp(answer.leaseExpiresAt);
  }

  async lookup(namespace: string, key: string, options: CallOptions = {}): Promise<KeyState> {
    const answer = await this.unary('lookup', { namespace, key }, options);
    switch (answer.state) {
      case 'absent':
        return { kind: 'absent' };
      case 'inProgress': {
        const inProgress = answer.inProgress!;
        return { kind: 'inProgress', ...holderOf(inProgress), fingerprint: inProgress.fingerprint ?? Buffer.alloc(0) };
      }
      case 'completed': {
        const completed = answer.completed!;
        return {
          kind: 'completed',
          response: completed.response ?? Buffer.alloc(0),
          fingerprint: completed.fingerprint ?? Buffer.alloc(0),
          ...completionTimes(completed),
        };
      }
      default:
        throw new Error(`Lookup answered no state the client knows (${String(answer.state)})`);
    }
  }

  /**
   * Records that `consumer` handled `eventIds` (1-1000, atomically) and says which are new.
   * This records *that* events were handled; for an effect that must happen exactly once, use
   * processOnce, which claims the event before the effect. Retried (within `retry.totalMs`) only
   * when refused at the door (RATE_LIMITED, OVERLOADED): after a lost answer a retry would
   * report the events as already processed, and the caller would skip them.
   */
  async markProcessed(
    consumer: string,
    eventIds: readonly string[],
    options: CallOptions & { retentionMs?: number } = {},
  ): Promise<MarkProcessedResult> {
    const retention = durationFromMs('retentionMs', options.retentionMs);
    const answer = await retrying(
      () => this.unary('markProcessed', { consumer, eventIds: [...eventIds], retention }, options),
      { retry: this.retry, when: isRefusedAtTheDoor, signal: options.signal },
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

  /** One call of `method`, with the token and the deadline; `options.signal` cancels it. */
  private unary<M extends Rpc>(method: M, request: RequestOf<M>, options: CallOptions): Promise<AnswerOf<M>> {
    const { signal } = options;
    const send = this.stub[method] as UnaryMethod<M>;
    return new Promise<AnswerOf<M>>((resolve, reject) => {
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
      const deadline = Date.now() + (options.timeoutMs ?? this.callTimeoutMs);
      const call = send.call(this.stub, request, metadata, { deadline }, (error, answer) => {
        signal?.removeEventListener('abort', onAbort);
        if (cancelled) return;
        if (error) reject(errorFromStatus(error));
        else resolve(answer as AnswerOf<M>);
      });
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }
}

/** The key a lease holds, as Complete, Release and ExtendLease name it. */
function heldKey(
  namespace: string,
  key: string,
  leaseToken: bigint,
): { namespace: string; key: string; leaseToken: string } {
  return { namespace, key, leaseToken: leaseToken.toString() };
}

/** Who holds a key in progress, as TryStart and Lookup answer it. */
function holderOf(inProgress: { leaseExpiresAt?: Timestamp__Output; attempt?: number }): {
  leaseExpiresAt: Date;
  attempt: number;
} {
  return { leaseExpiresAt: dateFromTimestamp(inProgress.leaseExpiresAt), attempt: inProgress.attempt ?? 0 };
}

/** When a key was completed and when it expires, as Complete, TryStart and Lookup answer it. */
function completionTimes(completed: { completedAt?: Timestamp__Output; expiresAt?: Timestamp__Output }): CompletedAt {
  return { completedAt: dateFromTimestamp(completed.completedAt), expiresAt: dateFromTimestamp(completed.expiresAt) };
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

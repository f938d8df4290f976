// runOnce: the whole protocol in one call, on top of the client's one-call-per-RPC methods.
import { randomUUID } from 'node:crypto';

import { Backoff, sleep } from './backoff';
import { jsonCodec, type Codec } from './codec';
import {
  AlreadyCompletedError,
  FingerprintMismatchError,
  InProgressError,
  KeyNotFoundError,
  LeaseLostError,
  RateLimitedError,
  isTransient,
  type CoordinatorError,
} from './errors';
import { fingerprintOf } from './fingerprint';
import type { IdempotencyClient } from './client';
import type { Lease, RetryOptions, RunOnceOptions, RunOnceResult, TryStartOutcome, TryStartRequest } from './types';

const DEFAULT_LEASE_TTL_MS = 30_000;
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

/**
 * runOnce and what it needs beyond the client's calls: waiting for a holder, holding the lease
 * while the work runs, Complete or Release, and retries of the calls that are safe to repeat.
 */
export class RunOnce {
  constructor(
    private readonly client: IdempotencyClient,
    private readonly retry: RetryOptions,
    private readonly callTimeoutMs: number,
  ) {}

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
          return this.client.tryStart({ ...request, waitMs: wait }, { timeoutMs: this.callTimeoutMs + wait, signal });
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
      const outcome = await this.client.tryStart({ ...request, waitMs: 0 });
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
    const lease = new HeldLease(this.client, namespace, key, started, options.leaseTtlMs, options.signal);
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
      await this.withRetries(() => this.client.complete(namespace, key, token, response, { retentionMs }), undefined);
    } catch (error) {
      if (!(error instanceof AlreadyCompletedError)) throw error;
      const state = await this.withRetries(() => this.client.lookup(namespace, key), undefined);
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
      await this.withRetries(() => this.client.release(namespace, key, token), undefined);
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

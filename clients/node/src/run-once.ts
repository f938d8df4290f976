// runOnce: the whole protocol in one call, on top of the client's one-call-per-RPC methods.
import { randomUUID } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import * as grpc from '@grpc/grpc-js';

import { Backoff, retrying, sleep } from './backoff';
import { jsonCodec, type Codec } from './codec';
import { DEFAULTS } from './defaults';
import {
  AlreadyCompletedError,
  CoordinatorError,
  FingerprintMismatchError,
  InProgressError,
  KeyNotFoundError,
  LeaseLostError,
  ResultNotStoredError,
  isTransient,
} from './errors';
import { fingerprintOf } from './fingerprint';
import type { Lease, LeaseCalls, RetryOptions, RunOnceOptions, RunOnceResult, TryStartOutcome, TryStartRequest } from './types';

// Pauses before asking again when the service answered in_progress without waiting (it is at
// its waiter limit): often at first, at most once a second.
const IN_PROGRESS_POLL = { initialMs: 50, maxMs: 1_000, multiplier: 1.5 };
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
 * A TryStart that claimed a key after longer than this fraction of the lease is followed at once
 * by a renewal, before the work starts (docs/contract.md, "A claim that waited"): past it the
 * first heartbeat would have less than two thirds of its margin left.
 */
const RENEW_AFTER_WAITING_FRACTION = 0.1;

/**
 * runOnce and what it needs beyond the client's calls: waiting for a holder, holding the lease
 * while the work runs, Complete or Release, and retries of the calls that are safe to repeat.
 */
export class RunOnce {
  constructor(
    private readonly client: LeaseCalls,
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
    const leaseTtlMs = options.leaseTtlMs ?? DEFAULTS.leaseTtlMs;
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
    const { outcome, askedAt } = await this.claim(request, options.waitMs ?? DEFAULTS.waitMs, options.signal);
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
        return this.runHolding(request, outcome, askedAt, work, codec, {
          leaseTtlMs,
          heartbeatIntervalMs: options.heartbeatIntervalMs ?? leaseTtlMs / DEFAULTS.heartbeatDivisor,
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
   * short pause, so that a full service is not hammered. Answers also when the winning TryStart
   * was first sent (performance.now()), from which the lease is counted.
   */
  private async claim(
    request: TryStartRequest,
    waitMs: number,
    signal: AbortSignal | undefined,
  ): Promise<{ outcome: TryStartOutcome; askedAt: number }> {
    const waitEnds = Date.now() + waitMs;
    const poll = new Backoff(IN_PROGRESS_POLL);
    for (;;) {
      const askedAt = Date.now();
      const askedAtMonotonic = performance.now();
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
      if (outcome.kind !== 'inProgress' || remainingMs < WAIT_SLACK_MS) return { outcome, askedAt: askedAtMonotonic };
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
    askedAt: number,
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
    const lease = new HeldLease(this.client, namespace, key, started, askedAt, options.leaseTtlMs, options.signal);
    // A TryStart that took long (the service held it while another holder had the key) may have
    // left little of the lease as this client counts it: renewed, the work gets it all.
    if (performance.now() - askedAt > options.leaseTtlMs * RENEW_AFTER_WAITING_FRACTION) {
      try {
        await this.renewAfterWaiting(lease, options.signal);
      } catch (error) {
        lease.detach();
        throw error;
      }
    }
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
    try {
      await this.completeHeld(namespace, key, token, codec.encode(value), options.retentionMs);
    } catch (error) {
      // The work ran: its result goes to the caller with the news that it is not stored, unlike
      // a failure before the work, after which nothing happened. A lost lease stays what it is.
      if (error instanceof LeaseLostError || !(error instanceof CoordinatorError)) throw error;
      throw new ResultNotStoredError(value, error);
    }
    return { value, replayed: false };
  }

  /**
   * Renews, before the work starts, a lease whose TryStart took long (docs/contract.md, "A claim
   * that waited"): the service started it when it granted the claim, at an instant this client
   * cannot read off its clock, so the lease is counted from the TryStart's sending and may be
   * nearly over, or over, by the time the answer came. Counted from this renewal's sending
   * instead, the work gets its whole lease.
   *
   * Retried until the lease counted from the TryStart's sending runs out (or the retry budget
   * does). Refused, it throws LeaseLostError; when it cannot get through, the key is released
   * with one try (best effort), so that a retry need not wait for the lease to run out, and its
   * error is thrown. Either way the work does not run.
   */
  private async renewAfterWaiting(lease: HeldLease, signal: AbortSignal | undefined): Promise<void> {
    try {
      await retrying(() => lease.extend(), {
        retry: { ...this.retry, totalMs: Math.min(this.retry.totalMs, lease.msLeft()) },
        when: isTransient,
        signal,
      });
    } catch (error) {
      if (error instanceof LeaseLostError) throw error;
      // One try: the coordinator has just been unreachable for the renewal's whole window.
      try {
        await this.client.release(lease.namespace, lease.key, lease.token);
      } catch {
        // The key frees when its lease runs out; the renewal's error is what the caller needs.
      }
      throw error;
    }
  }

  /**
   * Complete, retried on transient failures (a repeated Complete with the same response
   * succeeds again). ALREADY_COMPLETED counts as success when the stored response is ours: an
   * earlier try of this same Complete got through. A key that is gone (it expired or was
   * released under the work) is a lost lease.
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
      if (error instanceof KeyNotFoundError) throw lostLease(error, 'the key expired or was released while the work ran');
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
   * Repeats `call` while it fails with UNAVAILABLE, DEADLINE_EXCEEDED, RATE_LIMITED or
   * OVERLOADED, with backoff, for at most `retry.totalMs`. Only for calls that are safe to repeat.
   */
  private withRetries<R>(call: () => Promise<R>, signal: AbortSignal | undefined): Promise<R> {
    return retrying(call, { retry: this.retry, when: isTransient, signal });
  }
}

/** The lease runOnce holds while the work runs. */
class HeldLease implements Lease {
  readonly token: bigint;
  readonly attempt: number;
  readonly checkpoint: Buffer | undefined;
  expiresAt: Date;
  lostError: LeaseLostError | undefined;
  /** When the lease runs out at the latest (performance.now()), unless extended. */
  private runsOutAt: number;
  private readonly controller = new AbortController();
  private readonly callerSignal: AbortSignal | undefined;
  private readonly onCallerAbort = () => this.controller.abort(this.callerSignal?.reason);

  constructor(
    private readonly client: LeaseCalls,
    readonly namespace: string,
    readonly key: string,
    started: Extract<TryStartOutcome, { kind: 'started' }>,
    askedAt: number,
    private readonly leaseTtlMs: number,
    callerSignal: AbortSignal | undefined,
  ) {
    // Counted from the TryStart's (first) sending, never from its answer: the service may have
    // started the lease any time in between, so this is never later than its expiry.
    this.runsOutAt = askedAt + leaseTtlMs;
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
    const sentAt = performance.now();
    try {
      this.expiresAt = await this.client.extendLease(this.namespace, this.key, this.token, {
        leaseTtlMs: this.leaseTtlMs,
        checkpoint,
      });
      this.runsOutAt = sentAt + this.leaseTtlMs;
    } catch (error) {
      if (error instanceof LeaseLostError || error instanceof KeyNotFoundError || error instanceof AlreadyCompletedError) {
        this.markLost(error);
        throw this.lostError;
      }
      throw error;
    }
  }

  /** How long the lease has left, as this client counts it (negative once it may have run out). */
  msLeft(): number {
    return this.runsOutAt - performance.now();
  }

  saveCheckpoint(checkpoint: Uint8Array): Promise<void> {
    if (this.lostError) return Promise.reject(this.lostError);
    return this.extend(checkpoint);
  }

  /**
   * After a heartbeat failed for another reason than a lost lease (the coordinator unreachable):
   * once no extension has succeeded for a whole lease, the lease may have run out and another
   * caller may hold the key, so the work is cancelled as for a lost lease. Returns whether it was.
   */
  loseIfRunOut(cause: unknown): boolean {
    if (this.lostError || performance.now() < this.runsOutAt) return this.lostError !== undefined;
    const why = cause instanceof Error ? cause.message : String(cause);
    this.lostError = new LeaseLostError(
      `the lease ran out while the coordinator was unreachable: ${why}`,
      cause instanceof CoordinatorError ? cause.code : grpc.status.UNAVAILABLE,
      {
        reason: cause instanceof CoordinatorError ? cause.reason : undefined,
        fieldViolations: [],
        retryDelayMs: undefined,
      },
      { cause },
    );
    this.controller.abort(this.lostError);
    return true;
  }

  /** Stops following the caller's signal once the run is over. */
  detach(): void {
    this.callerSignal?.removeEventListener('abort', this.onCallerAbort);
  }

  private markLost(cause: CoordinatorError): void {
    if (this.lostError) return;
    // A key that vanished or was completed under our token is lost to us just the same.
    this.lostError = lostLease(cause, 'the lease on this key is lost');
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
    } catch (error) {
      // A lost lease has aborted the work: no more beats. Anything else (the coordinator or its
      // store briefly unreachable) does not mean the lease is gone: a holder nobody replaced
      // may still extend, so try again soon, until no extension has succeeded for a whole
      // lease: then the work is cancelled (loseIfRunOut).
      if (!this.lease.loseIfRunOut(error)) this.schedule(Math.min(this.intervalMs, HEARTBEAT_RETRY_MS));
    }
  }
}

/** A CoordinatorError that means this holder no longer holds the key, as a LeaseLostError. */
function lostLease(cause: CoordinatorError, message: string): LeaseLostError {
  if (cause instanceof LeaseLostError) return cause;
  return new LeaseLostError(
    `${message}: ${cause.message}`,
    cause.code,
    { reason: cause.reason, fieldViolations: [], retryDelayMs: undefined },
    { cause },
  );
}

// Waiting between tries: exponential backoff with jitter (each pause is drawn between a fraction
// of the current step and the whole step, so that callers who failed together do not retry
// together), bounded by a total budget, and cut short by an AbortSignal.
import { DEFAULTS } from './defaults';
import type { RetryOptions } from './types';

export interface BackoffOptions {
  /** The first step. */
  initialMs: number;
  /** The largest step; each pause multiplies the step by `multiplier` until it gets here. */
  maxMs: number;
  multiplier: number;
}

export class Backoff {
  private stepMs: number;

  constructor(private readonly options: BackoffOptions) {
    this.stepMs = options.initialMs;
  }

  /** The next pause: drawn in [jitterLowFraction × step, step], and at least `floorMs`. */
  nextDelayMs(floorMs = 0): number {
    const low = DEFAULTS.retry.jitterLowFraction;
    const delay = Math.max(floorMs, this.stepMs * (low + (1 - low) * Math.random()));
    this.stepMs = Math.min(this.options.maxMs, this.stepMs * Math.max(1, this.options.multiplier));
    return delay;
  }
}

/** Resolves after `ms`, or rejects with the signal's reason as soon as it aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, Math.max(0, ms));
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/**
 * Repeats `call` while it fails with an error `when` accepts, pausing with backoff (at least the
 * error's `retryDelayMs`, the service's RetryInfo), until the next pause would end past
 * `retry.totalMs` from the first try; then the last error is thrown.
 */
export async function retrying<R>(
  call: () => Promise<R>,
  options: { retry: RetryOptions; when: (error: unknown) => boolean; signal?: AbortSignal | undefined },
): Promise<R> {
  const { retry, when, signal } = options;
  const giveUpAt = Date.now() + retry.totalMs;
  const backoff = new Backoff({ initialMs: retry.initialBackoffMs, maxMs: retry.maxBackoffMs, multiplier: retry.multiplier });
  for (;;) {
    try {
      return await call();
    } catch (error) {
      if (!when(error)) throw error;
      const delayMs = backoff.nextDelayMs((error as { retryDelayMs?: number }).retryDelayMs ?? 0);
      if (Date.now() + delayMs > giveUpAt) throw error;
      await sleep(delayMs, signal);
    }
  }
}

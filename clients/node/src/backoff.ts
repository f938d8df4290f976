// Waiting between tries: exponential backoff with full jitter (each pause is drawn uniformly
// between zero and the current ceiling, so that callers who failed together do not retry
// together), bounded by a total deadline, and cut short by an AbortSignal.

export interface BackoffOptions {
  /** The ceiling of the first pause. */
  initialMs: number;
  /** The largest ceiling; it doubles after every pause until it gets here. */
  maxMs: number;
}

export class Backoff {
  private ceilingMs: number;

  constructor(private readonly options: BackoffOptions) {
    this.ceilingMs = options.initialMs;
  }

  /** The next pause: uniformly drawn in [0, ceiling), at least `floorMs`. */
  nextDelayMs(floorMs = 0): number {
    const delay = Math.max(floorMs, Math.random() * this.ceilingMs);
    this.ceilingMs = Math.min(this.options.maxMs, this.ceilingMs * 2);
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

// The defaults every client of the coordinator shares: clients/conformance/defaults.json (the
// table in docs/contract.md, "Client defaults"), which a test compares with these.

export const DEFAULTS = Object.freeze({
  /** The deadline of one call; a waiting TryStart gets its wait on top. */
  callTimeoutMs: 10_000,
  retry: Object.freeze({
    /** All the tries of one call, pauses included, stop within this. */
    budgetMs: 30_000,
    initialBackoffMs: 50,
    maxBackoffMs: 2_000,
    multiplier: 2,
    /** Each pause is drawn between this fraction of its step and the whole step. */
    jitterLowFraction: 0.5,
  }),
  /** The lease runOnce asks for. */
  leaseTtlMs: 30_000,
  /** runOnce extends the lease every `leaseTtlMs / heartbeatDivisor`. */
  heartbeatDivisor: 3,
  /** How long runOnce waits for another holder (0: InProgressError at once). */
  waitMs: 0,
});

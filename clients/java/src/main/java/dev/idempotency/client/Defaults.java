package dev.idempotency.client;

import java.time.Duration;

/**
 * The defaults every client of the coordinator uses, as {@code clients/conformance/defaults.json}
 * pins them (a test compares the two).
 */
public final class Defaults {
  /** The deadline of one call; a TryStart that asks the coordinator to wait gets the wait on top. */
  public static final Duration CALL_TIMEOUT = Duration.ofSeconds(10);

  /** How calls that may be sent again are retried: 50 ms doubling up to 2 s, within 30 s. */
  public static final RetryPolicy RETRY_POLICY =
      new RetryPolicy(Duration.ofMillis(50), Duration.ofSeconds(2), 2.0, 0.5, Duration.ofSeconds(30));

  /** The lease {@code runOnce} asks for. */
  public static final Duration LEASE_TTL = Duration.ofSeconds(30);

  /** {@code runOnce} extends the lease every {@code lease / HEARTBEAT_DIVISOR}. */
  public static final int HEARTBEAT_DIVISOR = 3;

  /** How long {@code runOnce} waits for another holder: not at all (in progress at once). */
  public static final Duration WAIT = Duration.ZERO;

  private Defaults() {}
}

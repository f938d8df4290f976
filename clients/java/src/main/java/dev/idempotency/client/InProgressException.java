package dev.idempotency.client;

import java.time.Duration;
import java.time.Instant;

/**
 * {@code runOnce}: another caller still holds the key after the wait. An HTTP API answers 409 with
 * {@code Retry-After}.
 */
public final class InProgressException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  /** When the holder's lease runs out. */
  private final Instant leaseExpiresAt;
  /** The holder's attempt. */
  private final long attempt;
  /** The time until the holder's lease runs out. */
  private final Duration retryAfter;

  InProgressException(Details details, Instant leaseExpiresAt, long attempt, Duration retryAfter) {
    super(details);
    this.leaseExpiresAt = leaseExpiresAt;
    this.attempt = attempt;
    this.retryAfter = retryAfter;
  }

  /**
   * When the holder's lease runs out, by the coordinator's clock.
   *
   * @return the instant
   */
  public Instant leaseExpiresAt() {
    return leaseExpiresAt;
  }

  /**
   * The holder's attempt: 1, or more after takeovers.
   *
   * @return the attempt
   */
  public long attempt() {
    return attempt;
  }

  /**
   * The time until the holder's lease runs out by this machine's clock: the latest a retry could
   * take the key over. Zero when it has already run out (the next try may take over).
   *
   * @return the duration, never negative
   */
  public Duration retryAfter() {
    return retryAfter;
  }
}

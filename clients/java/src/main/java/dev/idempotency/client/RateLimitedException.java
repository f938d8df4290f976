package dev.idempotency.client;

/**
 * {@code RESOURCE_EXHAUSTED} / {@code RATE_LIMITED}: the caller is over its rate limit, after the retries
 * ran out; {@link #retryDelay()} says when the next call is allowed.
 */
public final class RateLimitedException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  RateLimitedException(Details details) {
    super(details);
  }
}

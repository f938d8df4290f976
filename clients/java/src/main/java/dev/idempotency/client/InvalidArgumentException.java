package dev.idempotency.client;

/**
 * {@code INVALID_ARGUMENT} / {@code INVALID_ARGUMENT}: the coordinator found a field missing, malformed or out of
 * bounds ({@link #violations()} names each). Nothing was written. The client's own checks throw
 * {@link IllegalArgumentException} instead, before anything is sent.
 */
public final class InvalidArgumentException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  InvalidArgumentException(Details details) {
    super(details);
  }

}

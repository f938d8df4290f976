package dev.idempotency.client;

/**
 * {@code RESOURCE_EXHAUSTED} / {@code OVERLOADED}: the coordinator's budget of unsent responses is full,
 * after the retries ran out. Nothing was written.
 */
public final class OverloadedException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  OverloadedException(Details details) {
    super(details);
  }
}

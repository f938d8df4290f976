package dev.idempotency.client;

/**
 * {@code FAILED_PRECONDITION} / {@code ALREADY_COMPLETED}: the key holds another result (Complete with
 * another response, Release or ExtendLease of a completed key).
 */
public final class AlreadyCompletedException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  AlreadyCompletedException(Details details) {
    super(details);
  }

}

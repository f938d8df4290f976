package dev.idempotency.client;

/**
 * {@code DEADLINE_EXCEEDED}: a call did not answer within the call timeout, after the retries ran out.
 */
public final class DeadlineExceededException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  DeadlineExceededException(Details details) {
    super(details);
  }
}

package dev.idempotency.client;

/**
 * {@code INTERNAL}: an unexpected failure inside the coordinator, a bug to report.
 */
public final class InternalException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  InternalException(Details details) {
    super(details);
  }

}

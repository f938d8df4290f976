package dev.idempotency.client;

/**
 * The caller gave up: its thread was interrupted while it waited for the coordinator (the
 * interrupt flag is set again), or it cancelled the future; or the call was cancelled
 * ({@code CANCELLED}). What was sent may or may not have been applied.
 */
public final class CancelledException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  CancelledException(Details details) {
    super(details);
  }
}

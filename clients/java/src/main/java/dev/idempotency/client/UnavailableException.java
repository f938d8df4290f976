package dev.idempotency.client;

/**
 * {@code UNAVAILABLE}: the coordinator (or, for {@link StoreUnavailableException}, its store) could not
 * be reached, after the retries ran out.
 */
public sealed class UnavailableException extends IdempotencyException
    permits StoreUnavailableException {
  private static final long serialVersionUID = 1L;

  UnavailableException(Details details) {
    super(details);
  }
}

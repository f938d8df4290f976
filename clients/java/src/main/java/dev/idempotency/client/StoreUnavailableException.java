package dev.idempotency.client;

/**
 * {@code UNAVAILABLE} / {@code STORE_UNAVAILABLE}: the coordinator could not reach its store in time;
 * nothing was written. It is an {@link UnavailableException} too.
 */
public final class StoreUnavailableException extends UnavailableException {
  private static final long serialVersionUID = 1L;

  StoreUnavailableException(Details details) {
    super(details);
  }
}

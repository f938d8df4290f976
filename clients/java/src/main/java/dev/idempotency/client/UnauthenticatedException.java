package dev.idempotency.client;

/**
 * {@code UNAUTHENTICATED}: no bearer token, or one the coordinator does not know.
 */
public final class UnauthenticatedException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  UnauthenticatedException(Details details) {
    super(details);
  }

}

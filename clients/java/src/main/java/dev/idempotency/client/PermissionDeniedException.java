package dev.idempotency.client;

/**
 * {@code PERMISSION_DENIED}: the token does not hold this namespace or consumer.
 */
public final class PermissionDeniedException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  PermissionDeniedException(Details details) {
    super(details);
  }

}

package dev.idempotency.client;

/**
 * {@code NOT_FOUND} / {@code KEY_NOT_FOUND}: Complete, Release or ExtendLease of an absent or expired key.
 */
public final class KeyNotFoundException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  KeyNotFoundException(Details details) {
    super(details);
  }

}

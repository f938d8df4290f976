package dev.idempotency.client;

/**
 * {@code runOnce}: the key was claimed for a different request (its fingerprint differs). Nothing
 * changed. An HTTP API answers 422.
 */
public final class FingerprintMismatchException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  FingerprintMismatchException(Details details) {
    super(details);
  }
}

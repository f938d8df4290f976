package dev.idempotency.client;

/**
 * {@code runOnce}: the stored result cannot be decoded by the codec given (it was written by
 * another program, or by another version of this one), or the work's result cannot be encoded
 * (the key was then released). The cause is the codec's failure.
 */
public final class ResultCodecException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  ResultCodecException(Details details) {
    super(details);
  }
}

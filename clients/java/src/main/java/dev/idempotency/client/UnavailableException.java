package dev.idempotency.client;

/**
 * {@code UNAVAILABLE}: the coordinator (or, for {@link StoreUnavailableException}, its store) could not
 * be reached, after the retries ran out. A connection that broke under a call is one too: grpc-java's
 * Netty transport reports it as {@code UNKNOWN} "channel closed", which {@link #status()} keeps as
 * received while {@link #code()} is {@code UNAVAILABLE}.
 */
public sealed class UnavailableException extends IdempotencyException
    permits StoreUnavailableException {
  private static final long serialVersionUID = 1L;

  UnavailableException(Details details) {
    super(details);
  }
}

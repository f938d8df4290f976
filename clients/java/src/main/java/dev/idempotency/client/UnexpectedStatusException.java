package dev.idempotency.client;

/**
 * A status the contract does not list for this call (for example {@code RESOURCE_EXHAUSTED} without a
 * reason, which gRPC itself answers for a message over its size limit, or {@code UNKNOWN} from a
 * proxy). Not retried.
 */
public final class UnexpectedStatusException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  UnexpectedStatusException(Details details) {
    super(details);
  }

}

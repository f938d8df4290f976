package dev.idempotency.client;

/**
 * This caller no longer holds the key: {@code ABORTED} / {@code LEASE_LOST} from the coordinator,
 * or, made by {@code runOnce}, a lease that may have run out while the coordinator could not be
 * reached (the cause says why). The new holder owns the key's result: stop, and retry later to
 * get it. {@code runOnce} releases nothing then.
 */
public final class LeaseLostException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  LeaseLostException(Details details) {
    super(details);
  }
}

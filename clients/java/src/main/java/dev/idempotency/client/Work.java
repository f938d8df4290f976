package dev.idempotency.client;

/**
 * The work {@code runOnce} runs at most once, on the caller's thread, while it holds the key.
 *
 * <p>When the lease is lost (or may have run out while the coordinator could not be reached) the
 * thread is interrupted and {@link Lease#isLost()} turns true; work that does not block should
 * poll it. Whatever the work throws is rethrown as it is, after the key is released.
 *
 * @param <T> the result's type
 * @param <E> what the work may throw (inferred; {@code RuntimeException} for work that throws
 *     nothing checked)
 */
@FunctionalInterface
public interface Work<T, E extends Exception> {
  /**
   * Does the work.
   *
   * @param lease the claim it runs under
   * @return the result, stored for every retry of the key
   * @throws E the work's own failure: the key is released, so that a retry starts fresh
   */
  T run(Lease lease) throws E;
}

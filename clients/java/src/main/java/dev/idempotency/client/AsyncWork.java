package dev.idempotency.client;

import java.util.concurrent.CompletionStage;

/**
 * The work {@code runOnceAsync} runs at most once while it holds the key: it starts the work and
 * returns at once with its future. When the lease is lost the future is cancelled (with {@code
 * mayInterruptIfRunning} true) and {@link Lease#isLost()} turns true.
 *
 * @param <T> the result's type
 */
@FunctionalInterface
public interface AsyncWork<T> {
  /**
   * Starts the work; it must not block.
   *
   * @param lease the claim it runs under
   * @return the work's future: its value is stored, its failure releases the key
   */
  CompletionStage<T> start(Lease lease);
}

package dev.idempotency.client;

import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;

/**
 * How the blocking API waits for the asynchronous one: the future's failure is thrown as the
 * exception the API documents, never wrapped.
 */
final class Futures {
  private Futures() {}

  /**
   * Waits for a call; an interrupt cancels it, sets the flag again and throws {@link
   * CancelledException}.
   */
  static <T> T await(String op, CompletableFuture<T> future) {
    try {
      return future.get();
    } catch (InterruptedException e) {
      future.cancel(true);
      Thread.currentThread().interrupt();
      throw Errors.cancelled(op, "the caller's thread was interrupted", e);
    } catch (ExecutionException | CancellationException e) {
      throw rethrow(Errors.asApiFailure(op, e));
    }
  }

  /** Waits for a call that must not be abandoned half-way; an interrupt is kept for after. */
  static <T> T awaitUninterruptibly(String op, CompletableFuture<T> future) {
    boolean interrupted = false;
    try {
      while (true) {
        try {
          return future.get();
        } catch (InterruptedException e) {
          interrupted = true;
        } catch (ExecutionException | CancellationException e) {
          throw rethrow(Errors.asApiFailure(op, e));
        }
      }
    } finally {
      if (interrupted) {
        Thread.currentThread().interrupt();
      }
    }
  }

  /**
   * Throws {@code t} as it is. Checked exceptions reach here only from the work, whose signature
   * declares them ({@code Work<T, E>}), so rethrowing them unchecked keeps the caller's contract.
   */
  private static RuntimeException rethrow(Throwable t) {
    if (t instanceof RuntimeException r) {
      throw r;
    }
    if (t instanceof Error e) {
      throw e;
    }
    throw Futures.<RuntimeException>sneaky(t);
  }

  @SuppressWarnings("unchecked")
  private static <X extends Throwable> X sneaky(Throwable t) throws X {
    throw (X) t;
  }
}

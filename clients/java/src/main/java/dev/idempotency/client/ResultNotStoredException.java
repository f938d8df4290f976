package dev.idempotency.client;

/**
 * {@code runOnce}: the work ran and returned {@link #result()}, but Complete could not store it
 * (the coordinator stayed unreachable for the whole retry budget, or refused the response, say
 * for its size). Only the result was lost: the claim stays until its lease runs out, and a retry
 * after that runs the work again. The cause is Complete's own failure.
 */
public final class ResultNotStoredException extends IdempotencyException {
  private static final long serialVersionUID = 1L;

  private final transient Object result;

  ResultNotStoredException(Details details, Object result) {
    super(details);
    this.result = result;
  }

  /**
   * The work's result, which the caller may still answer with.
   *
   * @return the result, as the work returned it
   */
  public Object result() {
    return result;
  }

  /**
   * The work's result as its type.
   *
   * @param <T> the result's type
   * @param type the result's class
   * @return the result
   * @throws ClassCastException if the result is not a {@code type}
   */
  public <T> T result(Class<T> type) {
    return type.cast(result);
  }
}

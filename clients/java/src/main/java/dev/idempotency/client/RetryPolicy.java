package dev.idempotency.client;

import java.time.Duration;
import java.util.Objects;

/**
 * How a call that failed with {@code UNAVAILABLE}, {@code DEADLINE_EXCEEDED} or
 * {@code RESOURCE_EXHAUSTED} ({@code RATE_LIMITED}, {@code OVERLOADED}) is sent again: pauses from
 * {@code initialBackoff}, growing by {@code multiplier} up to {@code maxBackoff}, each drawn
 * between {@code jitterLowFraction} of the step and the whole step (so that callers that failed
 * together do not retry together), for at most {@code budget} in all, pauses included. A
 * {@code RetryInfo} from the coordinator lengthens a pause, never shortens it.
 *
 * @param initialBackoff the first step, positive
 * @param maxBackoff the largest step, at least {@code initialBackoff}
 * @param multiplier how much each step grows, at least 1
 * @param jitterLowFraction the lowest fraction of a step a pause may be, 0 to 1
 * @param budget all the tries of one call, pauses included; zero: no retries
 */
public record RetryPolicy(
    Duration initialBackoff,
    Duration maxBackoff,
    double multiplier,
    double jitterLowFraction,
    Duration budget) {

  /**
   * Checks the policy.
   *
   * @param initialBackoff the first step, positive
   * @param maxBackoff the largest step, at least {@code initialBackoff}
   * @param multiplier how much each step grows, at least 1
   * @param jitterLowFraction the lowest fraction of a step a pause may be, 0 to 1
   * @param budget all the tries of one call, pauses included; zero: no retries
   * @throws IllegalArgumentException for a policy out of its bounds
   */
  public RetryPolicy {
    Objects.requireNonNull(initialBackoff, "initialBackoff");
    Objects.requireNonNull(maxBackoff, "maxBackoff");
    Objects.requireNonNull(budget, "budget");
    if (initialBackoff.isNegative() || initialBackoff.isZero()) {
      throw new IllegalArgumentException("the initial backoff must be positive (got " + initialBackoff + ")");
    }
    if (maxBackoff.compareTo(initialBackoff) < 0) {
      throw new IllegalArgumentException("the max backoff must be at least the initial backoff");
    }
    if (!(multiplier >= 1.0) || Double.isInfinite(multiplier)) {
      throw new IllegalArgumentException("the multiplier must be at least 1 (got " + multiplier + ")");
    }
    if (!(jitterLowFraction >= 0.0 && jitterLowFraction <= 1.0)) {
      throw new IllegalArgumentException("the jitter fraction must be within 0-1 (got " + jitterLowFraction + ")");
    }
    if (budget.isNegative()) {
      throw new IllegalArgumentException("the retry budget must not be negative (got " + budget + ")");
    }
  }

  /**
   * This policy with another budget.
   *
   * @param newBudget all the tries of one call, pauses included; zero: no retries
   * @return the policy
   */
  public RetryPolicy withBudget(Duration newBudget) {
    return new RetryPolicy(initialBackoff, maxBackoff, multiplier, jitterLowFraction, newBudget);
  }
}

package dev.idempotency.client;

/**
 * What {@code runOnce} returns.
 *
 * @param <T> the result's type
 * @param value the result
 * @param replayed true when it was replayed from an earlier run, false when this call's own work
 *     produced it
 */
public record Outcome<T>(T value, boolean replayed) {}

package dev.idempotency.client;

import java.time.Instant;

/**
 * When a key was completed and until when it is kept.
 *
 * @param completedAt when the key was completed
 * @param expiresAt until when it is kept
 */
public record Completion(Instant completedAt, Instant expiresAt) {}

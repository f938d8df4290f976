package dev.idempotency.client;

import java.time.Instant;

/**
 * A key as Lookup sees it. Byte arrays are handed over as received, not copied.
 */
public sealed interface KeyState {

  /** Never claimed, released, or past its retention. */
  record Absent() implements KeyState {}

  /**
   * Claimed and not completed; the lease may have run out (nobody took over yet).
   *
   * @param leaseExpiresAt when the holder's lease runs out
   * @param attempt the holder's attempt
   * @param fingerprint the fingerprint it was claimed with
   */
  record InProgress(Instant leaseExpiresAt, long attempt, byte[] fingerprint) implements KeyState {}

  /**
   * Holds a response.
   *
   * @param response the stored response
   * @param fingerprint the fingerprint it was claimed with
   * @param completedAt when it was completed
   * @param expiresAt until when it is kept
   */
  record Completed(byte[] response, byte[] fingerprint, Instant completedAt, Instant expiresAt)
      implements KeyState {}
}

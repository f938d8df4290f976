package dev.idempotency.client;

import java.time.Instant;
import java.util.Optional;

/**
 * What a TryStart answered. Outcomes are answers, not errors: switch on the type.
 *
 * <p>Byte arrays are handed over as received, not copied.
 */
public sealed interface Claim {

  /**
   * The caller holds the key.
   *
   * @param token the fencing token: strictly increasing per key, never reused
   * @param attempt 1 for a fresh claim, one more for every takeover
   * @param leaseExpiresAt when this claim's lease runs out, by the coordinator's clock
   * @param checkpoint what a previous holder saved before it released or its lease ran out
   * @param attemptId the attempt id that was sent (the client makes one when none was given)
   */
  record Started(long token, long attempt, Instant leaseExpiresAt, Optional<byte[]> checkpoint, String attemptId)
      implements Claim {}

  /**
   * Another caller holds the key.
   *
   * @param leaseExpiresAt when the holder's lease runs out (it may be past: nobody took over yet)
   * @param attempt the holder's attempt
   */
  record InProgress(Instant leaseExpiresAt, long attempt) implements Claim {}

  /**
   * The key holds a response.
   *
   * @param response the stored response
   * @param completedAt when it was completed
   * @param expiresAt until when it is kept
   */
  record Completed(byte[] response, Instant completedAt, Instant expiresAt) implements Claim {}

  /** The key was claimed for a different request. Nothing changed. */
  record FingerprintMismatch() implements Claim {}
}

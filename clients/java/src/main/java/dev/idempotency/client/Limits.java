package dev.idempotency.client;

import java.time.Duration;

/**
 * The contract's bounds (docs/contract.md, "Names" and "Limits and defaults"). The client checks
 * them before it sends anything, so that bad input fails at once with the field named, changes
 * nothing and costs no round trip; the coordinator checks them again.
 */
public final class Limits {
  /** The shortest lease. */
  public static final Duration MIN_LEASE = Duration.ofMillis(100);
  /** The longest lease. */
  public static final Duration MAX_LEASE = Duration.ofHours(24);
  /** The shortest retention. */
  public static final Duration MIN_RETENTION = Duration.ofSeconds(1);
  /** The longest retention. */
  public static final Duration MAX_RETENTION = Duration.ofDays(30);
  /** The longest wait one TryStart may ask the coordinator for. */
  public static final Duration MAX_SERVER_WAIT = Duration.ofSeconds(60);
  /** The longest namespace or consumer, in characters of {@code A-Z a-z 0-9 . _ - :}. */
  public static final int MAX_SCOPE_LENGTH = 64;
  /** The longest key or event id, in UTF-8 bytes. */
  public static final int MAX_KEY_BYTES = 255;
  /** The longest attempt id, in UTF-8 bytes. */
  public static final int MAX_ATTEMPT_ID_BYTES = 128;
  /** The longest fingerprint, in bytes. */
  public static final int MAX_FINGERPRINT_BYTES = 64;
  /** The largest checkpoint, in bytes. */
  public static final int MAX_CHECKPOINT_BYTES = 64 * 1024;
  /** The most event ids one MarkProcessed may carry. */
  public static final int MAX_EVENT_IDS = 1000;

  private Limits() {}
}

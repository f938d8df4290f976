package dev.idempotency.client;

import java.time.Duration;
import java.util.Objects;

/**
 * How one {@code runOnce} or {@code processOnce} runs. Unset values take the client's defaults
 * ({@link IdempotencyClient.Builder#defaultLease}, {@link IdempotencyClient.Builder#defaultWait})
 * or the coordinator's (retention). Checked when {@code runOnce} is called.
 *
 * @param lease how long the claim is held without a heartbeat (100 ms – 24 h), or null
 * @param retention how long the key is kept (1 s – 30 d), or null for the coordinator's (24 h)
 * @param maxWait how long to wait for another holder before {@link InProgressException} (≥ 0), or
 *     null
 * @param heartbeat the interval of the heartbeat, or null for a third of the lease
 * @param heartbeatOff true to send no ExtendLease while the work runs (for work well within its
 *     lease); the work is still stopped when the lease runs out
 * @param fingerprint the fingerprint to send (at most 64 bytes) instead of hashing the request,
 *     or null
 */
public record RunOptions(
    Duration lease, Duration retention, Duration maxWait, Duration heartbeat, boolean heartbeatOff, byte[] fingerprint) {

  private static final RunOptions DEFAULTS = new RunOptions(null, null, null, null, false, null);

  /**
   * Every value unset.
   *
   * @return the options
   */
  public static RunOptions defaults() {
    return DEFAULTS;
  }

  /**
   * A builder, with every value unset.
   *
   * @return the builder
   */
  public static Builder builder() {
    return new Builder();
  }

  /** Builds {@link RunOptions}. */
  public static final class Builder {
    private Duration lease;
    private Duration retention;
    private Duration maxWait;
    private Duration heartbeat;
    private boolean heartbeatOff;
    private byte[] fingerprint;

    private Builder() {}

    /**
     * Sets the lease.
     *
     * @param value 100 ms – 24 h
     * @return this builder
     */
    public Builder lease(Duration value) {
      this.lease = Objects.requireNonNull(value, "lease");
      return this;
    }

    /**
     * Sets the retention.
     *
     * @param value 1 s – 30 d
     * @return this builder
     */
    public Builder retention(Duration value) {
      this.retention = Objects.requireNonNull(value, "retention");
      return this;
    }

    /**
     * Sets how long to wait for another holder; the coordinator holds each TryStart until the
     * holder completes, releases or loses its lease (up to 60 s per TryStart; a longer wait asks
     * again), so nothing polls.
     *
     * @param value zero or more
     * @return this builder
     */
    public Builder maxWait(Duration value) {
      this.maxWait = Objects.requireNonNull(value, "maxWait");
      return this;
    }

    /**
     * Extends the lease at this interval instead of every third of it.
     *
     * @param interval positive
     * @return this builder
     */
    public Builder heartbeat(Duration interval) {
      this.heartbeat = Objects.requireNonNull(interval, "heartbeat");
      this.heartbeatOff = false;
      return this;
    }

    /**
     * Sends no heartbeat: only for work well within its lease.
     *
     * @return this builder
     */
    public Builder withoutHeartbeat() {
      this.heartbeatOff = true;
      return this;
    }

    /**
     * Sends this fingerprint instead of hashing the request.
     *
     * @param value at most 64 bytes
     * @return this builder
     */
    public Builder fingerprint(byte[] value) {
      this.fingerprint = Objects.requireNonNull(value, "fingerprint").clone();
      return this;
    }

    /**
     * The options.
     *
     * @return the options
     */
    public RunOptions build() {
      return new RunOptions(lease, retention, maxWait, heartbeat, heartbeatOff, fingerprint);
    }
  }
}

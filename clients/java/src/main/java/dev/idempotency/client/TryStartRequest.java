package dev.idempotency.client;

import java.time.Duration;
import java.util.Objects;

/**
 * A TryStart. Null durations are absent: the coordinator's defaults apply.
 *
 * @param namespace the scope: 1–64 characters of {@code A-Z a-z 0-9 . _ - :}
 * @param key 1–255 bytes of UTF-8 without control characters
 * @param fingerprint at most 64 bytes; empty matches only empty
 * @param leaseTtl 100 ms – 24 h, or null for the coordinator's (30 s)
 * @param retention 1 s – 30 d, or null for the coordinator's (24 h)
 * @param attemptId at most 128 bytes; null makes one, so that the client's own retries of a try
 *     whose answer was lost get the claim back
 * @param maxWait 0 – 60 s: how long the coordinator may hold the call for another holder, or null
 */
public record TryStartRequest(
    String namespace, String key, byte[] fingerprint, Duration leaseTtl, Duration retention, String attemptId,
    Duration maxWait) {

  /**
   * A builder for a namespace and key.
   *
   * @param namespace the scope
   * @param key the key
   * @return the builder
   */
  public static Builder builder(String namespace, String key) {
    return new Builder(namespace, key);
  }

  /** Builds a {@link TryStartRequest}. */
  public static final class Builder {
    private final String namespace;
    private final String key;
    private byte[] fingerprint = new byte[0];
    private Duration leaseTtl;
    private Duration retention;
    private String attemptId;
    private Duration maxWait;

    private Builder(String namespace, String key) {
      this.namespace = namespace;
      this.key = key;
    }

    /**
     * Sets the fingerprint.
     *
     * @param value at most 64 bytes
     * @return this builder
     */
    public Builder fingerprint(byte[] value) {
      this.fingerprint = Objects.requireNonNull(value, "fingerprint");
      return this;
    }

    /**
     * Sets the lease.
     *
     * @param value 100 ms – 24 h
     * @return this builder
     */
    public Builder leaseTtl(Duration value) {
      this.leaseTtl = value;
      return this;
    }

    /**
     * Sets the retention.
     *
     * @param value 1 s – 30 d
     * @return this builder
     */
    public Builder retention(Duration value) {
      this.retention = value;
      return this;
    }

    /**
     * Sets the attempt id.
     *
     * @param value at most 128 bytes
     * @return this builder
     */
    public Builder attemptId(String value) {
      this.attemptId = value;
      return this;
    }

    /**
     * Sets the server-side wait.
     *
     * @param value 0 – 60 s
     * @return this builder
     */
    public Builder maxWait(Duration value) {
      this.maxWait = value;
      return this;
    }

    /**
     * The request.
     *
     * @return the request
     */
    public TryStartRequest build() {
      return new TryStartRequest(namespace, key, fingerprint, leaseTtl, retention, attemptId, maxWait);
    }
  }
}

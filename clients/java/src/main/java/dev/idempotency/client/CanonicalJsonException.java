package dev.idempotency.client;

import java.util.Locale;

/**
 * A value or JSON text that has no RFC 8785 canonical form this client will hash: refused rather
 * than rounded or mangled, so that two different requests never share a fingerprint. The kinds
 * are the ones the conformance vectors ({@code clients/conformance/fingerprints.json}) name.
 */
public final class CanonicalJsonException extends IllegalArgumentException {
  private static final long serialVersionUID = 1L;

  /** Why there is no canonical form. */
  public enum Kind {
    /** An integer beyond ±(2^53−1): a double would round it. Send it as a string. */
    UNSAFE_INTEGER,
    /** A number beyond the largest double, or NaN or an infinity. */
    NUMBER_OUT_OF_RANGE,
    /** A string with a lone UTF-16 surrogate, which UTF-8 cannot hold. */
    LONE_SURROGATE,
    /** A member name twice in one object (of a JSON text). */
    DUPLICATE_KEY,
    /** A text that is not JSON. */
    INVALID_JSON,
    /** A value that does not map to JSON. */
    NOT_JSON;

    /**
     * The kind as the conformance vectors spell it.
     *
     * @return for example {@code unsafe_integer}
     */
    public String code() {
      return name().toLowerCase(Locale.ROOT);
    }
  }

  /** Why there is no canonical form. */
  private final Kind kind;

  CanonicalJsonException(Kind kind, String message) {
    super(kind.code() + ": " + message);
    this.kind = kind;
  }

  CanonicalJsonException(Kind kind, String message, Throwable cause) {
    super(kind.code() + ": " + message, cause);
    this.kind = kind;
  }

  /**
   * Why there is no canonical form.
   *
   * @return the kind
   */
  public Kind kind() {
    return kind;
  }
}

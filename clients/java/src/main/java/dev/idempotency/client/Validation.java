package dev.idempotency.client;

import java.nio.charset.StandardCharsets;
import java.time.Duration;

/**
 * The client's own checks of the contract's bounds, made before anything is sent: bad input
 * fails at once with an {@link IllegalArgumentException} that names the field, and changes
 * nothing.
 */
final class Validation {
  static final long MAX_TOKEN = Long.MAX_VALUE; // 2^63 − 1: tokens are PostgreSQL bigints

  private Validation() {}

  static IllegalArgumentException invalid(String field, String description) {
    return new IllegalArgumentException(field + ": " + description);
  }

  /** 1–64 characters of A-Z a-z 0-9 . _ - : */
  static void scope(String field, String scope) {
    if (scope == null || scope.isEmpty() || scope.length() > Limits.MAX_SCOPE_LENGTH) {
      throw invalid(
          field,
          "must be 1-" + Limits.MAX_SCOPE_LENGTH + " characters (got " + (scope == null ? "null" : scope.length()) + ")");
    }
    for (int i = 0; i < scope.length(); i++) {
      char c = scope.charAt(i);
      boolean ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
          || c == '.' || c == '_' || c == '-' || c == ':';
      if (!ok) {
        throw invalid(field, "may hold only A-Z a-z 0-9 . _ - :");
      }
    }
  }

  /**
   * 1–limit bytes of UTF-8 without control characters (Unicode category Cc: U+0000–U+001F,
   * U+007F–U+009F) and without lone surrogates (which UTF-8 cannot carry). Empty is allowed only
   * where the field is optional.
   */
  static void text(String field, String text, int limit, boolean optional) {
    if (text == null || text.isEmpty()) {
      if (optional) {
        return;
      }
      throw invalid(field, "must not be empty");
    }
    for (int i = 0; i < text.length(); i++) {
      char c = text.charAt(i);
      if (c < 0x20 || (c >= 0x7f && c <= 0x9f)) {
        throw invalid(field, "must not hold control characters");
      }
      if (Character.isHighSurrogate(c) && i + 1 < text.length() && Character.isLowSurrogate(text.charAt(i + 1))) {
        i++;
      } else if (Character.isSurrogate(c)) {
        throw invalid(field, "must be valid Unicode (it holds a lone surrogate)");
      }
    }
    int bytes = text.getBytes(StandardCharsets.UTF_8).length;
    if (bytes > limit) {
      throw invalid(field, "must be at most " + limit + " bytes of UTF-8 (got " + bytes + ")");
    }
  }

  static void key(String scopeField, String scope, String key) {
    scope(scopeField, scope);
    text("key", key, Limits.MAX_KEY_BYTES, false);
  }

  static void token(long token) {
    if (token <= 0) {
      throw invalid("lease_token", "must be a token from TryStart (1 to 2^63-1; got " + Long.toUnsignedString(token) + ")");
    }
  }

  /** A duration within [low, high]; null means absent where it is optional. */
  static void duration(String field, Duration d, Duration low, Duration high, boolean optional) {
    if (d == null) {
      if (optional) {
        return;
      }
      throw invalid(field, "must be given");
    }
    if (d.compareTo(low) < 0 || d.compareTo(high) > 0) {
      throw invalid(field, "must be between " + low + " and " + high + " (got " + d + ")");
    }
  }

  static void lease(String field, Duration d, boolean optional) {
    duration(field, d, Limits.MIN_LEASE, Limits.MAX_LEASE, optional);
  }

  static void retention(String field, Duration d, boolean optional) {
    duration(field, d, Limits.MIN_RETENTION, Limits.MAX_RETENTION, optional);
  }

  static void notNegative(String field, Duration d) {
    if (d != null && d.isNegative()) {
      throw invalid(field, "must not be negative (got " + d + ")");
    }
  }

  static void bytes(String field, byte[] b, int limit) {
    if (b != null && b.length > limit) {
      throw invalid(field, "must be at most " + limit + " bytes (got " + b.length + ")");
    }
  }

  static <T> T notNull(String field, T value) {
    if (value == null) {
      throw invalid(field, "must not be null");
    }
    return value;
  }
}

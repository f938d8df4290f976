package dev.idempotency.client.servlet;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.HexFormat;
import java.util.List;

/**
 * The key of a request, its scope and its fingerprint, byte for byte as the gateway makes them
 * (gateway/src/key.rs), so that a key recorded by one is replayed by the other.
 */
final class HttpKeys {
  private HttpKeys() {}

  /** Why a request's key header cannot be used (each is a 400), or the key. */
  sealed interface KeyRead {}

  record Key(String value) implements KeyRead {}

  record Missing() implements KeyRead {}

  record Repeated() implements KeyRead {}

  record Malformed(String detail) implements KeyRead {}

  /**
   * Reads the key from the header's values (as bytes, ISO-8859-1 as servlet containers give
   * them): an RFC 9651 sf-string ({@code "abc"}, parameters ignored) or sf-token, or, for the many
   * clients that send one unquoted, a bare value of token characters plus {@code : / =}. At most
   * {@code maxLength} bytes, never empty.
   */
  static KeyRead readKey(List<String> values, int maxLength) {
    if (values.isEmpty()) {
      return new Missing();
    }
    if (values.size() > 1) {
      return new Repeated();
    }
    byte[] raw = values.get(0).getBytes(StandardCharsets.ISO_8859_1);
    String key = sfStringOrToken(raw);
    if (key == null) {
      key = bareKey(raw);
      if (key == null) {
        return new Malformed("the key must be a quoted string (\"...\") or a bare token");
      }
    }
    if (key.isEmpty()) {
      return new Malformed("the key is empty");
    }
    if (key.getBytes(StandardCharsets.UTF_8).length > maxLength) {
      return new Malformed("the key is longer than " + maxLength + " bytes");
    }
    return new Key(key);
  }

  /** A bare key: RFC 9110 token characters plus {@code : / =}, surrounding spaces and tabs ignored. */
  private static String bareKey(byte[] raw) {
    int start = 0;
    int end = raw.length;
    while (start < end && (raw[start] == ' ' || raw[start] == '\t')) {
      start++;
    }
    while (end > start && (raw[end - 1] == ' ' || raw[end - 1] == '\t')) {
      end--;
    }
    if (start == end) {
      return null;
    }
    for (int i = start; i < end; i++) {
      int c = raw[i] & 0xff;
      if (!isAlnum(c) && "!#$%&'*+-.^_`|~:/=".indexOf(c) < 0) {
        return null;
      }
    }
    return new String(raw, start, end - start, StandardCharsets.US_ASCII);
  }

  /**
   * The key as stored in the coordinator: with an identity, the hex SHA-256 of the identity, a
   * colon and the key, so that two callers' keys never meet and the identity is never stored in
   * clear; without one, the key itself.
   */
  static String scopedKey(byte[] identity, String key) {
    if (identity == null) {
      return key;
    }
    return HexFormat.of().formatHex(sha256().digest(identity)) + ":" + key;
  }

  /**
   * SHA-256 over the method, the path and query, the Content-Type and the body, each prefixed by
   * its length (8 bytes, big-endian), so that no two different requests give the same input.
   */
  static byte[] fingerprint(String method, String pathAndQuery, byte[] contentType, byte[] body) {
    MessageDigest hash = sha256();
    for (byte[] part : new byte[][] {
      method.getBytes(StandardCharsets.ISO_8859_1), pathAndQuery.getBytes(StandardCharsets.ISO_8859_1), contentType, body
    }) {
      hash.update(ByteBuffer.allocate(8).putLong(part.length).array());
      hash.update(part);
    }
    return hash.digest();
  }

  private static MessageDigest sha256() {
    try {
      return MessageDigest.getInstance("SHA-256");
    } catch (NoSuchAlgorithmException e) {
      throw new IllegalStateException(e); // every Java platform has SHA-256
    }
  }

  // An RFC 9651 Item parser, as strict as the gateway's sfv 0.15: it answers the bare item when
  // it is a String or a Token, and null for any other item or a parse failure.

  static String sfStringOrToken(byte[] in) {
    Sf p = new Sf(in);
    p.skipSp();
    try {
      String item = p.bareItem();
      p.parameters();
      p.skipSp();
      if (p.pos != in.length) {
        return null;
      }
      return item;
    } catch (IllegalArgumentException e) {
      return null;
    }
  }

  /** The parser's state; a syntax error is an IllegalArgumentException. */
  private static final class Sf {
    private final byte[] in;
    private int pos;

    Sf(byte[] in) {
      this.in = in;
    }

    private int peek() {
      return pos < in.length ? in[pos] & 0xff : -1;
    }

    private static IllegalArgumentException error(String what) {
      return new IllegalArgumentException(what);
    }

    void skipSp() {
      while (pos < in.length && in[pos] == ' ') {
        pos++;
      }
    }

    /** The bare item: its text for a String or a Token, null for the other kinds. */
    String bareItem() {
      int c = peek();
      if (c < 0) {
        throw error("empty");
      }
      if (c == '?') {
        pos++;
        int b = peek();
        if (b != '0' && b != '1') {
          throw error("boolean");
        }
        pos++;
        return null;
      }
      if (c == '"') {
        return string();
      }
      if (c == ':') {
        byteSequence();
        return null;
      }
      if (c == '@') {
        pos++;
        if (number()) {
          throw error("non-integer date");
        }
        return null;
      }
      if (c == '%') {
        displayString();
        return null;
      }
      if (isAlpha(c) || c == '*') {
        return token();
      }
      if (c == '-' || isDigit(c)) {
        number();
        return null;
      }
      throw error("not a bare item");
    }

    private String string() {
      pos++;
      StringBuilder b = new StringBuilder();
      while (pos < in.length) {
        int c = in[pos] & 0xff;
        if (c == '"') {
          pos++;
          return b.toString();
        } else if (c < 0x20 || c >= 0x7f) {
          throw error("string character");
        } else if (c == '\\') {
          pos++;
          int n = peek();
          if (n != '\\' && n != '"') {
            throw error("escape");
          }
          b.append((char) n);
          pos++;
        } else {
          b.append((char) c);
          pos++;
        }
      }
      throw error("unterminated string");
    }

    private String token() {
      int start = pos;
      pos++;
      while (pos < in.length) {
        int c = in[pos] & 0xff;
        if (!isTchar(c) && c != ':' && c != '/') {
          break;
        }
        pos++;
      }
      return new String(in, start, pos - start, StandardCharsets.US_ASCII);
    }

    private void byteSequence() {
      pos++;
      int end = pos;
      while (end < in.length && in[end] != ':') {
        end++;
      }
      if (end == in.length) {
        throw error("unterminated byte sequence");
      }
      String content = new String(in, pos, end - pos, StandardCharsets.ISO_8859_1);
      pos = end + 1;
      // sfv decodes the standard alphabet with or without padding (correct when present), and
      // allows non-zero trailing bits, as a lenient decoder does.
      String trimmed = content.replaceAll("=+$", "");
      boolean padded = trimmed.length() != content.length();
      if (content.length() - trimmed.length() > 2 || (padded && content.length() % 4 != 0)) {
        throw error("byte sequence padding");
      }
      if (!trimmed.chars().allMatch(ch -> isAlnum(ch) || ch == '+' || ch == '/') || trimmed.length() % 4 == 1) {
        throw error("byte sequence");
      }
    }

    /** Skips a number; answers whether it was a decimal. */
    private boolean number() {
      if (peek() == '-') {
        pos++;
      }
      if (!isDigit(peek())) {
        throw error("digit");
      }
      int digits = digits(15, "too many digits");
      if (peek() != '.') {
        return false;
      }
      if (digits > 12) {
        throw error("too many digits before the decimal point");
      }
      pos++;
      int fraction = digits(3, "too many digits after the decimal point");
      if (fraction == 0) {
        throw error("trailing decimal point");
      }
      return true;
    }

    private int digits(int limit, String tooMany) {
      int n = 0;
      while (pos < in.length && isDigit(in[pos] & 0xff)) {
        n++;
        if (n > limit) {
          throw error(tooMany);
        }
        pos++;
      }
      return n;
    }

    private void displayString() {
      pos++;
      if (peek() != '"') {
        throw error("display string");
      }
      pos++;
      java.io.ByteArrayOutputStream out = new java.io.ByteArrayOutputStream();
      while (pos < in.length) {
        int c = in[pos] & 0xff;
        if (c == '"') {
          pos++;
          try {
            StandardCharsets.UTF_8.newDecoder().decode(ByteBuffer.wrap(out.toByteArray()));
          } catch (java.nio.charset.CharacterCodingException e) {
            throw error("display string utf-8");
          }
          return;
        } else if (c < 0x20 || c >= 0x7f) {
          throw error("display string character");
        } else if (c == '%') {
          pos++;
          int octet = 0;
          for (int i = 0; i < 2; i++) {
            int h = peek();
            if (isDigit(h)) {
              octet = (octet << 4) + (h - '0');
            } else if (h >= 'a' && h <= 'f') {
              octet = (octet << 4) + (h - 'a' + 10);
            } else {
              throw error("display string escape");
            }
            pos++;
          }
          out.write(octet);
        } else {
          out.write(c);
          pos++;
        }
      }
      throw error("unterminated display string");
    }

    void parameters() {
      while (peek() == ';') {
        pos++;
        skipSp();
        int c = peek();
        if (!(isLowerAlpha(c) || c == '*')) {
          throw error("parameter key");
        }
        while (pos < in.length) {
          int k = in[pos] & 0xff;
          if (!(isLowerAlpha(k) || isDigit(k) || k == '_' || k == '-' || k == '*' || k == '.')) {
            break;
          }
          pos++;
        }
        if (peek() == '=') {
          pos++;
          bareItem();
        }
      }
    }
  }

  static boolean isAlpha(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  }

  static boolean isLowerAlpha(int c) {
    return c >= 'a' && c <= 'z';
  }

  static boolean isDigit(int c) {
    return c >= '0' && c <= '9';
  }

  static boolean isAlnum(int c) {
    return isAlpha(c) || isDigit(c);
  }

  static boolean isTchar(int c) {
    return isAlnum(c) || (c >= 0 && "!#$%&'*+-.^_`|~".indexOf(c) >= 0);
  }
}

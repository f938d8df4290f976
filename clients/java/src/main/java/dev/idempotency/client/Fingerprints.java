package dev.idempotency.client;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonProcessingException;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.json.JsonMapper;
import com.fasterxml.jackson.databind.cfg.JsonNodeFeature;
import dev.idempotency.client.CanonicalJsonException.Kind;
import java.io.IOException;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.math.MathContext;
import java.math.RoundingMode;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.Map;
import java.util.TreeMap;

/**
 * Fingerprints of requests, byte for byte as every client of the coordinator makes them: SHA-256
 * of the request's bytes as they are, or of its RFC 8785 (JCS) canonical JSON, so that equal
 * requests hash alike whatever the order of their members or the language that built them.
 *
 * <p>The canonical form: objects sorted by the UTF-16 code units of their member names, the
 * fewest escapes, numbers as ECMAScript writes doubles (shortest round-trip digits). Beyond RFC
 * 8785, as I-JSON (RFC 7493) asks, integers beyond ±(2^53−1) are refused (a double would round
 * them, and two different requests would share a fingerprint), and so are lone surrogates, NaN,
 * infinities, numbers beyond the largest double and, in a JSON text, a member name twice.
 *
 * <p>Values are walked with Jackson ({@code ObjectMapper.valueToTree}): records, beans, maps,
 * lists, arrays, strings, numbers, booleans and null. Java integers ({@code int}, {@code long},
 * {@code BigInteger}, and a {@code BigDecimal} without fraction digits) are integers; {@code
 * double}, {@code float} and other {@code BigDecimal}s are doubles.
 */
public final class Fingerprints {
  /** The largest integer every client's JSON reads exactly (JavaScript's MAX_SAFE_INTEGER). */
  public static final long MAX_SAFE_INTEGER = (1L << 53) - 1;

  private static final BigInteger MAX_SAFE = BigInteger.valueOf(MAX_SAFE_INTEGER);
  private static final BigInteger MIN_SAFE = MAX_SAFE.negate();
  private static final ObjectMapper MAPPER =
      JsonMapper.builder().disable(JsonNodeFeature.STRIP_TRAILING_BIGDECIMAL_ZEROES).build();
  private static final JsonFactory FACTORY = new JsonFactory();
  private static final char[] HEX = "0123456789abcdef".toCharArray();

  private Fingerprints() {}

  /**
   * The fingerprint of a request as {@code runOnce} makes it.
   *
   * @param request null (no fingerprint: it matches only requests without one), a {@code byte[]}
   *     (hashed as it is) or a value (hashed as its canonical JSON)
   * @return 32 bytes of SHA-256, or none for null
   * @throws CanonicalJsonException for a value without a canonical form
   */
  public static byte[] of(Object request) {
    if (request == null) {
      return new byte[0];
    }
    if (request instanceof byte[] bytes) {
      return sha256(bytes);
    }
    return sha256(canonicalJson(request));
  }

  /**
   * The fingerprint of a JSON text (a request body as it arrived): the one {@link #of(Object)}
   * gives the value the text holds, so a body fingerprinted as received matches the same request
   * built as a value, in any client.
   *
   * @param text the JSON text
   * @return 32 bytes of SHA-256
   * @throws CanonicalJsonException for a text that is not JSON or has no canonical form
   */
  public static byte[] ofJsonText(String text) {
    return sha256(canonicalJsonText(text));
  }

  /**
   * The RFC 8785 canonical JSON of a value, as UTF-8.
   *
   * @param value the value, walked by Jackson
   * @return the canonical form
   * @throws CanonicalJsonException for a value without a canonical form
   */
  public static byte[] canonicalJson(Object value) {
    JsonNode tree;
    try {
      tree = MAPPER.valueToTree(value);
    } catch (IllegalArgumentException e) {
      throw new CanonicalJsonException(Kind.NOT_JSON, "the value does not map to JSON: " + e.getMessage(), e);
    }
    StringBuilder out = new StringBuilder();
    writeNode(tree, out);
    return out.toString().getBytes(StandardCharsets.UTF_8);
  }

  /**
   * The RFC 8785 canonical form of a JSON text, as UTF-8: the same bytes as {@link
   * #canonicalJson(Object)} of the value it holds.
   *
   * @param text the JSON text
   * @return the canonical form
   * @throws CanonicalJsonException for a text that is not JSON or has no canonical form
   */
  public static byte[] canonicalJsonText(String text) {
    StringBuilder out = new StringBuilder();
    try (JsonParser parser = FACTORY.createParser(text)) {
      JsonToken first = parser.nextToken();
      if (first == null) {
        throw new CanonicalJsonException(Kind.INVALID_JSON, "the text is empty");
      }
      writeParsed(parser, out);
      if (parser.nextToken() != null) {
        throw new CanonicalJsonException(Kind.INVALID_JSON, "the text goes on after its value");
      }
    } catch (JsonProcessingException e) {
      // Jackson checks the surrogates of member names itself (those of values are checked here).
      String why = String.valueOf(e.getOriginalMessage());
      Kind kind = why.toLowerCase(java.util.Locale.ROOT).contains("surrogate") ? Kind.LONE_SURROGATE : Kind.INVALID_JSON;
      throw new CanonicalJsonException(kind, "not a JSON text: " + why, e);
    } catch (IOException e) {
      throw new CanonicalJsonException(Kind.INVALID_JSON, "not a JSON text: " + e.getMessage(), e);
    }
    return out.toString().getBytes(StandardCharsets.UTF_8);
  }

  static byte[] sha256(byte[] bytes) {
    try {
      return MessageDigest.getInstance("SHA-256").digest(bytes);
    } catch (NoSuchAlgorithmException e) {
      // Every Java platform must provide SHA-256 (MessageDigest's documentation).
      throw new IllegalStateException(e);
    }
  }

  /** Writes the value the parser is at (its current token), reading as far as its end. */
  private static void writeParsed(JsonParser p, StringBuilder out) throws IOException {
    JsonToken token = p.currentToken();
    switch (token) {
      case START_OBJECT -> {
        // Sorted by String's natural order: UTF-16 code units, exactly RFC 8785's rule.
        TreeMap<String, String> members = new TreeMap<>();
        while (p.nextToken() == JsonToken.FIELD_NAME) {
          String name = p.currentName();
          checkSurrogates(name);
          p.nextToken();
          StringBuilder value = new StringBuilder();
          writeParsed(p, value);
          if (members.put(name, value.toString()) != null) {
            throw new CanonicalJsonException(Kind.DUPLICATE_KEY, "a member name occurs twice in an object");
          }
        }
        writeMembers(members, out);
      }
      case START_ARRAY -> {
        out.append('[');
        boolean first = true;
        while (p.nextToken() != JsonToken.END_ARRAY) {
          if (!first) {
            out.append(',');
          }
          first = false;
          writeParsed(p, out);
        }
        out.append(']');
      }
      case VALUE_STRING -> writeString(p.getText(), out);
      case VALUE_NUMBER_INT -> writeInteger(new BigInteger(p.getText()), out);
      case VALUE_NUMBER_FLOAT -> {
        // Double.parseDouble rounds a decimal literal correctly, as the other clients' readers do.
        double d = Double.parseDouble(p.getText());
        writeDouble(d, out);
      }
      case VALUE_TRUE -> out.append("true");
      case VALUE_FALSE -> out.append("false");
      case VALUE_NULL -> out.append("null");
      default -> throw new CanonicalJsonException(Kind.INVALID_JSON, "unexpected " + token);
    }
  }

  private static void writeNode(JsonNode node, StringBuilder out) {
    switch (node.getNodeType()) {
      case OBJECT -> {
        TreeMap<String, String> members = new TreeMap<>();
        for (Map.Entry<String, JsonNode> member : node.properties()) {
          checkSurrogates(member.getKey());
          StringBuilder value = new StringBuilder();
          writeNode(member.getValue(), value);
          members.put(member.getKey(), value.toString());
        }
        writeMembers(members, out);
      }
      case ARRAY -> {
        out.append('[');
        for (int i = 0; i < node.size(); i++) {
          if (i > 0) {
            out.append(',');
          }
          writeNode(node.get(i), out);
        }
        out.append(']');
      }
      case STRING, BINARY -> writeString(node.asText(), out);
      case NUMBER -> {
        if (node.isIntegralNumber()) {
          writeInteger(node.bigIntegerValue(), out);
        } else if (node.isBigDecimal() && node.decimalValue().scale() <= 0) {
          // A BigDecimal written without fraction digits is an integer, and held to their bound.
          writeInteger(node.decimalValue().toBigIntegerExact(), out);
        } else {
          writeDouble(node.doubleValue(), out);
        }
      }
      case BOOLEAN -> out.append(node.booleanValue() ? "true" : "false");
      case NULL, MISSING -> out.append("null");
      default -> throw new CanonicalJsonException(Kind.NOT_JSON, "a " + node.getNodeType() + " is not JSON");
    }
  }

  private static void writeMembers(TreeMap<String, String> members, StringBuilder out) {
    out.append('{');
    boolean first = true;
    for (Map.Entry<String, String> member : members.entrySet()) {
      if (!first) {
        out.append(',');
      }
      first = false;
      writeString(member.getKey(), out);
      out.append(':').append(member.getValue());
    }
    out.append('}');
  }

  private static void writeInteger(BigInteger n, StringBuilder out) {
    if (n.compareTo(MAX_SAFE) > 0 || n.compareTo(MIN_SAFE) < 0) {
      throw new CanonicalJsonException(
          Kind.UNSAFE_INTEGER,
          "the integer " + n + " is beyond ±(2^53−1) and would be rounded; send it as a string");
    }
    out.append(n.longValue());
  }

  private static void writeDouble(double d, StringBuilder out) {
    if (!Double.isFinite(d)) {
      throw new CanonicalJsonException(Kind.NUMBER_OUT_OF_RANGE, "a number beyond the largest double (or NaN)");
    }
    out.append(ecmaScriptNumber(d));
  }

  /**
   * The number as ECMAScript's Number::toString writes it: the shortest decimal digits that read
   * back as the same double (the closer of the two candidates, then the even one), without a
   * point for integers, in exponent form below 1e-6 and from 1e21. Java 17's Double.toString is
   * not always the shortest, so the digits are found here with exact decimal arithmetic.
   */
  static String ecmaScriptNumber(double d) {
    if (d == 0) {
      return "0"; // -0 as well
    }
    if (d < 0) {
      return "-" + ecmaScriptNumber(-d);
    }
    if (d == Math.rint(d) && d <= MAX_SAFE_INTEGER) {
      return Long.toString((long) d);
    }
    BigDecimal exact = new BigDecimal(d);
    BigDecimal digits = null;
    for (int precision = 1; precision <= 17 && digits == null; precision++) {
      BigDecimal down = exact.round(new MathContext(precision, RoundingMode.DOWN));
      BigDecimal up = exact.round(new MathContext(precision, RoundingMode.UP));
      boolean downReads = Double.parseDouble(down.toString()) == d;
      boolean upReads = Double.parseDouble(up.toString()) == d;
      if (downReads && upReads) {
        int closer = exact.subtract(down).compareTo(up.subtract(exact));
        if (closer < 0) {
          digits = down;
        } else if (closer > 0) {
          digits = up;
        } else {
          digits = down.unscaledValue().testBit(0) ? up : down;
        }
      } else if (downReads) {
        digits = down;
      } else if (upReads) {
        digits = up;
      }
    }
    if (digits == null) {
      // Unreachable: 17 significant digits always identify a double.
      throw new IllegalStateException("no decimal form for " + d);
    }
    digits = digits.stripTrailingZeros();
    String s = digits.unscaledValue().toString();
    int k = s.length();
    int n = k - digits.scale(); // the value is s × 10^(n − k)
    StringBuilder out = new StringBuilder();
    if (k <= n && n <= 21) {
      out.append(s).append("0".repeat(n - k));
    } else if (0 < n && n <= 21) {
      out.append(s, 0, n).append('.').append(s, n, k);
    } else if (-6 < n && n <= 0) {
      out.append("0.").append("0".repeat(-n)).append(s);
    } else {
      int exponent = n - 1;
      out.append(s.charAt(0));
      if (k > 1) {
        out.append('.').append(s, 1, k);
      }
      out.append('e').append(exponent < 0 ? '-' : '+').append(Math.abs(exponent));
    }
    return out.toString();
  }

  private static void checkSurrogates(String s) {
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (Character.isHighSurrogate(c)) {
        if (i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
          i++;
          continue;
        }
        throw new CanonicalJsonException(Kind.LONE_SURROGATE, "a string holds a lone surrogate");
      }
      if (Character.isLowSurrogate(c)) {
        throw new CanonicalJsonException(Kind.LONE_SURROGATE, "a string holds a lone surrogate");
      }
    }
  }

  /** A string with RFC 8785's escapes: the short ones, \\u00xx for other controls, the rest as is. */
  private static void writeString(String s, StringBuilder out) {
    checkSurrogates(s);
    out.append('"');
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      switch (c) {
        case '"' -> out.append("\\\"");
        case '\\' -> out.append("\\\\");
        case '\b' -> out.append("\\b");
        case '\f' -> out.append("\\f");
        case '\n' -> out.append("\\n");
        case '\r' -> out.append("\\r");
        case '\t' -> out.append("\\t");
        default -> {
          if (c < 0x20) {
            out.append("\\u00").append(HEX[c >> 4]).append(HEX[c & 0xf]);
          } else {
            out.append(c);
          }
        }
      }
    }
    out.append('"');
  }
}

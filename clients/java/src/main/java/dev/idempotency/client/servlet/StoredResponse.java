package dev.idempotency.client.servlet;

import dev.idempotency.client.ResultCodec;
import jakarta.servlet.http.HttpServletResponse;
import java.io.ByteArrayOutputStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Locale;
import java.util.Set;

/**
 * A response as stored and replayed, byte for byte the gateway's record (gateway/src/record.rs):
 * kind (1 byte: 1 response, 2 too large to keep), status (u16), the number of headers (u16), each
 * header's name (u16 length + bytes, lower case) and value (u32 length + bytes), then the body
 * (the rest; empty for the marker). Numbers big-endian. Header bytes are ISO-8859-1 characters,
 * as servlet containers give them.
 */
record StoredResponse(int status, List<Header> headers, byte[] body, boolean tooLarge) {
  static final int KIND_RESPONSE = 1;
  static final int KIND_TOO_LARGE = 2;

  record Header(String name, String value) {}

  /**
   * Sets the headers on {@code response} in their order, a repeated name added to the first.
   *
   * @return the names set, in lower case
   */
  static Set<String> writeHeaders(HttpServletResponse response, List<Header> headers) {
    Set<String> seen = new HashSet<>();
    for (Header h : headers) {
      if (seen.add(h.name().toLowerCase(Locale.ROOT))) {
        response.setHeader(h.name(), h.value());
      } else {
        response.addHeader(h.name(), h.value());
      }
    }
    return seen;
  }

  /** How many bytes a record with these headers and a body of {@code bodyLength} takes. */
  static long encodedLength(List<Header> headers, long bodyLength) {
    long n = 1 + 2 + 2 + bodyLength;
    for (Header h : headers) {
      n += 2 + h.name().length() + 4 + h.value().length();
    }
    return n;
  }

  /** A stored response that the gateway did not write, or that is cut short. */
  static final class UnreadableException extends Exception {
    private static final long serialVersionUID = 1L;

    UnreadableException(String message) {
      super(message);
    }
  }

  static final ResultCodec<StoredResponse> CODEC = new ResultCodec<>() {
    @Override
    public byte[] encode(StoredResponse r) {
      return r.encode();
    }

    @Override
    public StoredResponse decode(byte[] stored) throws UnreadableException {
      return StoredResponse.decode(stored);
    }
  };

  byte[] encode() {
    if (headers.size() > 0xffff || status < 0 || status > 0xffff) {
      throw new IllegalArgumentException("the response has too many headers to store");
    }
    byte[] kept = tooLarge ? new byte[0] : body;
    ByteArrayOutputStream out = new ByteArrayOutputStream((int) Math.min(Integer.MAX_VALUE, encodedLength(headers, kept.length)));
    out.write(tooLarge ? KIND_TOO_LARGE : KIND_RESPONSE);
    writeNumber(out, status, 2);
    writeNumber(out, headers.size(), 2);
    for (Header h : headers) {
      byte[] name = h.name().getBytes(StandardCharsets.ISO_8859_1);
      byte[] value = h.value().getBytes(StandardCharsets.ISO_8859_1);
      if (name.length > 0xffff) {
        throw new IllegalArgumentException("a header name is too long to store");
      }
      writeNumber(out, name.length, 2);
      out.writeBytes(name);
      writeNumber(out, value.length, 4);
      out.writeBytes(value);
    }
    out.writeBytes(kept);
    return out.toByteArray();
  }

  static StoredResponse decode(byte[] data) throws UnreadableException {
    ByteBuffer in = ByteBuffer.wrap(data);
    if (!in.hasRemaining()) {
      throw new UnreadableException("not a response stored by the gateway");
    }
    int kind = in.get() & 0xff;
    if (kind != KIND_RESPONSE && kind != KIND_TOO_LARGE) {
      throw new UnreadableException("not a response stored by the gateway");
    }
    int status = number(in, 2);
    if (status < 100 || status > 999) {
      throw new UnreadableException("the stored status is not an HTTP status");
    }
    int count = number(in, 2);
    List<Header> headers = new ArrayList<>(count);
    for (int i = 0; i < count; i++) {
      String name = text(in, number(in, 2));
      String value = text(in, number(in, 4));
      if (!validName(name) || !validValue(value)) {
        throw new UnreadableException("the stored response has an invalid header");
      }
      headers.add(new Header(name, value));
    }
    byte[] body = new byte[in.remaining()];
    in.get(body);
    return new StoredResponse(status, List.copyOf(headers), body, kind == KIND_TOO_LARGE);
  }

  private static void writeNumber(ByteArrayOutputStream out, long n, int size) {
    for (int i = size - 1; i >= 0; i--) {
      out.write((int) (n >>> (8 * i)) & 0xff);
    }
  }

  private static int number(ByteBuffer in, int size) throws UnreadableException {
    if (in.remaining() < size) {
      throw new UnreadableException("the stored response is truncated");
    }
    long n = 0;
    for (int i = 0; i < size; i++) {
      n = (n << 8) | (in.get() & 0xff);
    }
    if (n > Integer.MAX_VALUE) {
      throw new UnreadableException("the stored response is truncated");
    }
    return (int) n;
  }

  private static String text(ByteBuffer in, int length) throws UnreadableException {
    if (in.remaining() < length) {
      throw new UnreadableException("the stored response is truncated");
    }
    byte[] b = new byte[length];
    in.get(b);
    return new String(b, StandardCharsets.ISO_8859_1);
  }

  /** RFC 9110 token characters (the gateway stores lower case ones). */
  static boolean validName(String name) {
    return !name.isEmpty() && name.chars().allMatch(HttpKeys::isTchar);
  }

  /** Visible characters, spaces, tabs and obs-text, as hyper's HeaderValue. */
  static boolean validValue(String value) {
    return value.chars().noneMatch(c -> (c < 0x20 && c != '\t') || c == 0x7f);
  }
}

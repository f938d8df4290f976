package dev.idempotency.client.servlet;

import jakarta.servlet.ReadListener;
import jakarta.servlet.ServletInputStream;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletRequestWrapper;
import java.io.BufferedReader;
import java.io.ByteArrayInputStream;
import java.io.InputStreamReader;
import java.io.UnsupportedEncodingException;
import java.nio.charset.Charset;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Enumeration;
import java.util.List;

/**
 * The request as the handler gets it: its body (read already, to fingerprint it) to read again,
 * and the claim's lease token in {@code Idempotency-Lease-Token} (a client's own header of that
 * name is removed).
 */
final class BodyRequest extends HttpServletRequestWrapper {
  private final byte[] body;
  private final String leaseToken; // null: the header is removed only
  private boolean used;

  BodyRequest(HttpServletRequest request, byte[] body, String leaseToken) {
    super(request);
    this.body = body;
    this.leaseToken = leaseToken;
  }

  private static boolean isToken(String name) {
    return IdempotencyFilter.LEASE_TOKEN_HEADER.equalsIgnoreCase(name);
  }

  @Override
  public String getHeader(String name) {
    return isToken(name) ? leaseToken : super.getHeader(name);
  }

  @Override
  public Enumeration<String> getHeaders(String name) {
    if (isToken(name)) {
      return leaseToken == null ? Collections.emptyEnumeration() : Collections.enumeration(List.of(leaseToken));
    }
    return super.getHeaders(name);
  }

  @Override
  public Enumeration<String> getHeaderNames() {
    List<String> names = new ArrayList<>();
    for (Enumeration<String> e = super.getHeaderNames(); e.hasMoreElements(); ) {
      String name = e.nextElement();
      if (!isToken(name)) {
        names.add(name);
      }
    }
    if (leaseToken != null) {
      names.add(IdempotencyFilter.LEASE_TOKEN_HEADER);
    }
    return Collections.enumeration(names);
  }

  @Override
  public int getIntHeader(String name) {
    if (isToken(name)) {
      // A token beyond int's range cannot be an int header; as the specification says.
      return leaseToken == null ? -1 : Integer.parseInt(leaseToken);
    }
    return super.getIntHeader(name);
  }

  @Override
  public int getContentLength() {
    return body.length;
  }

  @Override
  public long getContentLengthLong() {
    return body.length;
  }

  @Override
  public ServletInputStream getInputStream() {
    if (used) {
      throw new IllegalStateException("the body was read already");
    }
    used = true;
    ByteArrayInputStream in = new ByteArrayInputStream(body);
    return new ServletInputStream() {
      @Override
      public boolean isFinished() {
        return in.available() == 0;
      }

      @Override
      public boolean isReady() {
        return true;
      }

      @Override
      public void setReadListener(ReadListener listener) {
        throw new IllegalStateException("the idempotency filter supports blocking reads only");
      }

      @Override
      public int read() {
        return in.read();
      }

      @Override
      public int read(byte[] b, int off, int len) {
        return in.read(b, off, len);
      }
    };
  }

  @Override
  public BufferedReader getReader() throws UnsupportedEncodingException {
    String encoding = getCharacterEncoding();
    Charset charset;
    try {
      charset = encoding == null ? StandardCharsets.ISO_8859_1 : Charset.forName(encoding);
    } catch (IllegalArgumentException e) {
      throw new UnsupportedEncodingException(encoding);
    }
    return new BufferedReader(new InputStreamReader(getInputStream(), charset));
  }
}

package dev.idempotency.client.servlet;

import jakarta.servlet.ServletOutputStream;
import jakarta.servlet.WriteListener;
import jakarta.servlet.http.HttpServletResponse;
import jakarta.servlet.http.HttpServletResponseWrapper;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.nio.charset.Charset;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.Collection;
import java.util.HashSet;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Locale;
import java.util.Set;

/**
 * The handler's response: its answer is kept until the claim is settled (stored, or released for
 * an answer that is not final) and only then sent, so that a retry never sees an answer whose key
 * is still held. An answer larger than the stored limit is streamed to the caller as it comes
 * instead. {@code sendError} is kept like any answer, with its message as a text/plain body, so
 * that the answer and its replays are the same bytes.
 */
final class RecordingResponse extends HttpServletResponseWrapper {
  private static final Set<String> HOP_BY_HOP = Set.of(
      "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
      "transfer-encoding", "upgrade");

  private final HttpServletResponse real;
  private final long limit;
  private final List<StoredResponse.Header> headers = new ArrayList<>(); // as set, names as given
  private final ByteArrayOutputStream body = new ByteArrayOutputStream();
  private int status = SC_OK;
  private String characterEncoding;
  private PrintWriter writer;
  private ServletOutputStream stream;
  private boolean streaming;
  private boolean done;

  RecordingResponse(HttpServletResponse real, long limit) {
    super(real);
    this.real = real;
    this.limit = limit;
  }

  boolean streaming() {
    return streaming;
  }

  int recordedStatus() {
    return status;
  }

  /** The answer as stored: lower-case names, hop-by-hop headers left out. */
  List<StoredResponse.Header> storedHeaders() {
    Set<String> hop = new HashSet<>(HOP_BY_HOP);
    for (StoredResponse.Header h : headers) {
      if (h.name().equalsIgnoreCase("connection")) {
        for (String named : h.value().split(",")) {
          if (!named.isBlank()) {
            hop.add(named.trim().toLowerCase(Locale.ROOT));
          }
        }
      }
    }
    List<StoredResponse.Header> fields = new ArrayList<>();
    for (StoredResponse.Header h : headers) {
      String name = h.name().toLowerCase(Locale.ROOT);
      if (!hop.contains(name)) {
        fields.add(new StoredResponse.Header(name, h.value()));
      }
    }
    return fields;
  }

  StoredResponse record() {
    return streaming
        ? new StoredResponse(status, storedHeaders(), new byte[0], true)
        : new StoredResponse(status, storedHeaders(), body.toByteArray(), false);
  }

  /** Ends the handler's turn: what its writer holds is taken, later writes are dropped. */
  void finish() {
    if (writer != null) {
      writer.flush();
    }
    done = true;
  }

  /** Writes the kept answer to the caller, with a warning if given (nothing when streaming). */
  void send(String warning) throws IOException {
    if (!streaming) {
      writeKept(warning);
    }
  }

  private void writeKept(String warning) throws IOException {
    real.setStatus(status);
    StoredResponse.writeHeaders(real, headers);
    if (warning != null) {
      real.setHeader(IdempotencyFilter.WARNING_HEADER, warning);
    }
    if (!streaming) {
      real.setContentLength(body.size());
    }
    real.getOutputStream().write(body.toByteArray());
  }

  /** Over the limit: a final answer is marked not-replayable and sent as it comes from here on. */
  private void startStreaming() throws IOException {
    streaming = true;
    writeKept(IdempotencyFilter.isFinal(status) ? "not-replayable" : null);
    body.reset();
  }

  private void append(byte[] b, int off, int len) throws IOException {
    if (done) {
      return; // a thread the handler left behind: its answer is settled already
    }
    if (streaming) {
      real.getOutputStream().write(b, off, len);
      return;
    }
    if (StoredResponse.encodedLength(storedHeaders(), (long) body.size() + len) > limit) {
      startStreaming();
      real.getOutputStream().write(b, off, len);
      return;
    }
    body.write(b, off, len);
  }

  // --- status

  @Override
  public void setStatus(int sc) {
    if (!streaming && !done) {
      status = sc;
    }
  }

  @Override
  public int getStatus() {
    return status;
  }

  @Override
  public void sendError(int sc, String msg) throws IOException {
    if (streaming || done) {
      return;
    }
    resetBuffer();
    status = sc;
    if (msg != null) {
      setHeader("Content-Type", "text/plain;charset=utf-8");
      byte[] text = msg.getBytes(StandardCharsets.UTF_8);
      append(text, 0, text.length);
    }
    finish();
  }

  @Override
  public void sendError(int sc) throws IOException {
    sendError(sc, null);
  }

  @Override
  public void sendRedirect(String location) throws IOException {
    if (streaming || done) {
      return;
    }
    resetBuffer();
    status = SC_FOUND;
    setHeader("Location", location);
    finish();
  }

  // --- headers

  @Override
  public void setHeader(String name, String value) {
    if (streaming) {
      real.setHeader(name, value);
      return;
    }
    headers.removeIf(h -> h.name().equalsIgnoreCase(name));
    if (value != null) {
      headers.add(new StoredResponse.Header(name, value));
    }
  }

  @Override
  public void addHeader(String name, String value) {
    if (streaming) {
      real.addHeader(name, value);
      return;
    }
    if (value != null) {
      headers.add(new StoredResponse.Header(name, value));
    }
  }

  @Override
  public void setIntHeader(String name, int value) {
    setHeader(name, Integer.toString(value));
  }

  @Override
  public void addIntHeader(String name, int value) {
    addHeader(name, Integer.toString(value));
  }

  @Override
  public void setDateHeader(String name, long date) {
    setHeader(name, httpDate(date));
  }

  @Override
  public void addDateHeader(String name, long date) {
    addHeader(name, httpDate(date));
  }

  private static String httpDate(long millis) {
    return DateTimeFormatter.RFC_1123_DATE_TIME.format(Instant.ofEpochMilli(millis).atOffset(ZoneOffset.UTC));
  }

  @Override
  public boolean containsHeader(String name) {
    return headers.stream().anyMatch(h -> h.name().equalsIgnoreCase(name));
  }

  @Override
  public String getHeader(String name) {
    return headers.stream().filter(h -> h.name().equalsIgnoreCase(name)).map(StoredResponse.Header::value)
        .findFirst().orElse(null);
  }

  @Override
  public Collection<String> getHeaders(String name) {
    return headers.stream().filter(h -> h.name().equalsIgnoreCase(name)).map(StoredResponse.Header::value).toList();
  }

  @Override
  public Collection<String> getHeaderNames() {
    Set<String> names = new LinkedHashSet<>();
    headers.forEach(h -> names.add(h.name()));
    return names;
  }

  @Override
  public void setContentType(String type) {
    if (type == null) {
      setHeader("Content-Type", null);
      return;
    }
    String value = type;
    if (characterEncoding != null && !type.toLowerCase(Locale.ROOT).contains("charset=")) {
      value = type + ";charset=" + characterEncoding;
    }
    setHeader("Content-Type", value);
  }

  @Override
  public String getContentType() {
    return getHeader("Content-Type");
  }

  @Override
  public void setCharacterEncoding(String charset) {
    if (writer != null || charset == null) {
      return;
    }
    characterEncoding = charset;
    String type = getContentType();
    if (type != null) {
      setHeader("Content-Type", type.replaceAll("(?i);\\s*charset=[^;]*", "") + ";charset=" + charset);
    }
  }

  @Override
  public String getCharacterEncoding() {
    if (characterEncoding != null) {
      return characterEncoding;
    }
    String type = getContentType();
    if (type != null) {
      int at = type.toLowerCase(Locale.ROOT).indexOf("charset=");
      if (at >= 0) {
        return type.substring(at + 8).split(";")[0].trim().replace("\"", "");
      }
    }
    return StandardCharsets.ISO_8859_1.name(); // the servlet specification's default
  }

  @Override
  public void setContentLength(int len) {
    // The body kept decides; the container sets the length when the answer is sent.
  }

  @Override
  public void setContentLengthLong(long len) {
    // As setContentLength.
  }

  @Override
  public void setLocale(Locale loc) {
    // Not kept: a Content-Language header, if wanted, is the handler's to set.
  }

  // --- body

  @Override
  public ServletOutputStream getOutputStream() {
    if (writer != null) {
      throw new IllegalStateException("getWriter() was called already");
    }
    if (stream == null) {
      stream = newStream();
    }
    return stream;
  }

  @Override
  public PrintWriter getWriter() {
    if (stream != null) {
      throw new IllegalStateException("getOutputStream() was called already");
    }
    if (writer == null) {
      if (characterEncoding == null && getContentType() != null
          && !getContentType().toLowerCase(Locale.ROOT).contains("charset=")) {
        setCharacterEncoding(getCharacterEncoding()); // the writer's charset is named, as containers do
      }
      Charset charset = Charset.forName(getCharacterEncoding());
      writer = new PrintWriter(new OutputStreamWriter(newStream(), charset), false);
    }
    return writer;
  }

  /**
   * The sink of the body, under getOutputStream() and getWriter() alike: it keeps what is written
   * (or, once over the limit, streams it), and a flush reaches the client only when streaming.
   */
  private ServletOutputStream newStream() {
    return new ServletOutputStream() {
      @Override
      public boolean isReady() {
        return true;
      }

      @Override
      public void setWriteListener(WriteListener listener) {
        throw new IllegalStateException("the idempotency filter supports blocking writes only");
      }

      @Override
      public void write(int b) throws IOException {
        append(new byte[] {(byte) b}, 0, 1);
      }

      @Override
      public void write(byte[] b, int off, int len) throws IOException {
        append(b, off, len);
      }

      @Override
      public void flush() throws IOException {
        if (streaming && !done) {
          real.flushBuffer();
        }
      }
    };
  }

  @Override
  public void flushBuffer() throws IOException {
    if (writer != null) {
      writer.flush();
    }
    if (streaming && !done) {
      real.flushBuffer();
    }
  }

  @Override
  public boolean isCommitted() {
    return streaming || done;
  }

  @Override
  public void reset() {
    if (streaming) {
      throw new IllegalStateException("the response is committed");
    }
    headers.clear();
    status = SC_OK;
    body.reset();
  }

  @Override
  public void resetBuffer() {
    if (streaming) {
      throw new IllegalStateException("the response is committed");
    }
    body.reset();
  }
}

package dev.idempotency.client.servlet;

import dev.idempotency.client.CancelledException;
import dev.idempotency.client.DeadlineExceededException;
import dev.idempotency.client.FingerprintMismatchException;
import dev.idempotency.client.IdempotencyClient;
import dev.idempotency.client.IdempotencyException;
import dev.idempotency.client.InProgressException;
import dev.idempotency.client.InvalidArgumentException;
import dev.idempotency.client.LeaseLostException;
import dev.idempotency.client.Limits;
import dev.idempotency.client.Outcome;
import dev.idempotency.client.OverloadedException;
import dev.idempotency.client.RateLimitedException;
import dev.idempotency.client.ResultCodecException;
import dev.idempotency.client.ResultNotStoredException;
import dev.idempotency.client.RunOptions;
import dev.idempotency.client.UnavailableException;
import jakarta.servlet.Filter;
import jakarta.servlet.FilterChain;
import jakarta.servlet.ServletException;
import jakarta.servlet.ServletRequest;
import jakarta.servlet.ServletResponse;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.io.InputStream;
import java.lang.System.Logger.Level;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Objects;
import java.util.Set;

/**
 * The coordinator's HTTP gateway (docs/gateway.md) as a {@code jakarta.servlet.Filter}: it gives
 * the servlets behind it the semantics of the {@code Idempotency-Key} header in-process, deciding
 * exactly as the gateway does, with its key syntax, identity scoping, fingerprint, stored record
 * and problem+json answers, so that a key recorded through the gateway (or the Go middleware) is
 * replayed by the filter and the other way round.
 *
 * <p>The handler runs on the request's thread under a claim of the key; it gets the claim's
 * fencing token in {@code Idempotency-Lease-Token} (and the {@code Lease} as the request attribute
 * {@link #LEASE_ATTRIBUTE}), and its thread is interrupted if the lease is lost. Its answer is
 * kept until the claim is settled (stored, or released for an answer that is not final) and then
 * sent; only an answer over the stored limit is streamed as it is written. The filter handles
 * blocking servlets: register it without async support.
 *
 * <p>A container that makes filters from their class name (web.xml) takes {@link
 * ConfiguredIdempotencyFilter}, which builds this filter from init-params.
 */
public final class IdempotencyFilter implements Filter {
  /** The fencing token of the claim the handler runs under (a client's own is removed). */
  public static final String LEASE_TOKEN_HEADER = "Idempotency-Lease-Token";
  /** {@code true} on a response replayed from the coordinator. */
  public static final String REPLAYED_HEADER = "Idempotent-Replayed";
  /** What the filter could not do for a response: not-replayable, not-recorded, not-deduplicated. */
  public static final String WARNING_HEADER = "Idempotency-Warning";
  /** The request attribute holding the handler's {@code dev.idempotency.client.Lease}. */
  public static final String LEASE_ATTRIBUTE = "dev.idempotency.client.Lease";

  private static final System.Logger DEFAULT_LOG = System.getLogger("dev.idempotency.client.servlet");

  private final IdempotencyClient client;
  private final String namespace;
  private final String header;
  private final Set<String> methods;
  private final List<String> requireKey;
  private final int maxKeyLength;
  private final String identityHeader;
  private final Duration wait;
  private final Duration lease;
  private final Duration retention;
  private final int maxRequestBytes;
  private final int maxStoredResponseBytes;
  private final boolean failOpen;
  private final System.Logger log;

  private IdempotencyFilter(Builder b) {
    this.client = b.client;
    this.namespace = b.namespace;
    this.header = b.header;
    this.methods = Set.copyOf(b.methods);
    this.requireKey = List.copyOf(b.requireKey);
    this.maxKeyLength = b.maxKeyLength;
    this.identityHeader = b.identityHeader;
    this.wait = b.wait;
    this.lease = b.lease;
    this.retention = b.retention;
    this.maxRequestBytes = b.maxRequestBytes;
    this.maxStoredResponseBytes = b.maxStoredResponseBytes;
    this.failOpen = b.failOpen;
    this.log = b.log;
  }

  /**
   * A builder of the filter for a namespace, with the gateway's defaults. The coordinator calls go
   * through {@code client}, with its call timeout and retry budget (the gateway's budget is 2 s,
   * {@code --coordinator-retry}).
   *
   * @param client the client
   * @param namespace the namespace of the keys: 1–64 characters of {@code A-Z a-z 0-9 . _ - :}
   * @return the builder
   */
  public static Builder builder(IdempotencyClient client, String namespace) {
    return new Builder(client, namespace);
  }

  /** Builds an {@link IdempotencyFilter}; every setting is checked as the gateway checks its flags. */
  public static final class Builder {
    private final IdempotencyClient client;
    private final String namespace;
    private String header = "Idempotency-Key";
    private Set<String> methods = Set.of("POST", "PATCH");
    private final List<String> requireKey = new ArrayList<>();
    private int maxKeyLength = 128;
    private String identityHeader;
    private Duration wait = Duration.ofSeconds(5);
    private Duration lease = Duration.ofSeconds(30);
    private Duration retention = Duration.ofHours(24);
    private int maxRequestBytes = 1 << 20;
    private int maxStoredResponseBytes = 1 << 20;
    private boolean failOpen;
    private System.Logger log = DEFAULT_LOG;

    private Builder(IdempotencyClient client, String namespace) {
      this.client = Objects.requireNonNull(client, "client");
      if (namespace == null || namespace.isEmpty() || namespace.length() > Limits.MAX_SCOPE_LENGTH
          || !namespace.chars().allMatch(c -> HttpKeys.isAlnum(c) || "._-:".indexOf(c) >= 0)) {
        throw new IllegalArgumentException("namespace: must be 1-64 characters of A-Z a-z 0-9 . _ - :");
      }
      this.namespace = namespace;
    }

    /**
     * Reads the key from this header (default {@code Idempotency-Key}; {@code --header}).
     *
     * @param name a header name of 1–64 characters
     * @return this builder
     */
    public Builder header(String name) {
      if (name == null || name.isEmpty() || name.length() > 64 || !StoredResponse.validName(name)) {
        throw new IllegalArgumentException("header: must be a header name of 1-64 characters (got " + name + ")");
      }
      this.header = name;
      return this;
    }

    /**
     * Guards these methods instead of POST and PATCH; the others pass through ({@code --methods}).
     *
     * @param names 1–16 methods in capitals
     * @return this builder
     */
    public Builder methods(String... names) {
      if (names.length == 0 || names.length > 16) {
        throw new IllegalArgumentException("methods: give 1-16 methods");
      }
      for (String m : names) {
        if (m == null || m.isEmpty() || !m.toUpperCase(Locale.ROOT).equals(m) || !StoredResponse.validName(m)) {
          throw new IllegalArgumentException("methods: " + m + " is not a method in capitals");
        }
      }
      this.methods = Set.of(names);
      return this;
    }

    /**
     * Refuses (400, key-missing) guarded requests without a key whose path starts with one of
     * these prefixes; elsewhere they pass through without idempotency ({@code --require-key}).
     *
     * @param prefixes at most 64 prefixes, each starting with {@code /}, without {@code ?}
     * @return this builder
     */
    public Builder requireKey(String... prefixes) {
      if (requireKey.size() + prefixes.length > 64) {
        throw new IllegalArgumentException("requireKey: give at most 64 path prefixes");
      }
      for (String p : prefixes) {
        if (p == null || !p.startsWith("/") || p.contains("?") || p.length() > 1024) {
          throw new IllegalArgumentException("requireKey: the prefix " + p + " must start with / and hold no ?");
        }
      }
      Collections.addAll(requireKey, prefixes);
      return this;
    }

    /**
     * Refuses longer keys (default 128; {@code --max-key-length}).
     *
     * @param bytes 1–190: room for the identity scope in the coordinator's 255
     * @return this builder
     */
    public Builder maxKeyLength(int bytes) {
      if (bytes < 1 || bytes > 190) {
        throw new IllegalArgumentException("maxKeyLength: must be 1-190 bytes (got " + bytes + ")");
      }
      this.maxKeyLength = bytes;
      return this;
    }

    /**
     * Scopes keys to the caller this header names (an API key, a user id): the key is stored as
     * {@code hex(SHA-256(identity)):key}, and requests without the header get 400
     * ({@code --identity-header}).
     *
     * @param name a header name
     * @return this builder
     */
    public Builder identityHeader(String name) {
      if (name == null || !StoredResponse.validName(name)) {
        throw new IllegalArgumentException("identityHeader: " + name + " is not a header name");
      }
      this.identityHeader = name;
      return this;
    }

    /**
     * How long a request waits for another one with its key to finish before 409 (default 5 s;
     * {@code --wait}).
     *
     * @param value 0–60 s
     * @return this builder
     */
    public Builder maxWait(Duration value) {
      this.wait = bounded("maxWait", value, Duration.ZERO, Limits.MAX_SERVER_WAIT);
      return this;
    }

    /**
     * The claim's lease, renewed every third of it (default 30 s; {@code --lease}).
     *
     * @param value 100 ms – 24 h
     * @return this builder
     */
    public Builder lease(Duration value) {
      this.lease = bounded("lease", value, Limits.MIN_LEASE, Limits.MAX_LEASE);
      return this;
    }

    /**
     * How long a key and its response are kept (default 24 h; {@code --retention}).
     *
     * @param value 1 s – 30 d
     * @return this builder
     */
    public Builder retention(Duration value) {
      this.retention = bounded("retention", value, Limits.MIN_RETENTION, Limits.MAX_RETENTION);
      return this;
    }

    /**
     * Refuses larger bodies with 413 (default 1 MiB; {@code --max-request-bytes}).
     *
     * @param bytes 1 KiB – 64 MiB
     * @return this builder
     */
    public Builder maxRequestBytes(int bytes) {
      this.maxRequestBytes = boundedSize("maxRequestBytes", bytes);
      return this;
    }

    /**
     * The largest response stored for replay, counted as stored: status, headers and body (default
     * 1 MiB; {@code --max-stored-response-bytes}). A larger one reaches its caller whole, with
     * {@code Idempotency-Warning: not-replayable}, and is never run again: a retry gets 500
     * response-not-replayable. Keep it at most the coordinator's {@code --max-response-bytes}.
     *
     * @param bytes 1 KiB – 64 MiB
     * @return this builder
     */
    public Builder maxStoredResponseBytes(int bytes) {
      this.maxStoredResponseBytes = boundedSize("maxStoredResponseBytes", bytes);
      return this;
    }

    /**
     * Runs the handler without idempotency ({@code Idempotency-Warning: not-deduplicated}) when
     * the coordinator is unavailable, instead of answering 503 ({@code --fail-open}).
     *
     * @return this builder
     */
    public Builder failOpen() {
      this.failOpen = true;
      return this;
    }

    /**
     * Receives the filter's own events (default {@code System.getLogger(
     * "dev.idempotency.client.servlet")}).
     *
     * @param value the logger
     * @return this builder
     */
    public Builder logger(System.Logger value) {
      this.log = Objects.requireNonNull(value, "logger");
      return this;
    }

    /**
     * The filter.
     *
     * @return the filter
     */
    public IdempotencyFilter build() {
      return new IdempotencyFilter(this);
    }

    private static Duration bounded(String what, Duration d, Duration low, Duration high) {
      if (d == null || d.compareTo(low) < 0 || d.compareTo(high) > 0) {
        throw new IllegalArgumentException(what + ": must be within " + low + " and " + high + " (got " + d + ")");
      }
      return d;
    }

    private static int boundedSize(String what, int bytes) {
      if (bytes < 1024 || bytes > 64 << 20) {
        throw new IllegalArgumentException(what + ": must be 1KiB-64MiB (got " + bytes + ")");
      }
      return bytes;
    }
  }

  /** The handler's answer is not the request's outcome: the claim is released, the answer sent. */
  private static final class NotFinal extends RuntimeException {
    private static final long serialVersionUID = 1L;

    NotFinal() {
      super("the handler's answer is not final", null, false, false);
    }
  }

  /** What the work leaves behind, for the cases where runOnce does not return its result. */
  private static final class Ran {
    boolean started;
    RecordingResponse recorder;
  }

  @Override
  public void doFilter(ServletRequest req, ServletResponse res, FilterChain chain) throws IOException, ServletException {
    if (!(req instanceof HttpServletRequest request) || !(res instanceof HttpServletResponse response)
        || !methods.contains(request.getMethod())) {
      chain.doFilter(req, res);
      return;
    }
    String lowerHeader = header.toLowerCase(Locale.ROOT);
    HttpKeys.KeyRead read = HttpKeys.readKey(Collections.list(request.getHeaders(header)), maxKeyLength);
    String key;
    if (read instanceof HttpKeys.Key k) {
      key = k.value();
    } else if (read instanceof HttpKeys.Missing) {
      if (!requiresKey(request.getRequestURI())) {
        chain.doFilter(req, res);
        return;
      }
      Problem.KEY_MISSING.write(response, request.getMethod() + " requests to this path need a " + lowerHeader + " header",
          null);
      return;
    } else if (read instanceof HttpKeys.Repeated) {
      Problem.KEY_REPEATED.write(response, "send one " + lowerHeader + " header, not several", null);
      return;
    } else {
      Problem.KEY_MALFORMED.write(response, ((HttpKeys.Malformed) read).detail(), null);
      return;
    }
    byte[] identity = null;
    if (identityHeader != null) {
      List<String> values = Collections.list(request.getHeaders(identityHeader));
      if (values.isEmpty()) {
        Problem.IDENTITY_MISSING.write(response,
            "requests with a key need a " + identityHeader.toLowerCase(Locale.ROOT) + " header", null);
        return;
      }
      identity = String.join("\n", values).getBytes(StandardCharsets.ISO_8859_1);
    }
    if (request.getContentLengthLong() > maxRequestBytes) {
      tooLarge(response);
      return;
    }
    byte[] body;
    try (InputStream in = request.getInputStream()) {
      body = in.readNBytes(maxRequestBytes + 1);
    } catch (IOException e) {
      Problem.REQUEST_UNREADABLE.write(response, "the request body could not be read: " + e.getMessage(), null);
      return;
    }
    if (body.length > maxRequestBytes) {
      tooLarge(response);
      return;
    }
    String contentType = request.getHeader("Content-Type");
    byte[] fingerprint = HttpKeys.fingerprint(request.getMethod(), requestTarget(request),
        contentType == null ? new byte[0] : contentType.getBytes(StandardCharsets.ISO_8859_1), body);
    String stored = HttpKeys.scopedKey(identity, key);
    RunOptions options = RunOptions.builder().fingerprint(fingerprint).lease(lease).retention(retention).maxWait(wait)
        .build();

    Ran ran = new Ran();
    Outcome<StoredResponse> outcome;
    try {
      outcome = client.runOnce(namespace, stored, null, StoredResponse.CODEC, options,
          claim -> forward(claim, request, response, chain, body, ran));
    } catch (NotFinal notFinal) {
      ran.recorder.send(null);
      return;
    } catch (IdempotencyException e) {
      refused(e, ran, request, response, chain, body);
      return;
    } catch (IllegalArgumentException e) {
      if (ran.started) {
        throw e;
      }
      Problem.KEY_MALFORMED.write(response, e.getMessage(), null);
      return;
    } catch (IOException | ServletException | RuntimeException | Error e) {
      throw e; // the handler's own failure: the claim was released, the container answers it
    } catch (Exception e) {
      throw new ServletException(e);
    }
    if (outcome.replayed()) {
      replay(response, outcome.value());
    } else {
      ran.recorder.send(null);
    }
  }

  private StoredResponse forward(dev.idempotency.client.Lease claim, HttpServletRequest request,
      HttpServletResponse response, FilterChain chain, byte[] body, Ran ran) throws IOException, ServletException {
    ran.started = true;
    BodyRequest inner = new BodyRequest(request, body, Long.toString(claim.token()));
    inner.setAttribute(LEASE_ATTRIBUTE, claim);
    RecordingResponse recorder = new RecordingResponse(response, maxStoredResponseBytes);
    ran.recorder = recorder;
    try {
      chain.doFilter(inner, recorder);
    } finally {
      recorder.finish();
      inner.removeAttribute(LEASE_ATTRIBUTE);
    }
    if (!isFinal(recorder.recordedStatus())) {
      throw new NotFinal();
    }
    return recorder.record();
  }

  /** Answers when runOnce failed on the coordinator's side, as the gateway does. */
  private void refused(IdempotencyException e, Ran ran, HttpServletRequest request, HttpServletResponse response,
      FilterChain chain, byte[] body) throws IOException, ServletException {
    RecordingResponse recorder = ran.recorder;
    if (recorder != null && recorder.streaming()) {
      // The answer is on its way already; nothing can be added to it.
      log.log(Level.WARNING, "idempotency filter: a streamed response could not be settled: {0}", e.getMessage());
      return;
    }
    if (e instanceof LeaseLostException) {
      log.log(Level.WARNING, "idempotency filter: the lease was lost while the handler ran: {0}", e.getMessage());
      Problem.LEASE_LOST.write(response, "another request took the key over while this one ran; retry to get its result",
          Duration.ofSeconds(1));
    } else if (e instanceof ResultNotStoredException && recorder != null) {
      // The handler ran and answered, but the answer could not be stored: the caller gets it,
      // told that a retry after the lease may run the request again.
      log.log(Level.WARNING, "idempotency filter: the response could not be stored: {0}", e.getMessage());
      recorder.send("not-recorded");
    } else if (ran.started) {
      Problem.LEASE_LOST.write(response, "the request ran, but its claim could not be settled", Duration.ofSeconds(1));
    } else if (e instanceof InProgressException busy) {
      Duration floor = wait.compareTo(Duration.ofSeconds(1)) > 0 ? wait : Duration.ofSeconds(1);
      Duration after = busy.retryAfter().compareTo(floor) < 0 ? busy.retryAfter() : floor;
      Problem.IN_PROGRESS.write(response,
          "another request with this key is still running after " + Problem.rustDuration(wait), after);
    } else if (e instanceof FingerprintMismatchException) {
      Problem.KEY_REUSED.write(response,
          "this key was used for a request with another method, path, content type or body", null);
    } else if (e instanceof InvalidArgumentException) {
      Problem.KEY_MALFORMED.write(response, e.status().map(s -> s.getDescription()).orElse(e.getMessage()), null);
    } else if (e instanceof ResultCodecException) {
      log.log(Level.ERROR, "idempotency filter: a stored response cannot be decoded: {0}", e.getMessage());
      Problem.STORED_RESPONSE_UNREADABLE.write(response,
          "the response stored for this key was not written by the gateway", null);
    } else if (e instanceof UnavailableException || e instanceof DeadlineExceededException
        || e instanceof RateLimitedException || e instanceof OverloadedException || e instanceof CancelledException) {
      if (failOpen) {
        log.log(Level.WARNING, "idempotency filter: coordinator unavailable; running without idempotency: {0}",
            e.getMessage());
        response.setHeader(WARNING_HEADER, "not-deduplicated");
        chain.doFilter(new BodyRequest(request, body, null), response);
        return;
      }
      log.log(Level.WARNING, "idempotency filter: coordinator unavailable; refusing: {0}", e.getMessage());
      Problem.COORDINATOR_UNAVAILABLE.write(response,
          "the gateway cannot reach the idempotency coordinator; retry later",
          e.retryDelay().orElse(Duration.ofSeconds(1)));
    } else {
      log.log(Level.ERROR, "idempotency filter: the coordinator refused the filter: {0}", e.getMessage());
      Problem.COORDINATOR_REFUSED.write(response, e.getMessage(), null);
    }
  }

  /** The stored response as it was: status, headers and body, and {@code Idempotent-Replayed: true}. */
  private static void replay(HttpServletResponse response, StoredResponse record) throws IOException {
    if (record.tooLarge()) {
      response.setHeader(REPLAYED_HEADER, "true");
      Problem.RESPONSE_NOT_REPLAYABLE.write(response,
          "the request ran once; its response was larger than the gateway stores, so it cannot be sent again", null,
          Map.of("original_status", record.status()));
      return;
    }
    response.setStatus(record.status());
    java.util.Set<String> seen = StoredResponse.writeHeaders(response, record.headers());
    response.setHeader(REPLAYED_HEADER, "true");
    if (!seen.contains("content-length")) {
      response.setContentLength(record.body().length);
    }
    response.getOutputStream().write(record.body());
  }

  private void tooLarge(HttpServletResponse response) throws IOException {
    Problem.REQUEST_TOO_LARGE.write(response, "the body is larger than " + maxRequestBytes + " bytes", null);
  }

  private boolean requiresKey(String path) {
    return requireKey.stream().anyMatch(path::startsWith);
  }

  /**
   * The outcome of a request (2xx, and 4xx other than 408, 409, 425 and 429), stored and
   * replayed; anything else may go otherwise on a retry.
   */
  static boolean isFinal(int status) {
    if (status >= 200 && status < 300) {
      return true;
    }
    return status >= 400 && status < 500 && status != 408 && status != 409 && status != 425 && status != 429;
  }

  /** The path and query as the client sent them (the gateway's path_and_query). */
  static String requestTarget(HttpServletRequest request) {
    String query = request.getQueryString();
    return query == null ? request.getRequestURI() : request.getRequestURI() + "?" + query;
  }
}

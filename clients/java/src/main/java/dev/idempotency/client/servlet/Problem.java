package dev.idempotency.client.servlet;

import com.fasterxml.jackson.core.JsonProcessingException;
import com.fasterxml.jackson.databind.ObjectMapper;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Map;
import java.util.TreeMap;

/**
 * The answers the filter makes itself: RFC 9457 problem+json documents with the gateway's types,
 * titles and statuses (gateway/src/problem.rs), members sorted by name as the gateway's
 * serde_json map writes them.
 */
enum Problem {
  KEY_MISSING(400, "key-missing", "An idempotency key is required"),
  KEY_REPEATED(400, "key-repeated", "The idempotency key header appears more than once"),
  KEY_MALFORMED(400, "key-malformed", "The idempotency key is malformed"),
  IDENTITY_MISSING(400, "identity-missing", "The caller's identity header is missing"),
  REQUEST_TOO_LARGE(413, "request-too-large", "The request body is too large"),
  REQUEST_UNREADABLE(400, "request-unreadable", "The request body could not be read"),
  KEY_REUSED(422, "key-reused", "The idempotency key was used for a different request"),
  IN_PROGRESS(409, "in-progress", "A request with this idempotency key is being processed"),
  LEASE_LOST(409, "lease-lost", "The request's claim on the key was lost"),
  COORDINATOR_UNAVAILABLE(503, "coordinator-unavailable", "The idempotency coordinator is unavailable"),
  COORDINATOR_REFUSED(500, "coordinator-refused", "The idempotency coordinator refused the gateway"),
  RESPONSE_NOT_REPLAYABLE(500, "response-not-replayable", "The response to this key cannot be replayed"),
  STORED_RESPONSE_UNREADABLE(500, "stored-response-unreadable", "The stored response cannot be read");

  /** The prefix of every problem's type. */
  static final String TYPE_PREFIX = "urn:idempotency-gateway:problem:";

  private static final ObjectMapper JSON = new ObjectMapper();

  final int status;
  final String slug;
  final String title;

  Problem(int status, String slug, String title) {
    this.status = status;
    this.slug = slug;
    this.title = title;
  }

  /** The problem document's bytes, with extra members. */
  byte[] document(String detail, Map<String, Object> extra) {
    Map<String, Object> members = new TreeMap<>(extra);
    members.put("type", TYPE_PREFIX + slug);
    members.put("title", title);
    members.put("status", status);
    members.put("detail", detail);
    try {
      return JSON.writeValueAsString(members).getBytes(StandardCharsets.UTF_8);
    } catch (JsonProcessingException e) {
      throw new IllegalStateException(e); // strings and ints only: it cannot fail
    }
  }

  /** Answers the problem, with {@code Retry-After} when {@code retryAfter} is given. */
  void write(HttpServletResponse response, String detail, Duration retryAfter, Map<String, Object> extra)
      throws IOException {
    byte[] body = document(detail, extra);
    response.setStatus(status);
    response.setHeader("Content-Type", "application/problem+json");
    response.setContentLength(body.length);
    if (retryAfter != null) {
      response.setHeader("Retry-After", Long.toString(retryAfterSeconds(retryAfter)));
    }
    response.getOutputStream().write(body);
  }

  void write(HttpServletResponse response, String detail, Duration retryAfter) throws IOException {
    write(response, detail, retryAfter, Map.of());
  }

  /** Whole seconds, rounded up, at least 1 (0 would invite a busy loop). */
  static long retryAfterSeconds(Duration d) {
    long seconds = d.getSeconds() + (d.getNano() > 0 ? 1 : 0);
    return Math.max(1, seconds);
  }

  /** A duration as Rust's Debug writes it ("5s", "1.5s", "250ms"), so details read like the gateway's. */
  static String rustDuration(Duration d) {
    long n = d.toNanos();
    if (n >= 1_000_000_000L) {
      return format(n / 1_000_000_000L, n % 1_000_000_000L, 9, "s");
    } else if (n >= 1_000_000L) {
      return format(n / 1_000_000L, n % 1_000_000L, 6, "ms");
    } else if (n >= 1_000L) {
      return format(n / 1_000L, n % 1_000L, 3, "µs");
    }
    return n + "ns";
  }

  private static String format(long whole, long fraction, int digits, String unit) {
    String s = Long.toString(whole);
    if (fraction > 0) {
      String f = String.format("%0" + digits + "d", fraction).replaceAll("0+$", "");
      s += "." + f;
    }
    return s + unit;
  }
}

package dev.idempotency.client.servlet;

import dev.idempotency.client.IdempotencyClient;
import jakarta.servlet.Filter;
import jakarta.servlet.FilterChain;
import jakarta.servlet.FilterConfig;
import jakarta.servlet.ServletException;
import jakarta.servlet.ServletRequest;
import jakarta.servlet.ServletResponse;
import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.Set;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The {@link IdempotencyFilter} for containers that make the filter themselves from its class
 * name: {@code web.xml}, {@code ServletContext.addFilter(name, Class)}. It is a public class with
 * a no-argument constructor; its settings are init-params named as the gateway's flags
 * (docs/gateway.md), and it makes its own {@link IdempotencyClient} in {@link #init} and closes it
 * in {@link #destroy}.
 *
 * <table>
 *   <caption>init-params</caption>
 *   <tr><th>name</th><th>default</th><th>what</th></tr>
 *   <tr><td>{@code namespace}</td><td>(required)</td><td>the namespace of the keys</td></tr>
 *   <tr><td>{@code coordinator}</td><td>{@code http://127.0.0.1:50051}</td><td>{@code http://host:port}, or
 *       {@code https://host:port} (TLS, with the system's roots unless {@code coordinator-ca})</td></tr>
 *   <tr><td>{@code coordinator-ca}</td><td>none</td><td>a PEM file of CAs to trust instead</td></tr>
 *   <tr><td>{@code token-file}</td><td>none</td><td>a file holding the bearer token (whitespace around it
 *       ignored)</td></tr>
 *   <tr><td>{@code coordinator-timeout}</td><td>{@code 5s}</td><td>each call's deadline</td></tr>
 *   <tr><td>{@code coordinator-retry}</td><td>{@code 2s}</td><td>the retry budget</td></tr>
 *   <tr><td>{@code methods}, {@code header}, {@code require-key}, {@code max-key-length},
 *       {@code identity-header}, {@code wait}, {@code lease}, {@code retention}, {@code max-request-bytes},
 *       {@code max-stored-response-bytes}, {@code fail-open}</td><td>as the gateway</td><td>the {@link
 *       IdempotencyFilter.Builder} setting of the same name; lists are comma-separated, {@code fail-open}
 *       is {@code true} or {@code false}</td></tr>
 * </table>
 *
 * <p>Durations are written as the gateway's: {@code 500ms}, {@code 5s}, {@code 1h30m}, {@code
 * 30d}. An init-param of another name, or a value out of its bounds, fails {@link #init}, so that
 * a misspelt setting is not silently left at its default.
 */
public final class ConfiguredIdempotencyFilter implements Filter {
  private static final Set<String> PARAMS = Set.of("namespace", "coordinator", "coordinator-ca", "token-file",
      "coordinator-timeout", "coordinator-retry", "methods", "header", "require-key", "max-key-length",
      "identity-header", "wait", "lease", "retention", "max-request-bytes", "max-stored-response-bytes", "fail-open");
  private static final Pattern DURATION_PART = Pattern.compile("(\\d+)(ms|s|m|h|d)");

  // Set by init, before the container passes any request; volatile, so that every request thread
  // sees them whatever the container's own ordering.
  private volatile IdempotencyClient client;
  private volatile IdempotencyFilter filter;

  /** The filter, configured later by the container's {@link #init}. */
  public ConfiguredIdempotencyFilter() {}

  /**
   * Reads the init-params, connects to the coordinator and builds the filter.
   *
   * @param config the filter's configuration
   * @throws ServletException for an unknown init-param or a value out of its bounds
   */
  @Override
  public void init(FilterConfig config) throws ServletException {
    List<String> unknown = new ArrayList<>();
    for (String name : Collections.list(config.getInitParameterNames())) {
      if (!PARAMS.contains(name)) {
        unknown.add(name);
      }
    }
    if (!unknown.isEmpty()) {
      throw new ServletException("idempotency filter " + config.getFilterName() + ": unknown init-params " + unknown
          + "; known: " + PARAMS.stream().sorted().toList());
    }
    IdempotencyClient made = null;
    try {
      IdempotencyClient.Builder coordinator = coordinator(config);
      made = coordinator
          .callTimeout(duration("coordinator-timeout", param(config, "coordinator-timeout", "5s")))
          .retryBudget(duration("coordinator-retry", param(config, "coordinator-retry", "2s")))
          .build();
      String namespace = config.getInitParameter("namespace");
      if (namespace == null) {
        throw new IllegalArgumentException("namespace: required");
      }
      IdempotencyFilter.Builder b = IdempotencyFilter.builder(made, namespace.strip());
      String value;
      if ((value = config.getInitParameter("methods")) != null) {
        b.methods(list(value).toArray(String[]::new));
      }
      if ((value = config.getInitParameter("header")) != null) {
        b.header(value.strip());
      }
      if ((value = config.getInitParameter("require-key")) != null) {
        b.requireKey(list(value).toArray(String[]::new));
      }
      if ((value = config.getInitParameter("max-key-length")) != null) {
        b.maxKeyLength(integer("max-key-length", value));
      }
      if ((value = config.getInitParameter("identity-header")) != null) {
        b.identityHeader(value.strip());
      }
      if ((value = config.getInitParameter("wait")) != null) {
        b.maxWait(duration("wait", value));
      }
      if ((value = config.getInitParameter("lease")) != null) {
        b.lease(duration("lease", value));
      }
      if ((value = config.getInitParameter("retention")) != null) {
        b.retention(duration("retention", value));
      }
      if ((value = config.getInitParameter("max-request-bytes")) != null) {
        b.maxRequestBytes(integer("max-request-bytes", value));
      }
      if ((value = config.getInitParameter("max-stored-response-bytes")) != null) {
        b.maxStoredResponseBytes(integer("max-stored-response-bytes", value));
      }
      if (bool("fail-open", param(config, "fail-open", "false"))) {
        b.failOpen();
      }
      this.filter = b.build();
      this.client = made;
    } catch (IllegalArgumentException | IOException e) {
      if (made != null) {
        made.close();
      }
      throw new ServletException("idempotency filter " + config.getFilterName() + ": " + e.getMessage(), e);
    }
  }

  /** The client's builder for the {@code coordinator} URL, its CA and its token. */
  private static IdempotencyClient.Builder coordinator(FilterConfig config) throws IOException {
    String url = param(config, "coordinator", "http://127.0.0.1:50051").strip();
    URI uri;
    try {
      uri = new URI(url);
    } catch (URISyntaxException e) {
      throw new IllegalArgumentException("coordinator: " + e.getMessage(), e);
    }
    boolean tls = "https".equals(uri.getScheme());
    if (!tls && !"http".equals(uri.getScheme()) || uri.getHost() == null || uri.getPort() < 0
        || uri.getRawUserInfo() != null || !(uri.getRawPath() == null || uri.getRawPath().isEmpty()
            || "/".equals(uri.getRawPath())) || uri.getRawQuery() != null || uri.getRawFragment() != null) {
      throw new IllegalArgumentException("coordinator: must be http://host:port or https://host:port (got " + url + ")");
    }
    IdempotencyClient.Builder b = IdempotencyClient.builder(uri.getHost() + ":" + uri.getPort());
    String ca = config.getInitParameter("coordinator-ca");
    if (ca != null) {
      if (!tls) {
        throw new IllegalArgumentException("coordinator-ca: belongs to an https:// coordinator");
      }
      b.trustedCertificates(Files.readAllBytes(Path.of(ca.strip())));
    } else if (tls) {
      b.useTransportSecurity();
    }
    String tokenFile = config.getInitParameter("token-file");
    if (tokenFile != null) {
      b.token(Files.readString(Path.of(tokenFile.strip()), StandardCharsets.UTF_8).strip());
    }
    return b;
  }

  private static String param(FilterConfig config, String name, String otherwise) {
    String value = config.getInitParameter(name);
    return value != null ? value : otherwise;
  }

  /** A comma-separated list, each item stripped, empty items left out. */
  private static List<String> list(String value) {
    return Arrays.stream(value.split(",")).map(String::strip).filter(s -> !s.isEmpty()).toList();
  }

  private static int integer(String name, String value) {
    try {
      return Integer.parseInt(value.strip());
    } catch (NumberFormatException e) {
      throw new IllegalArgumentException(name + ": not a whole number of bytes (got " + value + ")", e);
    }
  }

  private static boolean bool(String name, String value) {
    return switch (value.strip()) {
      case "true" -> true;
      case "false" -> false;
      default -> throw new IllegalArgumentException(name + ": must be true or false (got " + value + ")");
    };
  }

  /** A duration as the gateway's flags write it: one or more of {@code <digits><ms|s|m|h|d>}. */
  static Duration duration(String name, String value) {
    String text = value.strip();
    Matcher part = DURATION_PART.matcher(text);
    Duration total = Duration.ZERO;
    int at = 0;
    while (at < text.length() && part.find(at) && part.start() == at) {
      try {
        long n = Long.parseLong(part.group(1));
        total = total.plus(switch (part.group(2)) {
          case "ms" -> Duration.ofMillis(n);
          case "s" -> Duration.ofSeconds(n);
          case "m" -> Duration.ofMinutes(n);
          case "h" -> Duration.ofHours(n);
          default -> Duration.ofDays(n);
        });
      } catch (NumberFormatException | ArithmeticException e) {
        throw new IllegalArgumentException(name + ": too large (got " + value + ")", e);
      }
      at = part.end();
    }
    if (at == 0 || at != text.length()) {
      throw new IllegalArgumentException(name + ": a duration such as 500ms, 5s, 1h30m or 30d (got " + value + ")");
    }
    return total;
  }

  /**
   * Passes the request to the configured {@link IdempotencyFilter}.
   *
   * @throws IllegalStateException when the container did not {@link #init} the filter
   */
  @Override
  public void doFilter(ServletRequest request, ServletResponse response, FilterChain chain)
      throws IOException, ServletException {
    IdempotencyFilter configured = filter;
    if (configured == null) {
      throw new IllegalStateException("the idempotency filter was not initialised (init) by its container");
    }
    configured.doFilter(request, response, chain);
  }

  /** Closes the client {@link #init} made. */
  @Override
  public void destroy() {
    IdempotencyClient made = client;
    client = null;
    filter = null;
    if (made != null) {
      made.close();
    }
  }
}

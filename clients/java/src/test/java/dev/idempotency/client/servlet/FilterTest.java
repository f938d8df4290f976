package dev.idempotency.client.servlet;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import dev.idempotency.client.Claim;
import dev.idempotency.client.Coordinator;
import dev.idempotency.client.IdempotencyClient;
import dev.idempotency.client.KeyState;
import dev.idempotency.client.LoopbackJetty;
import dev.idempotency.client.SharedCoordinator;
import dev.idempotency.client.TryStartRequest;
import jakarta.servlet.DispatcherType;
import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.time.Duration;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.HexFormat;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.atomic.AtomicInteger;
import org.eclipse.jetty.ee10.servlet.FilterHolder;
import org.eclipse.jetty.ee10.servlet.ServletContextHandler;
import org.eclipse.jetty.ee10.servlet.ServletHolder;
import org.eclipse.jetty.server.Server;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;

/**
 * The filter in an embedded Jetty 12 (ee10), with real HTTP requests, against the real
 * coordinator (SQLite); and the real gateway sharing keys with it both ways.
 */
class FilterTest {
  private static final ObjectMapper JSON = new ObjectMapper();
  /** The length of the answer to a "big" order: over a stored limit of 1 KiB. */
  static final int BIG = 4000;
  @RegisterExtension
  static final SharedCoordinator COORDINATOR = new SharedCoordinator();
  private static IdempotencyClient client;
  private static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1)
      .connectTimeout(Duration.ofSeconds(5)).build();

  @BeforeAll
  static void start() {
    client = IdempotencyClient.builder(COORDINATOR.get().address()).retryBudget(Duration.ofSeconds(2)).build();
  }

  @AfterAll
  static void stop() {
    client.close();
  }

  /** The API under test: numbers the orders it creates and echoes the lease token it got. */
  static final class Orders extends HttpServlet {
    private static final long serialVersionUID = 1L;
    final AtomicInteger created = new AtomicInteger();
    volatile long delayMillis;

    @Override
    protected void doPost(HttpServletRequest req, HttpServletResponse resp) throws IOException {
      String body = new String(req.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
      try {
        Thread.sleep(delayMillis);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new IOException(e);
      }
      if (body.contains("flaky")) {
        created.incrementAndGet();
        resp.sendError(503, "try again");
        return;
      }
      int n = created.incrementAndGet();
      resp.setStatus(201);
      if (body.contains("big")) {
        resp.setContentType("text/plain");
        resp.getWriter().write("x".repeat(BIG));
        return;
      }
      resp.setContentType("application/json");
      resp.addHeader("Set-Cookie", "a=1");
      resp.addHeader("Set-Cookie", "b=2");
      String token = req.getHeader(IdempotencyFilter.LEASE_TOKEN_HEADER);
      resp.getWriter().write("{\"order\":" + n + ",\"lease_token\":" + (token == null ? "null" : "\"" + token + "\"") + "}");
    }
  }

  /** A Jetty server with the servlet, behind the filter when one is given. */
  record App(Server server, String url, Orders orders) implements AutoCloseable {
    static App start(IdempotencyFilter filter) throws Exception {
      Server server = LoopbackJetty.server();
      ServletContextHandler context = new ServletContextHandler();
      context.setContextPath("/");
      Orders orders = new Orders();
      context.addServlet(new ServletHolder(orders), "/*");
      if (filter != null) {
        context.addFilter(new FilterHolder(filter), "/*", EnumSet.of(DispatcherType.REQUEST));
      }
      server.setHandler(context);
      server.start();
      return new App(server, LoopbackJetty.url(server), orders);
    }

    @Override
    public void close() {
      try {
        server.stop();
      } catch (Exception e) {
        throw new IllegalStateException(e);
      }
    }
  }

  static HttpResponse<String> post(String url, String key, String body, String... headers) throws Exception {
    return post(url, key, HttpRequest.BodyPublishers.ofString(body), headers);
  }

  /** A POST with a JSON content type, the key when given, and more headers (name, value, ...). */
  static HttpResponse<String> post(String url, String key, HttpRequest.BodyPublisher body, String... headers)
      throws Exception {
    HttpRequest.Builder req = HttpRequest.newBuilder(URI.create(url)).timeout(Duration.ofSeconds(30))
        .header("Content-Type", "application/json").POST(body);
    if (headers.length > 0) {
      req.headers(headers);
    }
    if (key != null) {
      req.header("Idempotency-Key", key);
    }
    return HTTP.send(req.build(), HttpResponse.BodyHandlers.ofString());
  }

  static String problemType(HttpResponse<String> r) throws IOException {
    assertEquals("application/problem+json", r.headers().firstValue("content-type").orElse(""));
    JsonNode doc = JSON.readTree(r.body());
    assertEquals(r.statusCode(), doc.get("status").asInt());
    return doc.get("type").asText().replace("urn:idempotency-gateway:problem:", "");
  }

  @Test
  void twentyConcurrentDuplicatesRunTheHandlerOnce() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").maxWait(Duration.ofSeconds(20)).build();
    try (App app = App.start(filter)) {
      app.orders().delayMillis = 500;
      String key = "\"" + UUID.randomUUID() + "\"";
      List<CompletableFuture<HttpResponse<String>>> answers = new ArrayList<>();
      for (int i = 0; i < 20; i++) {
        answers.add(CompletableFuture.supplyAsync(() -> {
          try {
            return post(app.url() + "/orders?x=1", key, "{\"item\":\"book\"}");
          } catch (Exception e) {
            throw new IllegalStateException(e);
          }
        }));
      }
      String first = null;
      int replayed = 0;
      for (CompletableFuture<HttpResponse<String>> a : answers) {
        HttpResponse<String> r = a.get();
        assertEquals(201, r.statusCode(), r.body());
        first = first == null ? r.body() : first;
        assertEquals(first, r.body());
        assertEquals(List.of("a=1", "b=2"), r.headers().allValues("set-cookie"));
        replayed += r.headers().firstValue("idempotent-replayed").isPresent() ? 1 : 0;
      }
      assertEquals(1, app.orders().created.get(), "the handler ran once");
      assertEquals(19, replayed);
      assertTrue(first.contains("\"lease_token\":\""), first);
    }
  }

  @Test
  void theFilterAnswersAsTheGatewayDoes() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").maxWait(Duration.ZERO)
        .requireKey("/required").build();
    try (App app = App.start(filter)) {
      String key = UUID.randomUUID().toString();
      assertEquals(201, post(app.url() + "/orders", key, "{\"item\":\"pen\"}").statusCode());
      HttpResponse<String> reused = post(app.url() + "/orders", key, "{\"item\":\"ink\"}");
      assertEquals(422, reused.statusCode());
      assertEquals("key-reused", problemType(reused));
      // Without a key: passed through, or refused under a required prefix.
      assertEquals(201, post(app.url() + "/orders", null, "{}").statusCode());
      HttpResponse<String> missing = post(app.url() + "/required/x", null, "{}");
      assertEquals(400, missing.statusCode());
      assertEquals("key-missing", problemType(missing));
      HttpResponse<String> malformed = post(app.url() + "/orders", "a b", "{}");
      assertEquals("key-malformed", problemType(malformed));
      // An answer that is not final releases the key: a retry runs again.
      String flaky = UUID.randomUUID().toString();
      int before = app.orders().created.get();
      assertEquals(503, post(app.url() + "/orders", flaky, "{\"item\":\"flaky\"}").statusCode());
      assertEquals(503, post(app.url() + "/orders", flaky, "{\"item\":\"flaky\"}").statusCode());
      assertEquals(before + 2, app.orders().created.get());
      // Another request holds the key: 409 in-progress with Retry-After.
      app.orders().delayMillis = 1500;
      String slow = UUID.randomUUID().toString();
      CompletableFuture<HttpResponse<String>> running = CompletableFuture.supplyAsync(() -> {
        try {
          return post(app.url() + "/orders", slow, "{\"item\":\"slow\"}");
        } catch (Exception e) {
          throw new IllegalStateException(e);
        }
      });
      Thread.sleep(500);
      HttpResponse<String> busy = post(app.url() + "/orders", slow, "{\"item\":\"slow\"}");
      assertEquals(409, busy.statusCode());
      assertEquals("in-progress", problemType(busy));
      assertEquals("1", busy.headers().firstValue("retry-after").orElse(""));
      assertEquals(201, running.get().statusCode());
    }
  }

  /**
   * A request whose wait for the key outlasts its own lease: a crashed holder (a bare claim of the
   * key for the same request, as the filter fingerprints it, with a 2.5 s lease nobody renews) and
   * a filter with a 2 s lease and a 10 s wait. The request gets the key only when the holder's
   * lease runs out, 2.5 s into its TryStart; the filter renews the lease before the servlet runs
   * (docs/contract.md, "A claim that waited"), so the servlet runs once, whole (1.5 s, not
   * interrupted), and its answer is stored and replayed.
   */
  @Test
  void aRequestThatWaitedOutACrashedHolderRunsOnceAndIsReplayed() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").lease(Duration.ofSeconds(2))
        .maxWait(Duration.ofSeconds(10)).build();
    try (App app = App.start(filter)) {
      app.orders().delayMillis = 1500;
      String key = UUID.randomUUID().toString();
      String body = "{\"item\":\"book\"}";
      byte[] fingerprint = HttpKeys.fingerprint("POST", "/orders",
          "application/json".getBytes(StandardCharsets.ISO_8859_1), body.getBytes(StandardCharsets.UTF_8));
      assertInstanceOf(Claim.Started.class, client.tryStart(TryStartRequest.builder("orders", key)
          .fingerprint(fingerprint).leaseTtl(Duration.ofMillis(2500)).build()));

      long began = System.nanoTime();
      HttpResponse<String> first = post(app.url() + "/orders", key, body);
      long tookMillis = Duration.ofNanos(System.nanoTime() - began).toMillis();
      assertEquals(201, first.statusCode(), first.body());
      assertEquals(1, app.orders().created.get(), "the servlet ran once, whole");
      assertTrue(tookMillis >= 2500 + 1500 - 300, "waited out the holder, then ran the servlet: " + tookMillis + " ms");
      KeyState.Completed stored = assertInstanceOf(KeyState.Completed.class, client.lookup("orders", key));
      assertEquals(201, StoredResponse.CODEC.decode(stored.response()).status());

      HttpResponse<String> again = post(app.url() + "/orders", key, body);
      assertEquals(201, again.statusCode());
      assertEquals(first.body(), again.body());
      assertEquals(first.headers().allValues("set-cookie"), again.headers().allValues("set-cookie"));
      assertEquals("true", again.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(1, app.orders().created.get(), "the replay did not run the servlet");
    }
  }

  @Test
  void failOpenRunsTheHandlerWithoutTheCoordinatorAndFailClosedRefuses() throws Exception {
    int port;
    try (ServerSocket free = new ServerSocket(0, 1, InetAddress.getLoopbackAddress())) {
      port = free.getLocalPort(); // closed again: nothing listens there
    }
    try (IdempotencyClient unreachable = IdempotencyClient.builder("127.0.0.1:" + port).retryBudget(Duration.ZERO)
        .build()) {
      try (App app = App.start(IdempotencyFilter.builder(unreachable, "orders").failOpen().build())) {
        HttpResponse<String> r = post(app.url() + "/orders", "k", "{}");
        assertEquals(201, r.statusCode(), r.body());
        assertEquals("not-deduplicated", r.headers().firstValue("idempotency-warning").orElse(""));
        assertEquals(1, app.orders().created.get());
      }
      try (App app = App.start(IdempotencyFilter.builder(unreachable, "orders").build())) {
        HttpResponse<String> r = post(app.url() + "/orders", "k", "{}");
        assertEquals(503, r.statusCode());
        assertEquals("coordinator-unavailable", problemType(r));
        assertEquals("1", r.headers().firstValue("retry-after").orElse(""));
        assertEquals(0, app.orders().created.get());
      }
    }
  }

  @Test
  void keysAreScopedByTheCallersIdentity() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").identityHeader("X-User").build();
    try (App app = App.start(filter)) {
      String key = UUID.randomUUID().toString();
      String body = "{\"item\":\"book\"}";
      HttpResponse<String> alice = post(app.url() + "/orders", key, body, "X-User", "alice");
      HttpResponse<String> bob = post(app.url() + "/orders", key, body, "X-User", "bob");
      HttpResponse<String> aliceAgain = post(app.url() + "/orders", key, body, "X-User", "alice");
      assertEquals(201, alice.statusCode());
      assertEquals(201, bob.statusCode());
      assertFalse(bob.headers().firstValue("idempotent-replayed").isPresent(), "bob's key is not alice's");
      assertEquals(alice.body(), aliceAgain.body());
      assertEquals("true", aliceAgain.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(2, app.orders().created.get());
      // Stored under hex(SHA-256(identity)):key, as the gateway stores it.
      String scoped = HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256")
          .digest("alice".getBytes(StandardCharsets.UTF_8))) + ":" + key;
      assertInstanceOf(KeyState.Completed.class, client.lookup("orders", scoped));
      HttpResponse<String> anonymous = post(app.url() + "/orders", key, body);
      assertEquals(400, anonymous.statusCode());
      assertEquals("identity-missing", problemType(anonymous));
    }
  }

  @Test
  void aRequestOverTheLimitIs413AndAResponseOverTheStoredLimitIsNotReplayable() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").maxRequestBytes(1024)
        .maxStoredResponseBytes(1024).build();
    try (App app = App.start(filter)) {
      String large = "{\"item\":\"" + "y".repeat(2000) + "\"}";
      HttpResponse<String> declared = post(app.url() + "/orders", UUID.randomUUID().toString(), large);
      assertEquals(413, declared.statusCode());
      assertEquals("request-too-large", problemType(declared));
      // Chunked: no Content-Length to refuse it by, so the body is read up to the limit.
      HttpResponse<String> chunked = post(app.url() + "/orders", UUID.randomUUID().toString(),
          HttpRequest.BodyPublishers.ofInputStream(() -> new ByteArrayInputStream(large.getBytes(StandardCharsets.UTF_8))));
      assertEquals(413, chunked.statusCode());
      assertEquals("request-too-large", problemType(chunked));
      assertEquals(0, app.orders().created.get());

      String key = UUID.randomUUID().toString();
      HttpResponse<String> first = post(app.url() + "/orders", key, "{\"item\":\"big\"}");
      assertEquals(201, first.statusCode());
      assertEquals(BIG, first.body().length());
      assertEquals("not-replayable", first.headers().firstValue("idempotency-warning").orElse(""));
      HttpResponse<String> retry = post(app.url() + "/orders", key, "{\"item\":\"big\"}");
      assertEquals(500, retry.statusCode());
      assertEquals("response-not-replayable", problemType(retry));
      assertEquals("true", retry.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(201, JSON.readTree(retry.body()).get("original_status").asInt());
      assertEquals(1, app.orders().created.get(), "the handler ran once");
    }
  }

  /** The real gateway and the filter share keys: a request recorded by one is replayed by the other. */
  @Test
  void theGatewayAndTheFilterShareKeys() throws Exception {
    IdempotencyFilter filter = IdempotencyFilter.builder(client, "orders").build();
    try (App filtered = App.start(filter); App upstream = App.start(null); Gateway gateway = Gateway.start(upstream.url())) {
      String body = "{\"item\":\"book\"}";
      // Gateway, then filter.
      String viaGateway = "\"" + UUID.randomUUID() + "\"";
      HttpResponse<String> recorded = post(gateway.url() + "/orders?x=1", viaGateway, body);
      assertEquals(201, recorded.statusCode(), recorded.body() + gateway.log());
      HttpResponse<String> replayed = post(filtered.url() + "/orders?x=1", viaGateway, body);
      assertEquals(201, replayed.statusCode());
      assertEquals(recorded.body(), replayed.body());
      assertEquals("true", replayed.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(0, filtered.orders().created.get());
      // Filter, then gateway.
      String viaFilter = UUID.randomUUID().toString();
      HttpResponse<String> first = post(filtered.url() + "/orders", viaFilter, body);
      assertEquals(201, first.statusCode());
      HttpResponse<String> again = post(gateway.url() + "/orders", viaFilter, body);
      assertEquals(201, again.statusCode(), again.body());
      assertEquals(first.body(), again.body());
      assertEquals("true", again.headers().firstValue("idempotent-replayed").orElse(""));
      assertEquals(List.of("a=1", "b=2"), again.headers().allValues("set-cookie"));
      assertEquals(1, upstream.orders().created.get());
      // The same key for another body: both answer key-reused, with the same document.
      HttpResponse<String> g = post(gateway.url() + "/orders", viaFilter, "{\"item\":\"pen\"}");
      HttpResponse<String> f = post(filtered.url() + "/orders", viaFilter, "{\"item\":\"pen\"}");
      assertEquals(422, g.statusCode());
      assertEquals(g.body(), f.body());
      assertFalse(f.headers().firstValue("idempotent-replayed").isPresent());
    }
  }

  /** The real gateway binary, in front of an upstream, deciding through the test's coordinator. */
  record Gateway(Process process, String url, Path dir) implements AutoCloseable {
    static Gateway start(String upstream) throws Exception {
      Path dir = Files.createTempDirectory("idc-java-gateway-");
      Path addressFile = dir.resolve("address");
      ProcessBuilder pb = new ProcessBuilder(Coordinator.binary().toString(), "gateway", "--listen", "127.0.0.1:0",
          "--address-file", addressFile.toString(), "--upstream", upstream, "--coordinator",
          "http://" + COORDINATOR.get().address(), "--namespace", "orders")
          .redirectErrorStream(true).redirectOutput(dir.resolve("gateway.log").toFile());
      pb.environment().keySet().removeIf(k -> k.startsWith("IDEMPOTENCY_"));
      Process p = pb.start();
      long deadline = System.nanoTime() + Duration.ofSeconds(30).toNanos();
      while (!Files.exists(addressFile) || Files.readString(addressFile).isBlank()) {
        if (!p.isAlive() || System.nanoTime() > deadline) {
          throw new IllegalStateException("the gateway did not start: " + Files.readString(dir.resolve("gateway.log")));
        }
        Thread.sleep(20);
      }
      return new Gateway(p, "http://" + Files.readString(addressFile).trim(), dir);
    }

    String log() throws IOException {
      return Files.readString(dir.resolve("gateway.log"));
    }

    @Override
    public void close() throws IOException {
      process.destroy();
      try {
        if (!process.waitFor(10, java.util.concurrent.TimeUnit.SECONDS)) {
          process.destroyForcibly();
        }
      } catch (InterruptedException e) {
        process.destroyForcibly();
        Thread.currentThread().interrupt();
      }
      try (var files = Files.walk(dir)) {
        files.sorted(java.util.Comparator.reverseOrder()).forEach(f -> f.toFile().delete());
      }
    }
  }
}

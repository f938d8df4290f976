package dev.idempotency.client;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.UncheckedIOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

/**
 * One {@code fault-proxy} process (testkit/src/bin/fault-proxy.rs) in front of a coordinator: a
 * real gRPC proxy that answers statuses of its own, loses answers or refuses connections when its
 * control port says so, and logs when each call arrived. It serves until its stdin closes, which
 * {@link #close()} does.
 */
final class FaultProxy implements AutoCloseable {
  private static final Duration LIMIT = Duration.ofSeconds(20);
  private static final ObjectMapper JSON = new ObjectMapper();

  private final Process process;
  private final Path log;
  private final String address;
  private final URI control;
  // The control port is on loopback and speaks HTTP/1.1: no proxy from the environment, no h2c.
  private final HttpClient http = HttpClient.newBuilder().proxy(HttpClient.Builder.NO_PROXY)
      .version(HttpClient.Version.HTTP_1_1).connectTimeout(LIMIT).build();

  private FaultProxy(Process process, Path log, String address, URI control) {
    this.process = process;
    this.log = log;
    this.address = address;
    this.control = control;
  }

  /** FAULT_PROXY_BIN, or the repository's debug build. */
  static Path binary() {
    String bin = System.getenv("FAULT_PROXY_BIN");
    return bin != null && !bin.isEmpty() ? Path.of(bin) : Coordinator.repoRoot().resolve("target/debug/fault-proxy");
  }

  /** Starts a proxy in front of {@code upstream} (host:port) and reads the addresses it prints. */
  static FaultProxy start(String upstream) {
    Path bin = binary();
    if (!Files.isExecutable(bin)) {
      throw new IllegalStateException("no fault-proxy binary at " + bin + ": build it (cargo build) or set FAULT_PROXY_BIN");
    }
    Process process = null;
    Path log = null;
    try {
      log = Files.createTempFile("fault-proxy-", ".log");
      process = new ProcessBuilder(bin.toString(), "--upstream", upstream)
          .redirectError(log.toFile()).start();
      BufferedReader out = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8));
      String line = CompletableFuture.supplyAsync(() -> {
        try {
          return out.readLine();
        } catch (IOException e) {
          throw new UncheckedIOException(e);
        }
      }).get(LIMIT.toMillis(), TimeUnit.MILLISECONDS);
      if (line == null) {
        throw new IllegalStateException("the fault-proxy exited before it printed its addresses:\n" + read(log));
      }
      JsonNode addresses = JSON.readTree(line);
      if (!addresses.path("proxy").isTextual() || !addresses.path("control").isTextual()) {
        throw new IllegalStateException("the fault-proxy's first line is not its addresses: " + line);
      }
      return new FaultProxy(process, log, addresses.get("proxy").asText(),
          URI.create("http://" + addresses.get("control").asText()));
    } catch (IOException | ExecutionException | TimeoutException | RuntimeException e) {
      stop(process);
      throw new IllegalStateException("the fault-proxy did not start: " + e + (log == null ? "" : "\n" + read(log)), e);
    } catch (InterruptedException e) {
      stop(process);
      Thread.currentThread().interrupt();
      throw new IllegalStateException(e);
    }
  }

  /** Where a client connects instead of the coordinator (host:port). */
  String address() {
    return address;
  }

  /** POST /faults with this fault (a JSON object: method, action, times, ...). */
  void addFault(JsonNode fault) {
    post("/faults", fault.toString());
  }

  /** POST /refuse: every connection is dropped, new ones are closed at once. */
  void refuse() {
    post("/refuse", "");
  }

  /** POST /restore: connections are let through again. */
  void restore() {
    post("/restore", "");
  }

  /** POST /reset: no faults, connections let through, the call log emptied. */
  void reset() {
    post("/reset", "");
  }

  /** GET /calls: for each method, the milliseconds since the proxy started at which its calls arrived. */
  Map<String, List<Double>> calls() {
    String text = send(HttpRequest.newBuilder(control.resolve("/calls")).GET(), "GET /calls");
    JsonNode body;
    try {
      body = JSON.readTree(text);
    } catch (IOException e) {
      throw new UncheckedIOException("fault-proxy GET /calls: " + text, e);
    }
    Map<String, List<Double>> calls = new HashMap<>();
    for (Map.Entry<String, JsonNode> method : body.properties()) {
      List<Double> at = new ArrayList<>();
      method.getValue().forEach(t -> at.add(t.asDouble()));
      calls.put(method.getKey(), at);
    }
    return calls;
  }

  /** How often {@code method} has been called. */
  int callsOf(String method) {
    return calls().getOrDefault(method, List.of()).size();
  }

  /** What the proxy wrote on stderr, for explaining a failure. */
  String log() {
    return read(log);
  }

  private void post(String route, String body) {
    send(HttpRequest.newBuilder(control.resolve(route)).header("content-type", "application/json")
        .POST(HttpRequest.BodyPublishers.ofString(body)), "POST " + route + " " + body);
  }

  private String send(HttpRequest.Builder request, String what) {
    try {
      HttpResponse<String> answer = http.send(request.timeout(LIMIT).build(), HttpResponse.BodyHandlers.ofString());
      if (answer.statusCode() != 200) {
        throw new IllegalStateException("fault-proxy " + what + ": " + answer.statusCode() + " " + answer.body().trim());
      }
      return answer.body();
    } catch (IOException e) {
      throw new UncheckedIOException("fault-proxy " + what, e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException("fault-proxy " + what + ": interrupted", e);
    }
  }

  /** Closes the proxy's stdin, so that it exits, and waits for it (killing it after 10 s). */
  @Override
  public void close() {
    try {
      process.getOutputStream().close();
      if (!process.waitFor(10, TimeUnit.SECONDS)) {
        stop(process);
      }
    } catch (IOException e) {
      stop(process);
    } catch (InterruptedException e) {
      stop(process);
      Thread.currentThread().interrupt();
    }
    try {
      Files.deleteIfExists(log);
    } catch (IOException e) {
      // A temp file left behind is harmless.
    }
  }

  private static void stop(Process process) {
    if (process != null) {
      process.destroyForcibly();
      try {
        process.waitFor(10, TimeUnit.SECONDS);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }
  }

  private static String read(Path file) {
    try {
      return Files.readString(file, StandardCharsets.UTF_8);
    } catch (IOException e) {
      return "(no log: " + e.getMessage() + ")";
    }
  }
}

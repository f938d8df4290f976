package dev.idempotency.client;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.HexFormat;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.function.UnaryOperator;
import java.util.stream.Stream;

/**
 * The real coordinator binary for the tests, on a port of its own (port 0, the bound address
 * read from --address-file) and a store of its own: a fresh PostgreSQL database (made by the
 * binary's migrate-on-start) or a SQLite file in a fresh folder, removed again on close.
 */
public final class Coordinator implements AutoCloseable {
  /** Where a coordinator keeps its keys. */
  public enum Store {
    POSTGRES,
    SQLITE
  }

  private static final Duration STARTUP_LIMIT = Duration.ofSeconds(60);

  private final Store store;
  private final Path dir;
  private final String database;
  private final List<String> extra;
  private final UnaryOperator<IdempotencyClient.Builder> access;
  private Process process;
  private String address;

  private Coordinator(Store store, UnaryOperator<IdempotencyClient.Builder> access, List<String> extra)
      throws IOException {
    this.store = store;
    this.extra = extra;
    this.access = access;
    this.dir = Files.createTempDirectory("idc-java-test-");
    this.database = store == Store.POSTGRES ? "idc_java_" + HexFormat.of().formatHex(randomBytes()) : null;
  }

  private static byte[] randomBytes() {
    byte[] b = new byte[8];
    ThreadLocalRandom.current().nextBytes(b);
    return b;
  }

  /** The repository's root: this project is clients/java. */
  public static Path repoRoot() {
    return Path.of(System.getProperty("user.dir")).resolve("../..").normalize();
  }

  /** IDEMPOTENCY_COORDINATOR_BIN, or the repository's debug build. */
  public static Path binary() {
    String bin = System.getenv("IDEMPOTENCY_COORDINATOR_BIN");
    return bin != null && !bin.isEmpty() ? Path.of(bin) : repoRoot().resolve("target/debug/idempotency-coordinator");
  }

  static String postgresAdminUrl() {
    String url = System.getenv("IDEMPOTENCY_TEST_POSTGRES");
    return url != null && !url.isEmpty() ? url : "postgres://postgres@127.0.0.1:5432";
  }

  /** Starts a coordinator on the store, with extra flags. */
  public static Coordinator start(Store store, String... extra) {
    return start(store, UnaryOperator.identity(), extra);
  }

  /**
   * Starts a coordinator on the store, with extra flags that make callers need {@code access}
   * (a token, TLS): the probe that waits for it to serve, and {@link #builder()}, use it.
   */
  public static Coordinator start(Store store, UnaryOperator<IdempotencyClient.Builder> access, String... extra) {
    try {
      Coordinator c = new Coordinator(store, access, List.of(extra));
      try {
        c.launch("127.0.0.1:0");
      } catch (RuntimeException e) {
        c.close();
        throw e;
      }
      return c;
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  /** host:port */
  public String address() {
    return address;
  }

  /** A builder of a client of this coordinator, with the access it needs. */
  public IdempotencyClient.Builder builder() {
    return access.apply(IdempotencyClient.builder(address));
  }

  /** A client of this coordinator with a short retry budget, for tests. */
  public IdempotencyClient client() {
    return builder().retryBudget(Duration.ofSeconds(5)).build();
  }

  private void launch(String listen) throws IOException {
    Path addressFile = dir.resolve("address-" + UUID.randomUUID());
    List<String> args = new ArrayList<>(List.of(binary().toString(), "serve", "--listen", listen, "--address-file",
        addressFile.toString(), "--shutdown-grace", "5s", "--health-check-interval", "200ms"));
    if (store == Store.POSTGRES) {
      args.addAll(List.of("--database-url", postgresAdminUrl() + "/" + database));
    } else {
      args.addAll(List.of("--sqlite-path", dir.resolve("coordinator.db").toString()));
    }
    args.addAll(extra);
    ProcessBuilder pb = new ProcessBuilder(args).redirectErrorStream(true)
        .redirectOutput(dir.resolve("coordinator.log").toFile());
    // The binaries' own settings are not inherited: a developer's DATABASE_URL must not turn a
    // SQLite test into a PostgreSQL one.
    pb.environment().keySet().removeIf(k -> k.startsWith("IDEMPOTENCY_") || k.equals("DATABASE_URL"));
    process = pb.start();
    long deadline = System.nanoTime() + STARTUP_LIMIT.toNanos();
    while (true) {
      if (Files.exists(addressFile)) {
        String text = Files.readString(addressFile, StandardCharsets.UTF_8).trim();
        if (!text.isEmpty()) {
          address = text;
          break;
        }
      }
      if (!process.isAlive()) {
        throw new IllegalStateException("the coordinator exited at start:\n" + log());
      }
      if (System.nanoTime() > deadline) {
        throw new IllegalStateException("the coordinator wrote no address:\n" + log());
      }
      sleep(20);
    }
    awaitServing(deadline);
  }

  /** Serving once a Lookup answers (the coordinator refuses calls until its store is ready). */
  private void awaitServing(long deadline) {
    try (IdempotencyClient probe = builder().retryBudget(Duration.ZERO)
        .callTimeout(Duration.ofSeconds(1)).build()) {
      while (true) {
        try {
          probe.lookup("probe", "probe");
          return;
        } catch (IdempotencyException e) {
          if (System.nanoTime() > deadline || !process.isAlive()) {
            throw new IllegalStateException("the coordinator never served (" + e.getMessage() + "):\n" + log(), e);
          }
          sleep(50);
        }
      }
    }
  }

  /** A caller's token as {@code token new} makes it: the secret, and the tokens file's line. */
  public record Token(String secret, String line) {}

  /**
   * A new token from the binary's {@code token new}: read from its standard output; its notes (a
   * prefix scope that leaves out its bare name) go to standard error, passed on to the test's.
   */
  public static Token newToken(String name, String scopes) {
    try {
      Process p = new ProcessBuilder(binary().toString(), "token", "new", "--name", name, "--scopes", scopes)
          .redirectError(ProcessBuilder.Redirect.INHERIT).start();
      String out = new String(p.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
      waitFor(p);
      List<String> lines = out.lines().filter(l -> !l.isBlank() && !l.startsWith("#")).toList();
      if (p.exitValue() != 0 || lines.size() != 2 || !lines.get(0).startsWith("idc_")) {
        throw new IllegalStateException("token new said:\n" + out);
      }
      return new Token(lines.get(0), lines.get(1));
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  /** Ends the coordinator with SIGKILL, as a crash would. */
  public void kill() {
    if (process != null) {
      process.destroyForcibly(); // SIGKILL on Unix
      waitFor(process);
      process = null;
    }
  }

  /** Starts it again on the same address and store. */
  public void restart() {
    IllegalStateException last = null;
    for (int i = 0; i < 50; i++) {
      try {
        launch(address);
        return;
      } catch (IOException | IllegalStateException e) {
        // A port just freed by a killed process can take a moment to be free for a new listener.
        last = new IllegalStateException(e.getMessage(), e);
        if (process != null) {
          process.destroyForcibly();
          waitFor(process);
          process = null;
        }
        sleep(100);
      }
    }
    throw last;
  }

  public String log() {
    try {
      String text = Files.readString(dir.resolve("coordinator.log"), StandardCharsets.UTF_8);
      return text.length() > 20000 ? text.substring(text.length() - 20000) : text;
    } catch (IOException e) {
      return "(no log: " + e.getMessage() + ")";
    }
  }

  @Override
  public void close() {
    if (process != null) {
      process.destroy(); // SIGTERM: the contract says it drains and exits 0
      try {
        if (!process.waitFor(20, TimeUnit.SECONDS)) {
          process.destroyForcibly();
          waitFor(process);
        }
      } catch (InterruptedException e) {
        process.destroyForcibly();
        Thread.currentThread().interrupt();
      }
      process = null;
    }
    if (database != null) {
      try {
        Process drop = new ProcessBuilder("psql", postgresAdminUrl() + "/postgres", "-X", "-q", "-c",
            "DROP DATABASE IF EXISTS \"" + database + "\" WITH (FORCE)").redirectErrorStream(true).start();
        drop.getInputStream().readAllBytes();
        waitFor(drop);
      } catch (IOException e) {
        // Left for the next cleanup: a test database is harmless.
      }
    }
    try (Stream<Path> files = Files.walk(dir)) {
      files.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
    } catch (IOException e) {
      // A temp folder left behind is harmless.
    }
  }

  private static void waitFor(Process p) {
    boolean interrupted = false;
    while (true) {
      try {
        p.waitFor();
        break;
      } catch (InterruptedException e) {
        interrupted = true;
      }
    }
    if (interrupted) {
      Thread.currentThread().interrupt();
    }
  }

  static void sleep(long millis) {
    try {
      Thread.sleep(millis);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(e);
    }
  }
}

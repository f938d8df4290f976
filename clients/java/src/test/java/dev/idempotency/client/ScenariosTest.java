package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.text.MessageFormat;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Queue;
import java.util.ResourceBundle;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.stream.Stream;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.TestFactory;
import org.junit.jupiter.api.extension.RegisterExtension;

/**
 * The scenario vectors every client passes (clients/conformance/scenarios.json; its README says
 * what each step and expectation means): {@code runOnce} against the real coordinator on SQLite,
 * with a {@link FaultProxy} between the client and the coordinator, one proxy and one fresh client
 * per scenario, one scenario after the other. Nothing sleeps to synchronise: a run's work reports
 * through futures and latches, and {@code await_calls} polls the proxy's call log; {@code
 * pause_ms} and a work's {@code duration_ms} are the scenario's own timing.
 *
 * <p>The error kinds are this client's exceptions: {@code mismatch} {@link
 * FingerprintMismatchException}, {@code in_progress} {@link InProgressException}, {@code
 * lease_lost} {@link LeaseLostException}, {@code result_not_stored} {@link
 * ResultNotStoredException} (its {@code result()} the carried result), {@code unavailable}
 * {@link UnavailableException}, {@code unauthenticated} {@link UnauthenticatedException}, {@code
 * work_failed} the very exception the work threw (runOnce rethrows it as it is, checked ones too),
 * and {@code other} any other {@link IdempotencyException}. The client cancels a work by
 * interrupting its thread with {@link Lease#isLost()} true: that is {@code work_cancelled}.
 */
class ScenariosTest {
  private static final Path FILE = Coordinator.repoRoot().resolve("clients/conformance/scenarios.json");
  /**
   * Bounds every wait of the runner beyond what a step asks for itself (a run's wait, its retry
   * budget): generous, for a loaded machine.
   */
  private static final Duration LIMIT = Duration.ofSeconds(20);
  /** The suite's own namespace; keys are made unique per run of the suite. */
  private static final String NAMESPACE = "conformance-java";
  private static final ObjectMapper JSON = new ObjectMapper();
  private static final ResultCodec<Object> CODEC = ResultCodec.json(Object.class);

  @RegisterExtension
  static final SharedCoordinator COORDINATOR = new SharedCoordinator();
  /** Lookups for expect_key go straight to the coordinator, not through a proxy. */
  private static IdempotencyClient direct;
  private static String suiteRun;

  @BeforeAll
  static void connect() {
    direct = COORDINATOR.get().client();
    byte[] id = new byte[6];
    ThreadLocalRandom.current().nextBytes(id);
    suiteRun = "java-" + HexFormat.of().formatHex(id);
  }

  @AfterAll
  static void disconnect() {
    if (direct != null) {
      direct.close();
    }
  }

  @TestFactory
  Stream<DynamicTest> everyScenario() throws IOException {
    return ScenarioVectors.load(FILE).stream().map(scenario -> DynamicTest.dynamicTest(scenario.get("name").asText(), () -> {
      try (Runner runner = new Runner(scenario)) {
        runner.run();
      }
    }));
  }

  // ---------------------------------------------------------------------------------------
  // One scenario

  /** One runOnce on a thread of its own, and what its work saw. */
  private static final class Run {
    final String name;
    final JsonNode work;
    final Duration limit;
    final CompletableFuture<Void> started = new CompletableFuture<>();
    final CountDownLatch gate = new CountDownLatch(1);
    final CompletableFuture<Outcome<Object>> done = new CompletableFuture<>();
    final List<String> problems = new CopyOnWriteArrayList<>();
    volatile boolean workRan;
    volatile long attempt;
    volatile boolean cancelled;
    /** The very exception a failing work threw. */
    volatile Exception workFailure;
    /** How long runOnce took, in nanoseconds, once it has returned. */
    volatile long elapsedNanos;
    boolean joined;

    Run(String name, JsonNode work, Duration limit) {
      this.name = name;
      this.work = work;
      this.limit = limit;
    }
  }

  /** Runs one scenario's steps: a proxy of its own, and a fresh client whose target is the proxy. */
  private static final class Runner implements AutoCloseable {
    private final JsonNode scenario;
    private final String prefix;
    private final Journal journal = new Journal();
    private final Duration budget;
    private final FaultProxy proxy;
    private final IdempotencyClient client;
    private final ExecutorService pool = Executors.newCachedThreadPool(task -> {
      Thread t = new Thread(task, "scenario-run");
      t.setDaemon(true);
      return t;
    });
    private final Map<String, Run> runs = new LinkedHashMap<>();
    private final List<Run> all = new ArrayList<>();
    /** Set when the scenario ends: an interrupt after it is the runner's, not the client's. */
    private volatile boolean over;

    Runner(JsonNode scenario) {
      this.scenario = scenario;
      this.prefix = suiteRun + "/" + scenario.get("name").asText() + "/";
      JsonNode budgetMs = scenario.path("client").path("retry_budget_ms");
      this.budget = budgetMs.isMissingNode() ? Defaults.RETRY_POLICY.budget() : Duration.ofMillis(budgetMs.asLong());
      this.proxy = FaultProxy.start(COORDINATOR.get().address());
      IdempotencyClient.Builder builder = IdempotencyClient.builder(proxy.address()).logger(journal);
      if (!budgetMs.isMissingNode()) {
        builder.retryBudget(budget);
      }
      this.client = builder.build();
    }

    void run() {
      try {
        int n = 0;
        for (JsonNode step : scenario.get("steps")) {
          step("step " + ++n, step);
        }
        for (Run run : runs.values()) {
          assertTrue(run.joined, "run " + run.name + " was started and never joined");
        }
      } catch (AssertionError | RuntimeException e) {
        throw new AssertionError(scenario.get("name").asText() + " (" + scenario.get("what").asText() + "): "
            + e.getMessage() + "\nproxy calls: " + callsForTheRecord() + "\nclient log:\n" + journal, e);
      }
    }

    private void step(String where, JsonNode step) {
      if (step.has("run")) {
        JsonNode spec = step.get("run");
        if (spec.has("as")) {
          String name = spec.get("as").asText();
          assertFalse(runs.containsKey(name), where + ": a run named " + name + " twice");
          runs.put(name, start(name, spec));
        } else {
          join(start(where, spec), step.get("expect"));
        }
      } else if (step.has("join")) {
        join(named(where, step.get("join").asText()), step.get("expect"));
      } else if (step.has("await_started")) {
        awaitStarted(where, named(where, step.get("await_started").asText()));
      } else if (step.has("open_gate")) {
        Run run = named(where, step.get("open_gate").asText());
        assertTrue(run.work.path("gate").asBoolean() && run.gate.getCount() > 0, where + ": run " + run.name
            + " has no gate to open");
        run.gate.countDown();
      } else if (step.has("fault")) {
        proxy.addFault(step.get("fault"));
      } else if (step.has("refuse")) {
        proxy.refuse();
      } else if (step.has("restore")) {
        proxy.restore();
      } else if (step.has("reset")) {
        proxy.reset();
      } else if (step.has("await_calls")) {
        awaitCalls(where, step.get("await_calls"));
      } else if (step.has("expect_calls")) {
        expectCalls(where, step.get("expect_calls"));
      } else if (step.has("claim")) {
        claim(where, step.get("claim"));
      } else if (step.has("pause_ms")) {
        // The scenario's own timing (a holder that keeps the key this long), not a wait for
        // something the runner could watch.
        Coordinator.sleep(step.get("pause_ms").asLong());
      } else {
        expectKey(where, step.get("expect_key"));
      }
    }

    private Run named(String where, String name) {
      Run run = runs.get(name);
      assertTrue(run != null, where + ": no run named " + name + " was started");
      return run;
    }

    /**
     * One bare TryStart through the scenario's client, with the fingerprint runOnce sends for the
     * request, and nothing after it: a holder whose process died, whose lease runs out.
     */
    private void claim(String where, JsonNode spec) {
      Object request = JSON.convertValue(spec.get("request"), Object.class);
      Claim claim = client.tryStart(TryStartRequest.builder(NAMESPACE, prefix + spec.get("key").asText())
          .fingerprint(Fingerprints.of(request)).leaseTtl(Duration.ofMillis(spec.get("lease_ttl_ms").asLong())).build());
      assertInstanceOf(Claim.Started.class, claim, where + ": the claim's TryStart");
    }

    /** Calls runOnce on a thread of its own, with a work that does what the run's work says. */
    private Run start(String name, JsonNode spec) {
      Object request = JSON.convertValue(spec.get("request"), Object.class);
      JsonNode work = spec.get("work");
      Object result = work.has("result") ? JSON.convertValue(work.get("result"), Object.class) : null;
      RunOptions.Builder options = RunOptions.builder();
      Duration wait = Duration.ZERO;
      if (spec.has("wait_ms")) {
        wait = Duration.ofMillis(spec.get("wait_ms").asLong());
        options.maxWait(wait);
      }
      if (spec.has("lease_ttl_ms")) {
        options.lease(Duration.ofMillis(spec.get("lease_ttl_ms").asLong()));
      }
      Run run = new Run(name, work, LIMIT.plus(wait).plus(budget));
      all.add(run);
      String key = prefix + spec.get("key").asText();
      RunOptions runOptions = options.build();
      Work<Object, Exception> body = lease -> work(run, lease, result);
      pool.execute(() -> {
        long began = System.nanoTime();
        try {
          Outcome<Object> outcome = client.runOnce(NAMESPACE, key, request, CODEC, runOptions, body);
          run.elapsedNanos = System.nanoTime() - began;
          run.done.complete(outcome);
        } catch (Throwable t) {
          run.elapsedNanos = System.nanoTime() - began;
          run.done.completeExceptionally(t);
        }
      });
      return run;
    }

    private Object work(Run run, Lease lease, Object result) throws Exception {
      run.workRan = true;
      run.attempt = lease.attempt();
      run.started.complete(null);
      if (run.work.path("gate").asBoolean() && !waitFor(run, lease, run.gate) && !run.cancelled) {
        run.problems.add("its gate was not opened within " + LIMIT);
      }
      if (run.work.path("until_cancelled").asBoolean()) {
        waitFor(run, lease, new CountDownLatch(1)); // only the client's cancellation (or the limit) ends it
      }
      if (run.work.has("duration_ms")) {
        workFor(run, lease, run.work.get("duration_ms").asLong());
      }
      if (Thread.currentThread().isInterrupted() && lease.isLost() && !over) {
        run.cancelled = true; // cancelled while it did not wait
      }
      if (run.work.path("refuse_at_end").asBoolean()) {
        try {
          proxy.refuse();
        } catch (RuntimeException e) {
          run.problems.add("the work could not refuse connections: " + e);
        }
      }
      if (run.work.has("fail")) {
        Exception failure = new Exception(run.work.get("fail").asText());
        run.workFailure = failure;
        throw failure;
      }
      return result;
    }

    /**
     * Waits for the latch, at most {@link #LIMIT}; answers whether it opened. The client
     * interrupts the work's thread when the lease is lost: that ends the wait, as a cancellation.
     */
    private boolean waitFor(Run run, Lease lease, CountDownLatch latch) {
      try {
        return latch.await(LIMIT.toMillis(), TimeUnit.MILLISECONDS);
      } catch (InterruptedException e) {
        interrupted(run, lease);
        return false;
      }
    }

    /**
     * Works for that long, watching for the client's cancellation (the interrupt of the work's
     * thread): cancelled, the work notes it and fails with the interrupt, so that a cancelled run
     * never returns its result.
     */
    private void workFor(Run run, Lease lease, long millis) throws InterruptedException {
      try {
        Thread.sleep(millis);
      } catch (InterruptedException e) {
        interrupted(run, lease);
        throw e;
      }
    }

    /**
     * Notes the interrupt of a work's thread: while the scenario runs, a cancellation, which only a
     * lost lease may bring.
     */
    private void interrupted(Run run, Lease lease) {
      if (!over) {
        run.cancelled = true;
        if (!lease.isLost()) {
          run.problems.add("the work's thread was interrupted, but its lease is not lost");
        }
      }
    }

    private void awaitStarted(String where, Run run) {
      try {
        CompletableFuture.anyOf(run.started, run.done).get(LIMIT.toMillis(), TimeUnit.MILLISECONDS);
      } catch (TimeoutException e) {
        fail(where + ": run " + run.name + "'s work had not started after " + LIMIT);
      } catch (ExecutionException e) {
        // The run ended with an error before its work started: said below.
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        fail(where + ": interrupted");
      }
      assertTrue(run.started.isDone(), where + ": run " + run.name + " ended without starting its work: " + ending(run));
    }

    /** Waits for the run to end and checks its outcome against expect. */
    private void join(Run run, JsonNode expect) {
      assertFalse(run.joined, "run " + run.name + " joined twice");
      run.joined = true;
      Outcome<Object> outcome = null;
      Throwable error = null;
      try {
        outcome = run.done.get(run.limit.toMillis(), TimeUnit.MILLISECONDS);
      } catch (ExecutionException e) {
        error = e.getCause();
      } catch (TimeoutException e) {
        fail("run " + run.name + " had not returned after " + run.limit);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        fail("run " + run.name + ": interrupted");
      }
      List<String> wrong = new ArrayList<>(run.problems);
      if (expect.has("result")) {
        if (error != null) {
          wrong.add("want the result " + expect.get("result") + ", got " + error);
        } else {
          String got = canonical(outcome.value());
          if (!got.equals(canonical(expect.get("result")))) {
            wrong.add("got the result " + got + ", want " + expect.get("result"));
          }
          if (expect.has("work_ran") && outcome.replayed() == expect.get("work_ran").asBoolean()) {
            wrong.add("Outcome.replayed() is " + outcome.replayed() + ", want " + !expect.get("work_ran").asBoolean()
                + " (work_ran " + expect.get("work_ran") + ")");
          }
        }
      }
      if (expect.has("error")) {
        String want = expect.get("error").asText();
        if (error == null) {
          wrong.add("want the error kind " + want + ", got the result " + canonical(outcome.value()));
        } else if (!kindOf(run, error).equals(want)) {
          wrong.add("want the error kind " + want + ", got " + kindOf(run, error) + ": " + error);
        }
      }
      if (expect.has("carried_result") && error instanceof ResultNotStoredException notStored
          && !canonical(notStored.result()).equals(canonical(expect.get("carried_result")))) {
        wrong.add("the error carries the result " + canonical(notStored.result()) + ", want " + expect.get("carried_result"));
      }
      if (expect.has("work_ran") && run.workRan != expect.get("work_ran").asBoolean()) {
        wrong.add("the work ran: " + run.workRan + ", want " + expect.get("work_ran"));
      }
      if (expect.has("work_cancelled") && run.cancelled != expect.get("work_cancelled").asBoolean()) {
        wrong.add("the client cancelled the work: " + run.cancelled + ", want " + expect.get("work_cancelled"));
      }
      if (expect.has("attempt")) {
        if (!run.workRan) {
          wrong.add("want the work to see attempt " + expect.get("attempt") + ", but it did not run");
        } else if (run.attempt != expect.get("attempt").asLong()) {
          wrong.add("the work saw attempt " + run.attempt + ", want " + expect.get("attempt"));
        }
      }
      if (expect.has("min_elapsed_ms")
          && Duration.ofNanos(run.elapsedNanos).compareTo(Duration.ofMillis(expect.get("min_elapsed_ms").asLong())) < 0) {
        wrong.add("runOnce took " + Duration.ofNanos(run.elapsedNanos).toMillis() + " ms, under "
            + expect.get("min_elapsed_ms") + " ms");
      }
      if (!wrong.isEmpty()) {
        fail("run " + run.name + ":\n  " + String.join("\n  ", wrong));
      }
    }

    /** Polls the proxy's call log until the method has been called count times. */
    private void awaitCalls(String where, JsonNode want) {
      String method = want.get("method").asText();
      int count = want.get("count").asInt();
      long deadline = System.nanoTime() + LIMIT.toNanos();
      int calls;
      while ((calls = proxy.callsOf(method)) < count) {
        assertTrue(System.nanoTime() < deadline, where + ": " + method + " was called " + calls + " times after "
            + LIMIT + ", want " + count);
        Coordinator.sleep(20); // the poll's interval
      }
    }

    /** Exactly count calls of the method, and the second at least min_gap_ms after the first. */
    private void expectCalls(String where, JsonNode want) {
      String method = want.get("method").asText();
      List<Double> at = proxy.calls().getOrDefault(method, List.of());
      assertEquals(want.get("count").asInt(), at.size(), where + ": the calls of " + method + " (at " + at + " ms)");
      if (want.has("min_gap_ms")) {
        double gap = at.get(1) - at.get(0);
        assertTrue(gap >= want.get("min_gap_ms").asDouble(), where + ": the second " + method + " came " + gap
            + " ms after the first, want at least " + want.get("min_gap_ms") + " ms");
      }
    }

    /** Looks the key up straight from the coordinator. */
    private void expectKey(String where, JsonNode want) {
      String key = want.get("key").asText();
      KeyState state = direct.lookup(NAMESPACE, prefix + key);
      String got = state instanceof KeyState.Absent ? "absent"
          : state instanceof KeyState.InProgress ? "in_progress" : "completed";
      assertEquals(want.get("state").asText(), got, where + ": the key " + key + " is " + state);
      if (want.has("attempt")) {
        assertEquals(want.get("attempt").asLong(), ((KeyState.InProgress) state).attempt(),
            where + ": the attempt of the key " + key);
      }
    }

    private String callsForTheRecord() {
      try {
        return proxy.calls().toString();
      } catch (RuntimeException e) {
        return "(" + e + ")";
      }
    }

    /** Ends whatever still runs (a scenario that failed half-way), and the proxy. */
    @Override
    public void close() {
      over = true;
      all.forEach(run -> run.gate.countDown());
      pool.shutdownNow(); // a run still waiting for its claim is cancelled
      client.close(); // calls that outlive the caller (Complete, Release) end at once
      boolean ended = false;
      try {
        ended = pool.awaitTermination(LIMIT.toMillis(), TimeUnit.MILLISECONDS);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      proxy.close();
      assertTrue(ended, "a run still had not returned " + LIMIT + " after the scenario ended");
    }
  }

  // ---------------------------------------------------------------------------------------

  /** The kind of expect.error a run's failure is, or what it is when it is not the client's. */
  private static String kindOf(Run run, Throwable error) {
    if (error instanceof ResultNotStoredException) {
      return "result_not_stored";
    } else if (error instanceof LeaseLostException) {
      return "lease_lost";
    } else if (run.workFailure != null && error == run.workFailure) {
      return "work_failed";
    } else if (error instanceof FingerprintMismatchException) {
      return "mismatch";
    } else if (error instanceof InProgressException) {
      return "in_progress";
    } else if (error instanceof UnauthenticatedException) {
      return "unauthenticated";
    } else if (error instanceof UnavailableException) {
      return "unavailable";
    } else if (error instanceof IdempotencyException) {
      return "other";
    }
    return "foreign (" + error.getClass().getName() + ")";
  }

  private static String ending(Run run) {
    if (!run.done.isDone()) {
      return "(still running)";
    }
    try {
      return "the result " + canonical(run.done.getNow(null).value());
    } catch (RuntimeException e) {
      return String.valueOf(e.getCause());
    }
  }

  /**
   * A JSON value's canonical form (a JsonNode of the file, or what the codec decoded), so that
   * values compare whatever the order of their members or the spelling of their numbers.
   */
  private static String canonical(Object value) {
    try {
      byte[] bytes = value instanceof JsonNode node ? Fingerprints.canonicalJsonText(node.toString())
          : Fingerprints.canonicalJson(value);
      return new String(bytes, StandardCharsets.UTF_8);
    } catch (RuntimeException e) {
      return "<" + value + ": " + e.getMessage() + ">";
    }
  }

  /** The client's log of one scenario, shown when it fails. */
  private static final class Journal implements System.Logger {
    private final Queue<String> lines = new ConcurrentLinkedQueue<>();

    @Override
    public String getName() {
      return "scenario";
    }

    @Override
    public boolean isLoggable(Level level) {
      return true;
    }

    @Override
    public void log(Level level, ResourceBundle bundle, String message, Throwable thrown) {
      lines.add(level + " " + message + (thrown == null ? "" : " " + thrown));
    }

    @Override
    public void log(Level level, ResourceBundle bundle, String format, Object... params) {
      lines.add(level + " " + (params == null || params.length == 0 ? format : MessageFormat.format(format, params)));
    }

    @Override
    public String toString() {
      return String.join("\n", lines);
    }
  }
}

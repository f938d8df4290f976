package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.idempotency.client.Coordinator.Store;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedClass;
import org.junit.jupiter.params.provider.EnumSource;

/**
 * runOnce and its kin against the real coordinator, on PostgreSQL and on SQLite: every test has a
 * coordinator of its own on a fresh store, and a client of it with the default settings.
 */
@ParameterizedClass
@EnumSource(Store.class)
class RunOnceTest {
  record Charge(String id, int cents) {}

  private final Store store;
  private Coordinator coordinator;
  private IdempotencyClient client;

  RunOnceTest(Store store) {
    this.store = store;
  }

  @BeforeEach
  void start() {
    coordinator = Coordinator.start(store);
    client = coordinator.client();
  }

  @AfterEach
  void stop() {
    if (client != null) {
      client.close();
    }
    if (coordinator != null) {
      coordinator.close();
    }
  }

  private static String key() {
    return "k-" + UUID.randomUUID();
  }

  @Test
  void twoConcurrentCallersRunTheWorkOnceAndBothGetItsResult() throws Exception {
    String key = key();
    AtomicInteger runs = new AtomicInteger();
    CountDownLatch started = new CountDownLatch(1);
    RunOptions waiting = RunOptions.builder().maxWait(Duration.ofSeconds(20)).build();
    ExecutorService pool = Executors.newFixedThreadPool(2);
    try {
      Future<Outcome<Charge>> first = pool.submit(() -> client.runOnce("payments", key, Map.of("cents", 500),
          ResultCodec.json(Charge.class), waiting, lease -> {
            runs.incrementAndGet();
            started.countDown();
            Thread.sleep(700);
            return new Charge("ch_1", 500);
          }));
      assertTrue(started.await(20, TimeUnit.SECONDS));
      Future<Outcome<Charge>> second = pool.submit(() -> client.runOnce("payments", key, Map.of("cents", 500),
          ResultCodec.json(Charge.class), waiting, lease -> {
            runs.incrementAndGet();
            return new Charge("ch_2", 500);
          }));
      Outcome<Charge> a = first.get(30, TimeUnit.SECONDS);
      Outcome<Charge> b = second.get(30, TimeUnit.SECONDS);
      assertEquals(1, runs.get());
      assertEquals(new Charge("ch_1", 500), a.value());
      assertEquals(a.value(), b.value());
      assertFalse(a.replayed());
      assertTrue(b.replayed());
    } finally {
      pool.shutdownNow();
    }
  }

  @Test
  void replayMismatchInProgressAndRelease() {
    String key = key();
    Outcome<Charge> first = client.runOnce("payments", key, Map.of("a", 1, "b", 2), Charge.class,
        lease -> new Charge("ch", 1));
    assertFalse(first.replayed());
    // The same request, its members in another order: replayed, the work not run.
    Outcome<Charge> again = client.runOnce("payments", key, Map.of("b", 2, "a", 1), Charge.class, lease -> {
      throw new AssertionError("ran twice");
    });
    assertTrue(again.replayed());
    assertEquals(first.value(), again.value());
    assertThrows(FingerprintMismatchException.class,
        () -> client.runOnce("payments", key, Map.of("a", 2), Charge.class, lease -> new Charge("x", 2)));

    // A failure of the work releases the key and is rethrown as it is (checked ones too).
    String failing = key();
    java.io.IOException boom = new java.io.IOException("boom");
    java.io.IOException thrown = assertThrows(java.io.IOException.class,
        () -> client.runOnce("payments", failing, null, Charge.class, lease -> {
          throw boom;
        }));
    assertEquals(boom, thrown);
    assertInstanceOf(KeyState.Absent.class, client.lookup("payments", failing));

    // Another holder: in progress at once with the default wait.
    String held = key();
    Claim claim = client.tryStart(TryStartRequest.builder("payments", held).build());
    Claim.Started started = assertInstanceOf(Claim.Started.class, claim);
    InProgressException busy = assertThrows(InProgressException.class,
        () -> client.runOnce("payments", held, null, Charge.class, lease -> new Charge("x", 1)));
    assertTrue(busy.retryAfter().compareTo(Duration.ofSeconds(31)) < 0);
    client.release("payments", held, started.token());
    assertEquals("x", client.runOnce("payments", held, null, Charge.class, lease -> new Charge("x", 1)).value().id());
  }

  @Test
  void aLostLeaseInterruptsTheWorkAndTheInterruptIsCleared() throws Exception {
    String key = key();
    AtomicBoolean interrupted = new AtomicBoolean();
    CountDownLatch holding = new CountDownLatch(1);
    // No heartbeat and a short lease: another caller takes the key over once it runs out.
    RunOptions shortLease = RunOptions.builder().lease(Duration.ofMillis(600)).withoutHeartbeat().build();
    ExecutorService pool = Executors.newSingleThreadExecutor();
    try {
      Future<Boolean> victim = pool.submit(() -> {
        LeaseLostException lost = assertThrows(LeaseLostException.class,
            () -> client.runOnce("jobs", key, null, ResultCodec.utf8(), shortLease, lease -> {
              holding.countDown();
              try {
                Thread.sleep(30_000);
              } catch (InterruptedException e) {
                interrupted.set(true);
                assertTrue(lease.isLost());
                throw e;
              }
              return "late";
            }));
        assertTrue(lost.getMessage().contains("lease"));
        return Thread.currentThread().isInterrupted();
      });
      assertTrue(holding.await(20, TimeUnit.SECONDS));
      assertFalse(victim.get(20, TimeUnit.SECONDS), "runOnce cleared the interrupt it caused");
      assertTrue(interrupted.get());
      // The next caller takes the key over; it waits on the coordinator for the last
      // milliseconds of the lease by the database clock (the client's timer counts from before
      // the claim was sent, so it fires first).
      Outcome<String> next = client.runOnce("jobs", key, null, ResultCodec.utf8(),
          RunOptions.builder().maxWait(Duration.ofSeconds(10)).build(),
          lease -> "attempt " + lease.attempt());
      assertEquals("attempt 2", next.value());
    } finally {
      pool.shutdownNow();
    }

    // Taken over while the heartbeat runs: the heartbeat hears LEASE_LOST and cancels async work.
    String taken = key();
    CompletableFuture<String> work = new CompletableFuture<>();
    CompletableFuture<Outcome<String>> run = client.runOnceAsync("jobs", taken, null, ResultCodec.utf8(),
        RunOptions.builder().lease(Duration.ofMillis(400)).heartbeat(Duration.ofSeconds(5)).build(), lease -> work);
    Thread.sleep(1500); // the lease runs out (the watchdog would stop the work too)
    assertTrue(work.isCancelled());
    Throwable failure = assertThrows(java.util.concurrent.ExecutionException.class, run::get).getCause();
    assertInstanceOf(LeaseLostException.class, failure);
  }

  @Test
  void aCoordinatorKilledMidWorkAndRestartedCompletesTheWorkOnce() throws Exception {
    // A retry budget that outlasts the restart.
    try (IdempotencyClient patient = coordinator.builder().retryBudget(Duration.ofSeconds(30)).build()) {
      String key = key();
      AtomicInteger runs = new AtomicInteger();
      Outcome<String> outcome = patient.runOnce("jobs", key, "job", ResultCodec.utf8(),
          RunOptions.builder().lease(Duration.ofSeconds(20)).build(), lease -> {
            runs.incrementAndGet();
            coordinator.kill();
            coordinator.restart();
            return "done by " + lease.token();
          });
      assertEquals(1, runs.get());
      assertFalse(outcome.replayed());
      KeyState state = patient.lookup("jobs", key);
      KeyState.Completed completed = assertInstanceOf(KeyState.Completed.class, state);
      assertEquals(outcome.value(), new String(completed.response(), StandardCharsets.UTF_8));
      assertEquals(outcome.value(), patient.runOnce("jobs", key, "job", ResultCodec.utf8(), RunOptions.defaults(),
          lease -> "again").value());
    }
  }

  @Test
  void aResultThatCannotBeStoredIsReturnedInTheException() {
    // A retry budget that gives up on the killed coordinator within the test.
    try (IdempotencyClient impatient = coordinator.builder()
        .retryBudget(Duration.ofSeconds(3)).callTimeout(Duration.ofSeconds(1)).build()) {
      ResultNotStoredException e = assertThrows(ResultNotStoredException.class,
          () -> impatient.runOnce("jobs", key(), null, ResultCodec.utf8(), RunOptions.defaults(), lease -> {
            coordinator.kill();
            return "the result";
          }));
      assertEquals("the result", e.result(String.class));
      assertInstanceOf(UnavailableException.class, e.getCause(), String.valueOf(e.getCause()));
    }
  }

  @Test
  void theCheckpointIsHandedToTheNextHolderAndEventsAreDeduplicated() {
    String key = key();
    Claim.Started first = assertInstanceOf(Claim.Started.class,
        client.tryStart(TryStartRequest.builder("jobs", key).leaseTtl(Duration.ofMillis(300)).build()));
    client.extendLease("jobs", key, first.token(), Duration.ofMillis(300), "step 3".getBytes(StandardCharsets.UTF_8));
    Coordinator.sleep(700);
    Outcome<String> resumed = client.runOnce("jobs", key, null, ResultCodec.utf8(), RunOptions.defaults(),
        lease -> new String(lease.checkpoint().orElseThrow(), StandardCharsets.UTF_8) + " of attempt " + lease.attempt());
    assertEquals("step 3 of attempt 2", resumed.value());
    assertThrows(LeaseLostException.class, () -> client.complete("jobs", key, first.token(), new byte[0], null));

    assertEquals(List.of("e1", "e2"), client.markProcessed("mailer", List.of("e1", "e2", "e1")));
    assertEquals(List.of("e3"), client.markProcessed("mailer", List.of("e1", "e3")));
    AtomicInteger sent = new AtomicInteger();
    for (int i = 0; i < 2; i++) {
      client.processOnce("mailer", "evt-1", Map.of("to", "a@b"), ResultCodec.json(Integer.class),
          RunOptions.defaults(), lease -> sent.incrementAndGet());
    }
    assertEquals(1, sent.get());
  }
}

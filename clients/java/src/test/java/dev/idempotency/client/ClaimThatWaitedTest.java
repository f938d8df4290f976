package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.ObjectMapper;
import java.time.Duration;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/**
 * docs/contract.md, "A claim that waited", beyond the scenario vectors: a claim whose TryStart
 * took longer than a tenth of the lease is renewed before the work starts, and a renewal that is
 * refused, or cannot get through, keeps the work from running. The real coordinator on SQLite; a
 * holder claims the key straight from it with a short lease that nobody renews, and the caller
 * under test goes through a {@link FaultProxy}, which counts its calls and fails its renewals.
 */
class ClaimThatWaitedTest {
  private static final ObjectMapper JSON = new ObjectMapper();
  private static final String NAMESPACE = "waited";
  /** The lease of the holder that crashed: the caller's TryStart waits this long for the key. */
  private static final Duration HOLDER_LEASE = Duration.ofMillis(400);
  /** The caller's own lease: a tenth of it is well under the holder's lease. */
  private static final Duration LEASE = Duration.ofSeconds(2);
  private static final RunOptions WAITING = RunOptions.builder().lease(LEASE).maxWait(Duration.ofSeconds(10)).build();

  @RegisterExtension
  static final SharedCoordinator COORDINATOR = new SharedCoordinator();
  private static IdempotencyClient direct;
  private FaultProxy proxy;
  private IdempotencyClient client;

  @BeforeAll
  static void connect() {
    direct = COORDINATOR.get().client();
  }

  @AfterAll
  static void disconnect() {
    direct.close();
  }

  @BeforeEach
  void startProxy() {
    proxy = FaultProxy.start(COORDINATOR.get().address());
    client = IdempotencyClient.builder(proxy.address()).build(); // the default 30 s retry budget
  }

  @AfterEach
  void stopProxy() {
    client.close();
    proxy.close();
  }

  /** A key that a holder claimed for the request (null) and then died with. */
  private static String heldByACrashedHolder() {
    String key = "k-" + UUID.randomUUID();
    assertInstanceOf(Claim.Started.class,
        direct.tryStart(TryStartRequest.builder(NAMESPACE, key).leaseTtl(HOLDER_LEASE).build()));
    return key;
  }

  private void failRenewals(String code, String reason, int times) {
    var fault = JSON.createObjectNode().put("method", "ExtendLease").put("action", "status").put("code", code)
        .put("times", times);
    if (reason != null) {
      fault.put("reason", reason);
    }
    proxy.addFault(fault);
  }

  @Test
  void aClaimAnsweredAtOnceIsNotRenewed() {
    Outcome<String> outcome = client.runOnce(NAMESPACE, "k-" + UUID.randomUUID(), null, ResultCodec.utf8(),
        RunOptions.builder().lease(Duration.ofSeconds(3)).build(), lease -> "done");
    assertEquals("done", outcome.value());
    assertEquals(0, proxy.callsOf("ExtendLease"), "no renewal (and no heartbeat within a third of the lease)");
  }

  @ParameterizedTest
  @ValueSource(strings = {"ABORTED LEASE_LOST", "NOT_FOUND KEY_NOT_FOUND"})
  void aRenewalRefusedAsNoLongerThisHoldersIsTheLostLeaseAndTheWorkDoesNotRun(String refusal) {
    String[] codeAndReason = refusal.split(" ");
    failRenewals(codeAndReason[0], codeAndReason[1], 1);
    String key = heldByACrashedHolder();
    AtomicBoolean ran = new AtomicBoolean();
    LeaseLostException lost = assertThrows(LeaseLostException.class,
        () -> client.runOnce(NAMESPACE, key, null, ResultCodec.utf8(), WAITING, lease -> {
          ran.set(true);
          return "done";
        }));
    assertFalse(ran.get(), "the work did not run");
    assertTrue(lost.getMessage().contains("renewed"), lost.getMessage());
    assertEquals(1, proxy.callsOf("ExtendLease"));
    assertEquals(0, proxy.callsOf("Release"), "the key is not this holder's to release");
  }

  @Test
  void aRenewalThatCannotGetThroughFailsWithItsErrorReleasesTheKeyAndTheWorkDoesNotRun() {
    failRenewals("UNAVAILABLE", null, -1);
    String key = heldByACrashedHolder();
    AtomicBoolean ran = new AtomicBoolean();
    long began = System.nanoTime();
    assertThrows(UnavailableException.class,
        () -> client.runOnce(NAMESPACE, key, null, ResultCodec.utf8(), WAITING, lease -> {
          ran.set(true);
          return "done";
        }));
    Duration took = Duration.ofNanos(System.nanoTime() - began);
    assertFalse(ran.get(), "the work did not run");
    // Retried, but only while the lease counted from the TryStart's sending lasted, not for the
    // whole 30 s retry budget.
    List<Double> tryStarts = proxy.calls().get("TryStart");
    List<Double> renewals = proxy.calls().get("ExtendLease");
    assertTrue(renewals.size() >= 2, "the renewal was retried: " + renewals);
    double lastRenewalAfterClaim = renewals.get(renewals.size() - 1) - tryStarts.get(0);
    assertTrue(lastRenewalAfterClaim <= LEASE.toMillis() + 200,
        "the last renewal was sent " + lastRenewalAfterClaim + " ms after the TryStart, past its lease");
    assertTrue(took.compareTo(LEASE.plus(HOLDER_LEASE).plusSeconds(3)) < 0, "runOnce took " + took);
    assertEquals(1, proxy.callsOf("Release"));
    assertInstanceOf(KeyState.Absent.class, direct.lookup(NAMESPACE, key), "released: a retry need not wait");
  }

  /**
   * runOnceAsync after a wait longer than its own lease: the work's future, which ends after most
   * of a lease, is not cancelled, and its result is stored.
   */
  @Test
  void anAsyncClaimThatWaitedLongerThanItsLeaseRunsWithItsWholeLease() throws Exception {
    String key = "k-" + UUID.randomUUID();
    Duration lease = Duration.ofSeconds(1);
    assertInstanceOf(Claim.Started.class,
        direct.tryStart(TryStartRequest.builder(NAMESPACE, key).leaseTtl(Duration.ofMillis(1500)).build()));
    AtomicReference<CompletableFuture<String>> work = new AtomicReference<>();
    CompletableFuture<Outcome<String>> run = client.runOnceAsync(NAMESPACE, key, null, ResultCodec.utf8(),
        RunOptions.builder().lease(lease).maxWait(Duration.ofSeconds(10)).build(), claim -> {
          CompletableFuture<String> late = CompletableFuture.supplyAsync(() -> "attempt " + claim.attempt(),
              CompletableFuture.delayedExecutor(800, TimeUnit.MILLISECONDS));
          work.set(late);
          return late;
        });
    Outcome<String> outcome = run.get(20, TimeUnit.SECONDS);
    assertEquals("attempt 2", outcome.value());
    assertFalse(work.get().isCancelled());
    assertTrue(proxy.callsOf("ExtendLease") >= 1, "renewed before the work started");
    assertInstanceOf(KeyState.Completed.class, direct.lookup(NAMESPACE, key));
  }
}

package dev.idempotency.client;

import java.lang.System.Logger.Level;
import java.time.Duration;
import java.time.Instant;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.Future;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * The claim a running work holds. While the work runs a heartbeat renews the lease; the moment it
 * is lost (the coordinator answered {@code LEASE_LOST}, {@code KEY_NOT_FOUND} or {@code
 * ALREADY_COMPLETED} to a heartbeat) or may have run out while the coordinator could not be
 * reached (a timer at the lease's end, counted from the sending of the call that set the lease and
 * reset by every renewal), the work is stopped: its thread interrupted (blocking {@code runOnce}) or its future
 * cancelled ({@code runOnceAsync}), and {@link #isLost()} turns true for work that polls.
 */
public final class Lease {
  private final String namespace;
  private final String key;
  private final long token;
  private final long attempt;
  private final Optional<byte[]> checkpoint;
  private final Duration leaseTtl;
  private final Runs runs;
  private final CompletableFuture<LeaseLostException> lostSignal = new CompletableFuture<>();
  private final AtomicBoolean beatInFlight = new AtomicBoolean();

  // Guarded by this.
  private Instant expiresAt;
  private long runsOutAt; // System.nanoTime() when the lease may run out at the latest
  private IdempotencyException lastBeatFailure;
  private LeaseLostException lost;
  private Thread workThread;
  private Future<?> asyncWork;
  private boolean workRunning;
  private boolean interruptedByUs;
  private boolean stopped;
  private ScheduledFuture<?> heartbeat;
  private ScheduledFuture<?> watchdog;

  /**
   * The lease of {@code claim}, counted from {@code countedFrom} ({@link System#nanoTime()}): the
   * sending of the call that set it, the TryStart that won the claim or the renewal after a long
   * wait for it, never its answer, so that it never runs out later here than on the coordinator.
   */
  Lease(Runs runs, String namespace, String key, Claim.Started claim, Duration leaseTtl, long countedFrom) {
    this.runs = runs;
    this.namespace = namespace;
    this.key = key;
    this.token = claim.token();
    this.attempt = claim.attempt();
    this.checkpoint = claim.checkpoint();
    this.leaseTtl = leaseTtl;
    this.expiresAt = claim.leaseExpiresAt();
    this.runsOutAt = countedFrom + leaseTtl.toNanos();
  }

  /**
   * The namespace (or consumer) of the key.
   *
   * @return the namespace
   */
  public String namespace() {
    return namespace;
  }

  /**
   * The key (or event id).
   *
   * @return the key
   */
  public String key() {
    return key;
  }

  /**
   * The claim's fencing token: strictly increasing per key, so a downstream store that keeps the
   * highest one it has seen can refuse a late write of an earlier holder.
   *
   * @return the token
   */
  public long token() {
    return token;
  }

  /**
   * 1 for a fresh claim, one more for every takeover.
   *
   * @return the attempt
   */
  public long attempt() {
    return attempt;
  }

  /**
   * What a previous holder saved with {@link #saveCheckpoint} before it released or its lease ran
   * out (handed over on takeover).
   *
   * @return a copy of the checkpoint, empty when none was saved
   */
  public Optional<byte[]> checkpoint() {
    return checkpoint.map(byte[]::clone);
  }

  /**
   * When the lease runs out by the coordinator's clock, as last renewed.
   *
   * @return the instant
   */
  public synchronized Instant expiresAt() {
    return expiresAt;
  }

  /**
   * Whether the lease is lost: the work must stop, the new holder owns the key.
   *
   * @return true once lost
   */
  public synchronized boolean isLost() {
    return lost != null;
  }

  /**
   * Why the lease was lost.
   *
   * @return the reason, empty while the lease is held
   */
  public synchronized Optional<LeaseLostException> lostReason() {
    return Optional.ofNullable(lost);
  }

  /**
   * Throws when the lease is lost; for work that polls between steps.
   *
   * @throws LeaseLostException when the lease is lost
   */
  public void throwIfLost() {
    LeaseLostException reason = lostReason().orElse(null);
    if (reason != null) {
      throw reason;
    }
  }

  /**
   * Completes with the reason when the lease is lost (never, if it is not).
   *
   * @return the signal
   */
  public CompletionStage<LeaseLostException> whenLost() {
    return lostSignal.copy();
  }

  /**
   * Saves progress and renews the lease. If this holder dies, the caller that takes the key over
   * finds it in {@link #checkpoint()}. Retried within the budget after transient failures.
   *
   * @param data at most 64 KiB
   * @throws LeaseLostException when the key is no longer this holder's (the work is stopped too)
   * @throws IllegalArgumentException for a checkpoint over 64 KiB
   */
  public void saveCheckpoint(byte[] data) {
    Futures.await("ExtendLease", saveCheckpointAsync(data));
  }

  /**
   * Saves progress and renews the lease, asynchronously.
   *
   * @param data at most 64 KiB
   * @return completes when saved; fails with {@link LeaseLostException} when the key is no longer
   *     this holder's
   * @throws IllegalArgumentException for a checkpoint over 64 KiB
   */
  public CompletableFuture<Void> saveCheckpointAsync(byte[] data) {
    byte[] checked = Validation.notNull("checkpoint", data);
    Validation.bytes("checkpoint", checked, Limits.MAX_CHECKPOINT_BYTES);
    LeaseLostException reason = lostReason().orElse(null);
    if (reason != null) {
      return CompletableFuture.failedFuture(reason);
    }
    return extend(checked, Caller.Retry.TRANSIENT).thenApply(expiry -> null);
  }

  /** Renews the lease (and saves the checkpoint, when not null). */
  private CompletableFuture<Instant> extend(byte[] data, Caller.Retry retry) {
    long sentAt = System.nanoTime();
    return runs.rpcs()
        .extendLease(namespace, key, token, leaseTtl, data, retry)
        .handle((expiry, failure) -> {
          if (failure != null) {
            Throwable cause = Errors.unwrap(failure);
            if (cause instanceof LeaseLostException
                || cause instanceof KeyNotFoundException
                || cause instanceof AlreadyCompletedException) {
              throw lose((IdempotencyException) cause, "the coordinator answered that the key is no longer this holder's");
            }
            if (cause instanceof IdempotencyException e) {
              synchronized (this) {
                lastBeatFailure = e;
              }
            }
            throw failure instanceof RuntimeException r ? r : new IllegalStateException(failure);
          }
          synchronized (this) {
            expiresAt = expiry;
            lastBeatFailure = null;
            long renewed = sentAt + leaseTtl.toNanos(); // from before the call: never too late
            if (renewed - runsOutAt > 0) {
              runsOutAt = renewed;
            }
          }
          return expiry;
        });
  }

  /** Starts the heartbeat (interval null: none) and the watchdog. */
  synchronized void start(Duration heartbeatInterval) {
    var scheduler = runs.scheduler();
    if (heartbeatInterval != null) {
      long every = heartbeatInterval.toNanos();
      heartbeat = scheduler.scheduleWithFixedDelay(this::beat, every, every, TimeUnit.NANOSECONDS);
    }
    watchdog = scheduler.schedule(this::checkRunOut, runsOutAt - System.nanoTime(), TimeUnit.NANOSECONDS);
  }

  /** Work on this thread runs under the lease: a lost lease interrupts it. */
  synchronized void runningOn(Thread thread) {
    workThread = thread;
    workRunning = true;
    if (lost != null) {
      interrupt();
    }
  }

  /** The async work's future: a lost lease cancels it. */
  synchronized void runningAs(Future<?> work) {
    asyncWork = work;
    workRunning = true;
    if (lost != null) {
      work.cancel(true);
    }
  }

  /**
   * The work has returned: stops the heartbeat and the watchdog, and, on the work's thread,
   * clears the interrupt this lease caused (so that it does not leak into the caller's code).
   */
  void stop() {
    synchronized (this) {
      workRunning = false;
      stopped = true;
      if (heartbeat != null) {
        heartbeat.cancel(false);
      }
      if (watchdog != null) {
        watchdog.cancel(false);
      }
      if (interruptedByUs && Thread.currentThread() == workThread) {
        Thread.interrupted();
        interruptedByUs = false;
      }
    }
  }

  /** Marks the lease lost (once), stops the work and tells who listens; answers the reason. */
  LeaseLostException lose(IdempotencyException why, String message) {
    LeaseLostException reason;
    synchronized (this) {
      if (lost != null) {
        return lost;
      }
      lost = why instanceof LeaseLostException l ? l : Errors.leaseLost("RunOnce", message, why);
      reason = lost;
      if (workRunning) {
        if (workThread != null) {
          interrupt();
        }
        if (asyncWork != null) {
          asyncWork.cancel(true);
        }
      }
    }
    runs.log().log(Level.WARNING, () -> "idempotency: lease lost in namespace " + namespace + "; stopping the work: "
        + reason.getMessage());
    lostSignal.complete(reason);
    return reason;
  }

  private void interrupt() {
    if (workRunning && !interruptedByUs) {
      interruptedByUs = true;
      workThread.interrupt();
    }
  }

  /** One heartbeat: not retried (the next beat is the retry), and never two at once. */
  private void beat() {
    synchronized (this) {
      if (stopped || lost != null) {
        return;
      }
    }
    if (!beatInFlight.compareAndSet(false, true)) {
      return;
    }
    extend(null, Caller.Retry.NEVER).whenComplete((expiry, failure) -> {
      beatInFlight.set(false);
      if (failure != null && !isLost()) {
        runs.log().log(Level.INFO, () -> "idempotency: heartbeat failed; trying again at the next beat: "
            + Errors.unwrap(failure).getMessage());
      }
    });
  }

  /** The watchdog: stops the work once the lease may have run out unrenewed. */
  private void checkRunOut() {
    IdempotencyException why;
    synchronized (this) {
      if (stopped || lost != null) {
        return;
      }
      long left = runsOutAt - System.nanoTime();
      if (left > 0) {
        watchdog = runs.scheduler().schedule(this::checkRunOut, left, TimeUnit.NANOSECONDS);
        return;
      }
      why = lastBeatFailure;
    }
    lose(
        why,
        why == null
            ? "the lease ran out before a heartbeat renewed it"
            : "the lease ran out while the coordinator could not be reached");
  }
}

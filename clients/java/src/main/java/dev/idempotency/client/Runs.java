package dev.idempotency.client;

import dev.idempotency.client.IdempotencyException.Details;
import dev.idempotency.v1.IdempotencyServiceGrpc;
import java.lang.System.Logger.Level;
import java.time.Duration;
import java.time.Instant;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

/**
 * The machinery of {@code runOnce} and {@code processOnce}, blocking and async: claim the key
 * (with one attempt id, waiting for a holder on the coordinator), replay a stored result, run the
 * work under a {@link Lease} (heartbeat, watchdog), then Complete or Release. The client's public
 * methods check nothing more and delegate here.
 */
final class Runs {
  /** What is left of a waiting caller's limit that is too little to ask the coordinator again. */
  private static final Duration WAIT_SLACK = Duration.ofMillis(20);
  /**
   * A claim whose TryStart took longer than the lease divided by this is renewed before the work
   * starts (docs/contract.md, "A claim that waited"): past a tenth, the first heartbeat would have
   * less than two thirds of its margin left.
   */
  private static final long WAITED_CLAIM_LEASE_DIVISOR = 10;

  private final Rpcs rpcs;
  private final Caller caller;
  private final Duration defaultLease;
  private final Duration defaultWait;

  Runs(Rpcs rpcs, Caller caller, Duration defaultLease, Duration defaultWait) {
    this.rpcs = rpcs;
    this.caller = caller;
    this.defaultLease = defaultLease;
    this.defaultWait = defaultWait;
  }

  Rpcs rpcs() {
    return rpcs;
  }

  /** The client's timers: the caller's own. */
  ScheduledExecutorService scheduler() {
    return caller.scheduler();
  }

  /** The client's logger: the caller's own. */
  System.Logger log() {
    return caller.log();
  }

  /** One run's settings, checked. */
  record Spec(
      String namespace, String key, byte[] fingerprint, Duration lease, Duration retention, Duration maxWait,
      Duration heartbeat) {}

  /**
   * Checks one run's input and fills in the client's defaults.
   *
   * @param scopeField what the namespace is called in errors: "namespace" or "consumer"
   * @throws IllegalArgumentException for bad input, before anything is sent
   */
  Spec spec(String scopeField, String namespace, String key, Object request, RunOptions options) {
    Validation.key(scopeField, namespace, key);
    RunOptions o = options == null ? RunOptions.defaults() : options;
    Duration lease = o.lease() != null ? o.lease() : defaultLease;
    Validation.lease("lease", lease, false);
    Validation.retention("retention", o.retention(), true);
    Duration wait = o.maxWait() != null ? o.maxWait() : defaultWait;
    Validation.notNegative("maxWait", wait);
    Duration heartbeat = null;
    if (!o.heartbeatOff()) {
      heartbeat = o.heartbeat() != null ? o.heartbeat() : lease.dividedBy(Defaults.HEARTBEAT_DIVISOR);
      if (heartbeat.isZero() || heartbeat.isNegative()) {
        throw Validation.invalid("heartbeat", "must be positive (got " + heartbeat + ")");
      }
    }
    byte[] fingerprint = o.fingerprint() != null ? o.fingerprint() : Fingerprints.of(request);
    Validation.bytes("fingerprint", fingerprint, Limits.MAX_FINGERPRINT_BYTES);
    return new Spec(namespace, key, fingerprint, lease, o.retention(), wait, heartbeat);
  }

  /** The blocking run: the work on the caller's thread. */
  <T, E extends Exception> Outcome<T> run(Spec spec, ResultCodec<T> codec, Work<T, E> work) throws E {
    Validation.notNull("codec", codec);
    Validation.notNull("work", work);
    Claimed claimed = Futures.await("RunOnce", claimWholeLease(spec));
    if (claimed.claim() instanceof Claim.Completed completed) {
      return replay(completed, codec);
    }
    Lease lease = new Lease(this, spec.namespace(), spec.key(), (Claim.Started) claimed.claim(), spec.lease(),
        claimed.sentAt());
    lease.runningOn(Thread.currentThread());
    T value = null;
    Throwable failure = null;
    try {
      lease.start(spec.heartbeat());
      value = work.run(lease);
    } catch (Throwable t) { // errors too: the key is released for them as for exceptions
      failure = t;
    } finally {
      lease.stop();
    }
    // Settling outlives a caller that was interrupted: the work ran, so its result is stored (or
    // its claim released) whatever became of the caller.
    return Futures.awaitUninterruptibly("RunOnce", settle(lease, value, failure, codec));
  }

  /** The async run: the work's future, cancelled when the lease is lost. */
  <T> CompletableFuture<Outcome<T>> runAsync(Spec spec, ResultCodec<T> codec, AsyncWork<T> work) {
    Validation.notNull("codec", codec);
    Validation.notNull("work", work);
    CompletableFuture<Outcome<T>> result = new CompletableFuture<>();
    AtomicReference<CompletableFuture<?>> stage = new AtomicReference<>();
    result.whenComplete((v, t) -> {
      CompletableFuture<?> current = stage.get();
      if (result.isCancelled() && current != null) {
        current.cancel(true);
      }
    });
    CompletableFuture<Claimed> claiming = claimWholeLease(spec);
    stage.set(claiming);
    claiming.whenComplete((claimed, claimFailure) -> {
      if (claimFailure != null) {
        result.completeExceptionally(Errors.asApiFailure("RunOnce", claimFailure));
        return;
      }
      if (claimed.claim() instanceof Claim.Completed completed) {
        try {
          result.complete(replay(completed, codec));
        } catch (RuntimeException e) {
          result.completeExceptionally(e);
        }
        return;
      }
      Lease lease = new Lease(this, spec.namespace(), spec.key(), (Claim.Started) claimed.claim(), spec.lease(),
          claimed.sentAt());
      CompletableFuture<T> running;
      try {
        lease.start(spec.heartbeat());
        running = work.start(lease).toCompletableFuture();
      } catch (Throwable t) {
        running = CompletableFuture.failedFuture(t);
      }
      stage.set(running);
      lease.runningAs(running);
      running.whenComplete((value, failure) -> {
        lease.stop();
        settle(lease, value, failure == null ? null : Errors.unwrap(failure), codec).whenComplete((outcome, t) -> {
          if (t != null) {
            result.completeExceptionally(Errors.unwrap(t));
          } else {
            result.complete(outcome);
          }
        });
      });
    });
    return result;
  }

  private static <T> Outcome<T> replay(Claim.Completed completed, ResultCodec<T> codec) {
    try {
      return new Outcome<>(codec.decode(completed.response()), true);
    } catch (Exception e) {
      throw Errors.codec("RunOnce", "the stored result cannot be decoded: " + e.getMessage(), e);
    }
  }

  /** After the work: Complete with its result, or Release after its failure. */
  private <T> CompletableFuture<Outcome<T>> settle(Lease lease, T value, Throwable failure, ResultCodec<T> codec) {
    LeaseLostException lost = lease.lostReason().orElse(null);
    if (lost != null) {
      // The new holder owns the key: neither this result nor this failure may be reported as the
      // key's. Nothing is released: the claim is no longer this holder's.
      if (failure != null && failure != lost && !(failure instanceof InterruptedException)
          && !(failure instanceof CancellationException)) {
        lost.addSuppressed(failure);
      }
      return CompletableFuture.failedFuture(lost);
    }
    if (failure != null) {
      return release(lease).thenCompose(released -> CompletableFuture.failedFuture(failure));
    }
    byte[] response;
    try {
      response = codec.encode(value);
    } catch (Exception e) {
      ResultCodecException refused =
          Errors.codec("RunOnce", "the result cannot be encoded (the key was released): " + e.getMessage(), e);
      return release(lease).thenCompose(released -> CompletableFuture.failedFuture(refused));
    }
    return complete(lease, response).thenApply(completion -> new Outcome<>(value, false))
        .exceptionallyCompose(t -> {
          Throwable cause = Errors.unwrap(t);
          if (cause instanceof LeaseLostException) {
            return CompletableFuture.failedFuture(cause);
          }
          IdempotencyException e = cause instanceof IdempotencyException ie ? ie : null;
          Details details = new Details("RunOnce",
              e != null ? e.code() : io.grpc.Status.Code.UNKNOWN,
              e != null ? e.reason().orElse(null) : null,
              "the work ran, but its result was not stored: " + cause.getMessage(),
              List.of(),
              e != null ? e.retryDelay().orElse(null) : null,
              null,
              cause);
          return CompletableFuture.failedFuture(new ResultNotStoredException(details, value));
        });
  }

  /** Gives the claim up so that a retry starts fresh. Failing to is logged, not returned. */
  private CompletableFuture<Void> release(Lease lease) {
    return rpcs.release(lease.namespace(), lease.key(), lease.token()).handle((ok, t) -> {
      if (t == null) {
        return null;
      }
      Throwable cause = Errors.unwrap(t);
      if (cause instanceof KeyNotFoundException) {
        return null; // Already absent: an earlier try of this Release worked, or the key expired.
      }
      if (cause instanceof LeaseLostException e) {
        lease.lose(e, "released by another holder");
        return null;
      }
      log().log(Level.WARNING, () -> "idempotency: could not release a claim in namespace " + lease.namespace()
          + "; it frees when its lease runs out: " + cause.getMessage());
      return null;
    });
  }

  /**
   * Stores the result. A Complete that finds this very result stored already (an earlier try
   * whose answer was lost) counts as success.
   */
  private CompletableFuture<Completion> complete(Lease lease, byte[] response) {
    return rpcs.complete(lease.namespace(), lease.key(), lease.token(), response, null)
        .exceptionallyCompose(t -> {
          Throwable cause = Errors.unwrap(t);
          if (cause instanceof LeaseLostException || cause instanceof KeyNotFoundException) {
            return CompletableFuture.failedFuture(
                Errors.leaseLost("RunOnce", "the result could not be stored: the key is no longer this holder's",
                    cause));
          }
          if (cause instanceof AlreadyCompletedException) {
            return rpcs.lookup(lease.namespace(), lease.key()).thenCompose(state -> {
              if (state instanceof KeyState.Completed c && Arrays.equals(c.response(), response)) {
                return CompletableFuture.completedFuture(new Completion(c.completedAt(), c.expiresAt()));
              }
              return CompletableFuture.failedFuture(cause);
            });
          }
          return CompletableFuture.failedFuture(cause);
        });
  }

  /**
   * A claim that is Started or Completed, when the call that set its lease was sent (the TryStart
   * that won it, first try; or the renewal after a long wait, the try that succeeded) and when its
   * answer came, both by {@link System#nanoTime()}.
   */
  private record Claimed(Claim claim, long sentAt, long answeredAt) {}

  /**
   * Claims the key ({@link #claim}) so that the work starts with its whole lease, as the contract's
   * "A claim that waited" says (docs/contract.md, Client defaults). The lease is counted from the
   * sending of the TryStart that won it, never from its answer, since the coordinator may have
   * granted it at any instant of a wait for another holder; so when that TryStart took longer than
   * a tenth of the lease, as much of it may be spent already (all of it, after a long wait), and the
   * lease is renewed before the work starts and counted from the renewal's sending instead.
   */
  private CompletableFuture<Claimed> claimWholeLease(Spec spec) {
    CompletableFuture<Claimed> result = new CompletableFuture<>();
    AtomicReference<CompletableFuture<Claimed>> stage = new AtomicReference<>();
    result.whenComplete((v, t) -> {
      if (result.isCancelled()) {
        stage.get().cancel(true);
      }
    });
    CompletableFuture<Claimed> claiming = claim(spec);
    stage.set(claiming);
    claiming.whenComplete((claimed, failure) -> {
      if (failure != null) {
        result.completeExceptionally(Errors.unwrap(failure));
        return;
      }
      if (!(claimed.claim() instanceof Claim.Started started)
          || claimed.answeredAt() - claimed.sentAt() <= spec.lease().toNanos() / WAITED_CLAIM_LEASE_DIVISOR) {
        result.complete(claimed);
        return;
      }
      CompletableFuture<Claimed> renewing = renewAfterWait(spec, started, claimed.sentAt());
      stage.set(renewing);
      if (result.isCancelled()) {
        renewing.cancel(true);
      }
      renewing.whenComplete((renewed, renewFailure) -> {
        if (renewFailure != null) {
          result.completeExceptionally(Errors.unwrap(renewFailure));
        } else {
          result.complete(renewed);
        }
      });
    });
    return result;
  }

  /**
   * Renews the lease of a claim whose TryStart waited: one ExtendLease with the run's lease, retried
   * like any (a failure is sent again after the retry pauses) until it succeeds, the lease counted
   * from the claim's sending runs out, or the retry budget does. A refusal that says the key is no
   * longer this holder's is {@link LeaseLostException}; any other failure is the renewal's own
   * error, after a best-effort Release, so that a retry need not wait for the lease to run out.
   * Cancelling the future (the caller gave up) releases the claim too.
   */
  private CompletableFuture<Claimed> renewAfterWait(Spec spec, Claim.Started started, long claimSentAt) {
    Duration retryWithin = Duration.ofNanos(claimSentAt + spec.lease().toNanos() - System.nanoTime());
    var message = Rpcs.extendLeaseMessage(spec.namespace(), spec.key(), started.token(), spec.lease(), null);
    AtomicLong sentAt = new AtomicLong();
    CompletableFuture<dev.idempotency.v1.ExtendLeaseResponse> call =
        caller.callEach("ExtendLease", IdempotencyServiceGrpc.getExtendLeaseMethod(), Caller.Retry.TRANSIENT, () -> {
          // Each try records its sending: the one that succeeds is the last sent, and its sending is
          // when the coordinator's new lease began at the earliest.
          sentAt.set(System.nanoTime());
          return new Caller.Attempt<>(message, Duration.ZERO);
        }, retryWithin);
    CompletableFuture<Claimed> result = new CompletableFuture<>();
    result.whenComplete((v, t) -> {
      if (result.isCancelled()) {
        call.cancel(true);
        releaseAfterFailedRenewal(spec, started.token());
      }
    });
    call.whenComplete((answer, failure) -> {
      if (result.isDone()) {
        return; // cancelled meanwhile, and released
      }
      if (failure == null) {
        Claim.Started renewed = new Claim.Started(started.token(), started.attempt(), Rpcs.leaseExpiry(answer),
            started.checkpoint(), started.attemptId());
        result.complete(new Claimed(renewed, sentAt.get(), System.nanoTime()));
        return;
      }
      Throwable cause = Errors.unwrap(failure);
      if (cause instanceof LeaseLostException
          || cause instanceof KeyNotFoundException
          || cause instanceof AlreadyCompletedException) {
        // As for a heartbeat: the key is no longer this holder's, and there is nothing to release.
        result.completeExceptionally(Errors.leaseLost("RunOnce",
            "the lease could not be renewed after the wait for it: the key is no longer this holder's", cause));
        return;
      }
      releaseAfterFailedRenewal(spec, started.token())
          .whenComplete((released, ignored) -> result.completeExceptionally(cause));
    });
    return result;
  }

  /**
   * Gives up a claim whose renewal did not get through, with one try (the coordinator was just
   * unreachable for the renewal's whole window; more tries would only delay the caller's error,
   * and the claim frees itself when its lease runs out). Failing to is logged, not returned.
   */
  private CompletableFuture<Void> releaseAfterFailedRenewal(Spec spec, long token) {
    return rpcs.release(spec.namespace(), spec.key(), token, Caller.Retry.NEVER).handle((ok, t) -> {
      if (t != null) {
        log().log(Level.WARNING, () -> "idempotency: could not release a claim whose lease could not be renewed in"
            + " namespace " + spec.namespace() + "; it frees when its lease runs out: " + Errors.unwrap(t).getMessage());
      }
      return null;
    });
  }

  /**
   * Sends TryStart with one attempt id for the whole call, waiting for a holder on the coordinator:
   * each TryStart asks it to wait what is left of the caller's limit (at most 60 s). A coordinator
   * that answers in_progress clearly before the wait asked for (it is at its waiter limit) is asked
   * again after a short pause, so that a full coordinator is not hammered.
   */
  private CompletableFuture<Claimed> claim(Spec spec) {
    String attemptId = Rpcs.newAttemptId();
    long waitUntil = System.nanoTime() + spec.maxWait().toNanos();
    CompletableFuture<Claimed> result = new CompletableFuture<>();
    claimStep(spec, attemptId, waitUntil, new long[] {Duration.ofMillis(50).toNanos()}, result);
    return result;
  }

  private void claimStep(Spec spec, String attemptId, long waitUntil, long[] pollStep, CompletableFuture<Claimed> result) {
    if (result.isDone()) {
      return;
    }
    long askedAt = System.nanoTime();
    Duration askedWait = serverWait(waitUntil);
    CompletableFuture<dev.idempotency.v1.TryStartResponse> call =
        caller.callEach("TryStart", IdempotencyServiceGrpc.getTryStartMethod(), Caller.Retry.TRANSIENT, () -> {
          Duration wait = serverWait(waitUntil); // recomputed per try: never past the limit
          return new Caller.Attempt<>(Rpcs.tryStartMessage(spec.namespace(), spec.key(), spec.fingerprint(),
              spec.lease(), spec.retention(), attemptId, wait), wait);
        });
    result.whenComplete((v, t) -> {
      if (result.isCancelled()) {
        call.cancel(true);
      }
    });
    call.whenComplete((answer, failure) -> {
      if (failure != null) {
        result.completeExceptionally(Errors.unwrap(failure));
        return;
      }
      long answeredAt = System.nanoTime();
      Claim claim = Protos.claim(answer, attemptId);
      if (claim instanceof Claim.Started || claim instanceof Claim.Completed) {
        result.complete(new Claimed(claim, askedAt, answeredAt));
      } else if (claim instanceof Claim.FingerprintMismatch) {
        result.completeExceptionally(Errors.mismatch("RunOnce"));
      } else if (claim instanceof Claim.InProgress busy) {
        long remaining = waitUntil - System.nanoTime();
        if (remaining < WAIT_SLACK.toNanos()) {
          Duration retryAfter = Duration.between(Instant.now(), busy.leaseExpiresAt());
          result.completeExceptionally(new InProgressException(
              Details.local("RunOnce", io.grpc.Status.Code.OK, null,
                  "the key is in progress elsewhere (attempt " + busy.attempt() + ")", null),
              busy.leaseExpiresAt(), busy.attempt(), retryAfter.isNegative() ? Duration.ZERO : retryAfter));
          return;
        }
        if (System.nanoTime() - askedAt < askedWait.toNanos() / 2) {
          // The coordinator did not wait (it is at its waiter limit): pause before asking again.
          long step = pollStep[0];
          long pause = Math.min(remaining, (long) (step * (0.5 + 0.5 * ThreadLocalRandom.current().nextDouble())));
          pollStep[0] = Math.min(Duration.ofSeconds(1).toNanos(), (long) (step * 1.5));
          try {
            scheduler().schedule(() -> claimStep(spec, attemptId, waitUntil, pollStep, result), pause, TimeUnit.NANOSECONDS);
          } catch (RuntimeException closed) {
            result.completeExceptionally(Errors.cancelled("TryStart", "the client is closed", closed));
          }
        } else {
          claimStep(spec, attemptId, waitUntil, pollStep, result);
        }
      } else {
        result.completeExceptionally(Errors.unexpected("TryStart", "TryStart answered an outcome this client does not know"));
      }
    });
  }

  /** What a TryStart sent now asks the coordinator to wait: what is left, at most 60 s, in whole ms. */
  private static Duration serverWait(long waitUntil) {
    long left = Math.max(0, waitUntil - System.nanoTime());
    Duration d = Duration.ofMillis(TimeUnit.NANOSECONDS.toMillis(left));
    return d.compareTo(Limits.MAX_SERVER_WAIT) > 0 ? Limits.MAX_SERVER_WAIT : d;
  }
}

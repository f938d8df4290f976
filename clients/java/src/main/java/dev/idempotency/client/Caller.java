package dev.idempotency.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.MethodDescriptor;
import io.grpc.stub.ClientCalls;
import io.grpc.stub.StreamObserver;
import java.lang.System.Logger.Level;
import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import java.util.function.Supplier;

/**
 * Sends calls, and sends them again while their retry class allows, within the retry budget. Every
 * call is asynchronous; the blocking API waits for its future.
 *
 * @param channel where calls go
 * @param callTimeout each try's deadline, beyond what the try asks the coordinator to hold it
 * @param policy the backoff and the retry budget
 * @param scheduler where the pauses between tries (and the runs' timers) are kept
 * @param log where a retried failure is told
 */
record Caller(
    Channel channel, Duration callTimeout, RetryPolicy policy, ScheduledExecutorService scheduler, System.Logger log) {

  /** After which failures a call may be sent again. */
  enum Retry {
    /** Never: a heartbeat, whose next beat is the retry. */
    NEVER,
    /**
     * Unreachable, slow, store down, rate limited or overloaded: for the calls whose repetition
     * is harmless (TryStart with its attempt_id, Complete with the same response, Release,
     * ExtendLease, Lookup).
     */
    TRANSIENT,
    /**
     * Only when refused before anything ran (rate limited, overloaded): for MarkProcessed, whose
     * repetition after a lost answer would report the events as already processed.
     */
    AT_THE_DOOR;

    boolean allows(IdempotencyException e) {
      return switch (this) {
        case NEVER -> false;
        case TRANSIENT -> e.isTransient();
        case AT_THE_DOOR -> e instanceof RateLimitedException || e instanceof OverloadedException;
      };
    }
  }

  /**
   * One try of a call: its request, and how long beyond the call timeout the coordinator may hold
   * it (a TryStart's wait).
   */
  record Attempt<Req>(Req request, Duration held) {}

  <Req, Resp> CompletableFuture<Resp> call(String op, MethodDescriptor<Req, Resp> method, Retry retry, Req request) {
    Attempt<Req> same = new Attempt<>(request, Duration.ZERO);
    return callEach(op, method, retry, () -> same);
  }

  /**
   * Sends the call; each try is made afresh by {@code attempts}, so that a TryStart never asks to
   * wait past the caller's limit. Cancelling the future cancels the call in flight and the
   * retries.
   */
  <Req, Resp> CompletableFuture<Resp> callEach(
      String op, MethodDescriptor<Req, Resp> method, Retry retry, Supplier<Attempt<Req>> attempts) {
    return callEach(op, method, retry, attempts, policy.budget());
  }

  /**
   * {@link #callEach(String, MethodDescriptor, Retry, Supplier)}, sending no try later than
   * {@code retryWithin} from now (nor past the retry budget); the first try is always sent.
   */
  <Req, Resp> CompletableFuture<Resp> callEach(
      String op, MethodDescriptor<Req, Resp> method, Retry retry, Supplier<Attempt<Req>> attempts, Duration retryWithin) {
    CompletableFuture<Resp> result = new CompletableFuture<>();
    AtomicReference<ClientCall<Req, Resp>> inFlight = new AtomicReference<>();
    result.whenComplete((value, failure) -> {
      ClientCall<Req, Resp> call = inFlight.get();
      if (result.isCancelled() && call != null) {
        call.cancel("cancelled by the caller", null);
      }
    });
    long giveUpAt = System.nanoTime() + Math.min(policy.budget().toNanos(), Math.max(0, retryWithin.toNanos()));
    new Tries<>(op, method, retry, attempts, result, inFlight, giveUpAt).send();
    return result;
  }

  /** The tries of one call. */
  private final class Tries<Req, Resp> {
    private final String op;
    private final MethodDescriptor<Req, Resp> method;
    private final Retry retry;
    private final Supplier<Attempt<Req>> attempts;
    private final CompletableFuture<Resp> result;
    private final AtomicReference<ClientCall<Req, Resp>> inFlight;
    private final long giveUpAt;
    private long stepNanos = policy.initialBackoff().toNanos();

    Tries(
        String op,
        MethodDescriptor<Req, Resp> method,
        Retry retry,
        Supplier<Attempt<Req>> attempts,
        CompletableFuture<Resp> result,
        AtomicReference<ClientCall<Req, Resp>> inFlight,
        long giveUpAt) {
      this.op = op;
      this.method = method;
      this.retry = retry;
      this.attempts = attempts;
      this.result = result;
      this.inFlight = inFlight;
      this.giveUpAt = giveUpAt;
    }

    void send() {
      if (result.isDone()) {
        return; // cancelled meanwhile
      }
      Attempt<Req> attempt;
      try {
        attempt = attempts.get();
      } catch (RuntimeException e) {
        result.completeExceptionally(e);
        return;
      }
      long deadline = callTimeout.plus(attempt.held()).toNanos();
      ClientCall<Req, Resp> call =
          channel.newCall(method, CallOptions.DEFAULT.withDeadlineAfter(deadline, TimeUnit.NANOSECONDS));
      inFlight.set(call);
      if (result.isCancelled()) {
        call.cancel("cancelled by the caller", null);
        return;
      }
      ClientCalls.asyncUnaryCall(call, attempt.request(), new StreamObserver<>() {
        private Resp answer;

        @Override
        public void onNext(Resp value) {
          answer = value;
        }

        @Override
        public void onError(Throwable t) {
          failed(t);
        }

        @Override
        public void onCompleted() {
          result.complete(answer);
        }
      });
    }

    private void failed(Throwable t) {
      if (result.isDone()) {
        return;
      }
      IdempotencyException e = Errors.fromCall(op, t);
      long pause = Math.max(nextPause(), e.retryDelay().map(Duration::toNanos).orElse(0L));
      if (!retry.allows(e) || System.nanoTime() + pause - giveUpAt > 0) {
        result.completeExceptionally(e);
        return;
      }
      log.log(Level.DEBUG, () -> "idempotency: " + op + " failed (" + e.code() + " "
          + e.reason().orElse("") + "); retrying in " + Duration.ofNanos(pause));
      try {
        scheduler.schedule(this::send, pause, TimeUnit.NANOSECONDS);
      } catch (RuntimeException closed) {
        // The client was closed meanwhile: no more tries.
        result.completeExceptionally(e);
      }
    }

    /** The next pause: between the jitter fraction of the step and all of it. */
    private long nextPause() {
      double low = stepNanos * policy.jitterLowFraction();
      long pause = (long) (low + ThreadLocalRandom.current().nextDouble() * (stepNanos - low));
      stepNanos = Math.min(policy.maxBackoff().toNanos(), (long) (stepNanos * policy.multiplier()));
      return pause;
    }
  }
}

package dev.idempotency.client;

import dev.idempotency.client.IdempotencyException.Details;
import dev.idempotency.v1.CompleteRequest;
import dev.idempotency.v1.ExtendLeaseRequest;
import dev.idempotency.v1.IdempotencyServiceGrpc;
import dev.idempotency.v1.LookupRequest;
import dev.idempotency.v1.MarkProcessedRequest;
import dev.idempotency.v1.ProcessedEvent;
import dev.idempotency.v1.ReleaseRequest;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ChannelCredentials;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ForwardingClientCall;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.TlsChannelCredentials;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.lang.System.Logger.Level;
import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HexFormat;
import java.util.List;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicReference;

/**
 * A client of the idempotency coordinator. {@link #runOnce runOnce} makes the protocol one call
 * (claim with one attempt id, wait for a holder on the coordinator, replay a stored result,
 * heartbeat, Complete or Release); {@link #processOnce processOnce} and {@link #markProcessed
 * markProcessed} deduplicate consumed events; the plain methods give every RPC of the contract
 * with Java types, blocking and as {@link CompletableFuture}s.
 *
 * <p>Safe for concurrent use; make one per coordinator and {@link #close()} it when done. Every
 * failure is an unchecked {@link IdempotencyException}; bad input is an {@link
 * IllegalArgumentException}, thrown before anything is sent.
 */
public final class IdempotencyClient implements AutoCloseable {
  private static final System.Logger DEFAULT_LOG = System.getLogger("dev.idempotency.client");
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);
  private static final AtomicInteger CLIENTS = new AtomicInteger();
  private static final SecureRandom RANDOM = new SecureRandom();
  /** What is left of a waiting caller's limit that is too little to ask the coordinator again. */
  private static final Duration WAIT_SLACK = Duration.ofMillis(20);
  /** The largest answer accepted: the coordinator's largest response limit and its margin. */
  private static final int MAX_INBOUND_BYTES = 64 * 1024 * 1024 + 64 * 1024;

  private final ManagedChannel owned;
  private final ScheduledThreadPoolExecutor scheduler;
  private final Caller caller;
  private final Duration defaultLease;
  private final Duration defaultWait;
  private final System.Logger log;

  private IdempotencyClient(Builder b, Channel channel, ManagedChannel owned) {
    this.owned = owned;
    this.defaultLease = b.defaultLease;
    this.defaultWait = b.defaultWait;
    this.log = b.logger;
    int id = CLIENTS.incrementAndGet();
    AtomicInteger threads = new AtomicInteger();
    // One small thread for timers (retry pauses, heartbeats, lease watchdogs): none of its tasks
    // blocks, and a daemon never keeps the JVM alive.
    this.scheduler = new ScheduledThreadPoolExecutor(1, task -> {
      Thread t = new Thread(task, "idempotency-client-" + id + "-timer-" + threads.incrementAndGet());
      t.setDaemon(true);
      return t;
    });
    this.scheduler.setRemoveOnCancelPolicy(true); // cancelled heartbeats do not pile up
    Channel calls = b.token == null ? channel : ClientInterceptors.intercept(channel, bearer(b.token));
    this.caller = new Caller(calls, b.callTimeout, b.retryPolicy, scheduler, log);
  }

  /**
   * A builder of a client that makes (and closes) its own connection.
   *
   * @param target a gRPC target: {@code 127.0.0.1:50051}, {@code dns:///coordinator:50051}
   * @return the builder
   */
  public static Builder builder(String target) {
    return new Builder(Validation.notNull("target", target), null);
  }

  /**
   * A builder of a client over a channel the caller owns (and closes), with its own credentials
   * and interceptors. TLS options belong to that channel and are refused here.
   *
   * @param channel the channel
   * @return the builder
   */
  public static Builder builder(Channel channel) {
    return new Builder(null, Validation.notNull("channel", channel));
  }

  /** Builds an {@link IdempotencyClient}; every value is checked here, bad ones are refused. */
  public static final class Builder {
    private final String target;
    private final Channel channel;
    private String token;
    private Duration callTimeout = Defaults.CALL_TIMEOUT;
    private RetryPolicy retryPolicy = Defaults.RETRY_POLICY;
    private Duration defaultLease = Defaults.LEASE_TTL;
    private Duration defaultWait = Defaults.WAIT;
    private boolean tls;
    private byte[] trustedCertificates;
    private byte[] clientCertificateChain;
    private byte[] clientPrivateKey;
    private System.Logger logger = DEFAULT_LOG;

    private Builder(String target, Channel channel) {
      this.target = target;
      this.channel = channel;
    }

    /**
     * Sends {@code authorization: Bearer <token>} with every call (as call metadata, so that it
     * works on plaintext loopback too).
     *
     * @param value printable ASCII, not empty
     * @return this builder
     */
    public Builder token(String value) {
      Validation.notNull("token", value);
      if (value.isEmpty() || !value.chars().allMatch(c -> c >= 0x20 && c <= 0x7e)) {
        throw Validation.invalid("token", "must be non-empty printable ASCII");
      }
      this.token = value;
      return this;
    }

    /**
     * Bounds each call (default 10 s); a TryStart that asks the coordinator to wait gets the wait
     * on top.
     *
     * @param value positive
     * @return this builder
     */
    public Builder callTimeout(Duration value) {
      Validation.notNull("callTimeout", value);
      if (value.isZero() || value.isNegative()) {
        throw Validation.invalid("callTimeout", "must be positive (got " + value + ")");
      }
      this.callTimeout = value;
      return this;
    }

    /**
     * Bounds all the tries of one call, pauses included (default 30 s; zero: no retries).
     *
     * @param value zero or more
     * @return this builder
     */
    public Builder retryBudget(Duration value) {
      Validation.notNull("retryBudget", value);
      Validation.notNegative("retryBudget", value);
      this.retryPolicy = retryPolicy.withBudget(value);
      return this;
    }

    /**
     * Replaces the whole retry policy (default {@link Defaults#RETRY_POLICY}).
     *
     * @param value the policy
     * @return this builder
     */
    public Builder retryPolicy(RetryPolicy value) {
      this.retryPolicy = Validation.notNull("retryPolicy", value);
      return this;
    }

    /**
     * The lease {@code runOnce} asks for when its options give none (default 30 s).
     *
     * @param value 100 ms – 24 h
     * @return this builder
     */
    public Builder defaultLease(Duration value) {
      Validation.lease("defaultLease", value, false);
      this.defaultLease = value;
      return this;
    }

    /**
     * How long {@code runOnce} waits for another holder when its options say nothing (default 0:
     * {@link InProgressException} at once).
     *
     * @param value zero or more
     * @return this builder
     */
    public Builder defaultWait(Duration value) {
      Validation.notNull("defaultWait", value);
      Validation.notNegative("defaultWait", value);
      this.defaultWait = value;
      return this;
    }

    /**
     * Turns TLS on, trusting the system's roots (unless {@link #trustedCertificates} says
     * otherwise).
     *
     * @return this builder
     */
    public Builder useTransportSecurity() {
      this.tls = true;
      return this;
    }

    /**
     * Turns TLS on and trusts these certificates instead of the system's roots.
     *
     * @param pem one or more PEM certificates
     * @return this builder
     */
    public Builder trustedCertificates(byte[] pem) {
      this.trustedCertificates = Validation.notNull("trustedCertificates", pem).clone();
      this.tls = true;
      return this;
    }

    /**
     * Turns mutual TLS on: the client presents this certificate chain and key.
     *
     * @param certificateChainPem the chain, PEM
     * @param privateKeyPem its private key, PEM (PKCS#8: {@code BEGIN PRIVATE KEY})
     * @return this builder
     */
    public Builder clientCertificate(byte[] certificateChainPem, byte[] privateKeyPem) {
      this.clientCertificateChain = Validation.notNull("certificateChainPem", certificateChainPem).clone();
      this.clientPrivateKey = Validation.notNull("privateKeyPem", privateKeyPem).clone();
      this.tls = true;
      return this;
    }

    /**
     * Receives the client's own events: retries, failed heartbeats, lost leases, claims it could
     * not release (default: {@code System.getLogger("dev.idempotency.client")}). Keys, payloads
     * and tokens are never logged.
     *
     * @param value the logger
     * @return this builder
     */
    public Builder logger(System.Logger value) {
      this.logger = Validation.notNull("logger", value);
      return this;
    }

    /**
     * The client. A target is not connected to here: the first call connects, and a coordinator
     * that cannot be reached is that call's {@link UnavailableException}, retried like any other.
     *
     * @return the client
     * @throws IllegalArgumentException for TLS options with a channel, or certificates that do
     *     not parse
     */
    public IdempotencyClient build() {
      if (channel != null) {
        if (tls) {
          throw Validation.invalid("tls", "TLS options apply to a target only; set them on the channel");
        }
        return new IdempotencyClient(this, channel, null);
      }
      ChannelCredentials credentials = InsecureChannelCredentials.create();
      if (tls) {
        TlsChannelCredentials.Builder creds = TlsChannelCredentials.newBuilder();
        try {
          if (trustedCertificates != null) {
            creds.trustManager(new ByteArrayInputStream(trustedCertificates));
          }
          if (clientCertificateChain != null) {
            creds.keyManager(new ByteArrayInputStream(clientCertificateChain), new ByteArrayInputStream(clientPrivateKey));
          }
        } catch (IOException | IllegalArgumentException e) {
          throw Validation.invalid("tls", "the certificates or key cannot be read: " + e.getMessage());
        }
        credentials = creds.build();
      }
      ManagedChannel made =
          Grpc.newChannelBuilder(target, credentials).maxInboundMessageSize(MAX_INBOUND_BYTES).build();
      return new IdempotencyClient(this, made, made);
    }
  }

  // ---------------------------------------------------------------------------------------
  // runOnce

  /**
   * Runs {@code work} at most once for {@code key} in {@code namespace}, or returns the result of
   * the run that did, with the client's defaults. See {@link #runOnce(String, String, Object,
   * ResultCodec, RunOptions, Work)}.
   *
   * @param <T> the result's type
   * @param <E> what the work may throw
   * @param namespace the scope of the key
   * @param key the key
   * @param request what is fingerprinted: null, a {@code byte[]}, or a value (canonical JSON)
   * @param resultType the result's class, stored as JSON
   * @param work the work
   * @return the result, and whether it was replayed
   * @throws E the work's own failure (the key was released)
   */
  public <T, E extends Exception> Outcome<T> runOnce(
      String namespace, String key, Object request, Class<T> resultType, Work<T, E> work) throws E {
    return runOnce(namespace, key, request, ResultCodec.json(Validation.notNull("resultType", resultType)),
        RunOptions.defaults(), work);
  }

  /**
   * Runs {@code work} at most once for {@code key} in {@code namespace}, or returns the result of
   * the run that did ({@link Outcome#replayed()}).
   *
   * <ol>
   *   <li>Fingerprints the request ({@link Fingerprints#of}), unless the options give one, so
   *       that the key cannot be reused for another request ({@link FingerprintMismatchException}).
   *   <li>Claims the key with TryStart and one random attempt id for the whole call, so that a
   *       TryStart whose answer was lost is retried and gets its own claim back.
   *   <li>Replays a completed key without running the work; waits for another holder with
   *       TryStart's server-side wait (up to 60 s per TryStart, asked again for longer waits),
   *       then throws {@link InProgressException}.
   *   <li>Runs the work on this thread while a heartbeat extends the lease every third of it.
   *       When the lease is lost, or may have run out while the coordinator was unreachable, the
   *       thread is interrupted and {@link Lease#isLost()} turns true; the interrupt is cleared
   *       again before this method returns or throws.
   *   <li>Stores the result with Complete (retried within the budget; a Complete that finds this
   *       very result stored counts as success). If it cannot, throws {@link
   *       ResultNotStoredException} with the result: the claim stays until its lease runs out.
   *   <li>On an exception (or error) of the work, releases the key, so that a retry starts fresh,
   *       and rethrows it as it is. A lost lease is {@link LeaseLostException} (the work's
   *       exception suppressed in it), never the key's result, and nothing is released.
   * </ol>
   *
   * @param <T> the result's type
   * @param <E> what the work may throw
   * @param namespace the scope of the key: 1–64 characters of {@code A-Z a-z 0-9 . _ - :}
   * @param key 1–255 bytes of UTF-8 without control characters
   * @param request what is fingerprinted: null, a {@code byte[]}, or a value (canonical JSON)
   * @param codec how the result is stored
   * @param options lease, retention, wait, heartbeat, fingerprint
   * @param work the work
   * @return the result, and whether it was replayed
   * @throws E the work's own failure (the key was released)
   * @throws IllegalArgumentException for bad input, before anything is sent
   */
  public <T, E extends Exception> Outcome<T> runOnce(
      String namespace, String key, Object request, ResultCodec<T> codec, RunOptions options, Work<T, E> work)
      throws E {
    return run(spec("namespace", namespace, key, request, options), codec, work);
  }

  /**
   * Runs the work at most once per event: {@code runOnce} with the consumer as namespace and the
   * event id as key, claimed before the effect and completed after it. For effects that must
   * happen once (a charge, an e-mail); {@link #markProcessed} only records that events were seen.
   *
   * @param <T> the result's type
   * @param <E> what the work may throw
   * @param consumer the consumer: 1–64 characters of {@code A-Z a-z 0-9 . _ - :}
   * @param eventId the event's id
   * @param event what is fingerprinted: null, a {@code byte[]}, or a value (canonical JSON)
   * @param codec how the result is stored
   * @param options lease, retention, wait, heartbeat, fingerprint
   * @param work the work
   * @return the result, and whether it was replayed
   * @throws E the work's own failure (the event was released)
   */
  public <T, E extends Exception> Outcome<T> processOnce(
      String consumer, String eventId, Object event, ResultCodec<T> codec, RunOptions options, Work<T, E> work)
      throws E {
    return run(spec("consumer", consumer, eventId, event, options), codec, work);
  }

  /**
   * {@code runOnce} for work that returns a future: the work's future is cancelled when the lease
   * is lost. The future returned fails with what the blocking {@code runOnce} would throw.
   * Cancelling it cancels the claim in progress, or the work.
   *
   * @param <T> the result's type
   * @param namespace the scope of the key
   * @param key the key
   * @param request what is fingerprinted: null, a {@code byte[]}, or a value (canonical JSON)
   * @param codec how the result is stored
   * @param options lease, retention, wait, heartbeat, fingerprint
   * @param work starts the work
   * @return the result, and whether it was replayed
   * @throws IllegalArgumentException for bad input, before anything is sent
   */
  public <T> CompletableFuture<Outcome<T>> runOnceAsync(
      String namespace, String key, Object request, ResultCodec<T> codec, RunOptions options, AsyncWork<T> work) {
    return runAsync(spec("namespace", namespace, key, request, options), codec, work);
  }

  /**
   * {@link #processOnce} for work that returns a future.
   *
   * @param <T> the result's type
   * @param consumer the consumer
   * @param eventId the event's id
   * @param event what is fingerprinted
   * @param codec how the result is stored
   * @param options lease, retention, wait, heartbeat, fingerprint
   * @param work starts the work
   * @return the result, and whether it was replayed
   */
  public <T> CompletableFuture<Outcome<T>> processOnceAsync(
      String consumer, String eventId, Object event, ResultCodec<T> codec, RunOptions options, AsyncWork<T> work) {
    return runAsync(spec("consumer", consumer, eventId, event, options), codec, work);
  }

  /** One run's settings, checked. */
  private record Spec(
      String namespace, String key, byte[] fingerprint, Duration lease, Duration retention, Duration maxWait,
      Duration heartbeat) {}

  private Spec spec(String scopeField, String namespace, String key, Object request, RunOptions options) {
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

  private <T, E extends Exception> Outcome<T> run(Spec spec, ResultCodec<T> codec, Work<T, E> work) throws E {
    Validation.notNull("codec", codec);
    Validation.notNull("work", work);
    Claimed claimed = await("TryStart", claim(spec));
    if (claimed.claim() instanceof Claim.Completed completed) {
      return replay(completed, codec);
    }
    Lease lease = new Lease(this, spec.namespace(), spec.key(), (Claim.Started) claimed.claim(), spec.lease(),
        claimed.askedAt());
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
    return awaitUninterruptibly("RunOnce", settle(lease, value, failure, codec));
  }

  private <T> CompletableFuture<Outcome<T>> runAsync(Spec spec, ResultCodec<T> codec, AsyncWork<T> work) {
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
    CompletableFuture<Claimed> claiming = claim(spec);
    stage.set(claiming);
    claiming.whenComplete((claimed, claimFailure) -> {
      if (claimFailure != null) {
        result.completeExceptionally(Errors.asApiFailure("TryStart", claimFailure));
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
          claimed.askedAt());
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
    return releaseAsync(lease.namespace(), lease.key(), lease.token()).handle((ok, t) -> {
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
      log.log(Level.WARNING, () -> "idempotency: could not release a claim in namespace " + lease.namespace()
          + "; it frees when its lease runs out: " + cause.getMessage());
      return null;
    });
  }

  /**
   * Stores the result. A Complete that finds this very result stored already (an earlier try
   * whose answer was lost) counts as success.
   */
  private CompletableFuture<Completion> complete(Lease lease, byte[] response) {
    return completeAsync(lease.namespace(), lease.key(), lease.token(), response, null)
        .exceptionallyCompose(t -> {
          Throwable cause = Errors.unwrap(t);
          if (cause instanceof LeaseLostException || cause instanceof KeyNotFoundException) {
            return CompletableFuture.failedFuture(
                Errors.leaseLost("RunOnce", "the result could not be stored: the key is no longer this holder's",
                    cause));
          }
          if (cause instanceof AlreadyCompletedException) {
            return lookupAsync(lease.namespace(), lease.key()).thenCompose(state -> {
              if (state instanceof KeyState.Completed c && Arrays.equals(c.response(), response)) {
                return CompletableFuture.completedFuture(new Completion(c.completedAt(), c.expiresAt()));
              }
              return CompletableFuture.failedFuture(cause);
            });
          }
          return CompletableFuture.failedFuture(cause);
        });
  }

  /** A claim that is Started or Completed, and when the TryStart that won it was first sent. */
  private record Claimed(Claim claim, long askedAt) {}

  /**
   * Sends TryStart with one attempt id for the whole call, waiting for a holder on the coordinator:
   * each TryStart asks it to wait what is left of the caller's limit (at most 60 s). A coordinator
   * that answers in_progress clearly before the wait asked for (it is at its waiter limit) is asked
   * again after a short pause, so that a full coordinator is not hammered.
   */
  private CompletableFuture<Claimed> claim(Spec spec) {
    String attemptId = newAttemptId();
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
          return new Caller.Attempt<>(tryStartMessage(spec.namespace(), spec.key(), spec.fingerprint(), spec.lease(),
              spec.retention(), attemptId, wait), wait);
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
      Claim claim = Protos.claim(answer, attemptId);
      if (claim instanceof Claim.Started || claim instanceof Claim.Completed) {
        result.complete(new Claimed(claim, askedAt));
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
            scheduler.schedule(() -> claimStep(spec, attemptId, waitUntil, pollStep, result), pause, TimeUnit.NANOSECONDS);
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

  // ---------------------------------------------------------------------------------------
  // Plain calls

  /**
   * Claims a key, or reports who holds it, its stored response, or a mismatch. Retried within the
   * budget after transient failures, with the same attempt id.
   *
   * @param request the TryStart
   * @return the outcome
   */
  public Claim tryStart(TryStartRequest request) {
    return await("TryStart", tryStartAsync(request));
  }

  /**
   * {@link #tryStart} asynchronously.
   *
   * @param request the TryStart
   * @return the outcome
   */
  public CompletableFuture<Claim> tryStartAsync(TryStartRequest request) {
    Validation.notNull("request", request);
    Validation.key("namespace", request.namespace(), request.key());
    Validation.bytes("fingerprint", request.fingerprint(), Limits.MAX_FINGERPRINT_BYTES);
    Validation.lease("lease_ttl", request.leaseTtl(), true);
    Validation.retention("retention", request.retention(), true);
    Validation.text("attempt_id", request.attemptId(), Limits.MAX_ATTEMPT_ID_BYTES, true);
    Validation.duration("wait", request.maxWait(), Duration.ZERO, Limits.MAX_SERVER_WAIT, true);
    String attemptId = request.attemptId() == null || request.attemptId().isEmpty() ? newAttemptId() : request.attemptId();
    Duration wait = request.maxWait() == null ? Duration.ZERO : request.maxWait();
    var message = tryStartMessage(request.namespace(), request.key(), request.fingerprint(), request.leaseTtl(),
        request.retention(), attemptId, wait);
    return caller.callEach("TryStart", IdempotencyServiceGrpc.getTryStartMethod(), Caller.Retry.TRANSIENT,
            () -> new Caller.Attempt<>(message, wait))
        .thenApply(answer -> {
          Claim claim = Protos.claim(answer, attemptId);
          if (claim == null) {
            throw Errors.unexpected("TryStart", "TryStart answered an outcome this client does not know");
          }
          return claim;
        });
  }

  private static dev.idempotency.v1.TryStartRequest tryStartMessage(String namespace, String key, byte[] fingerprint,
      Duration lease, Duration retention, String attemptId, Duration wait) {
    var m = dev.idempotency.v1.TryStartRequest.newBuilder()
        .setNamespace(namespace)
        .setKey(key)
        .setFingerprint(Protos.bytes(fingerprint))
        .setAttemptId(attemptId);
    if (lease != null) {
      m.setLeaseTtl(Protos.duration(lease));
    }
    if (retention != null) {
      m.setRetention(Protos.duration(retention));
    }
    if (wait != null && !wait.isZero()) {
      m.setWait(Protos.duration(wait));
    }
    return m.build();
  }

  /**
   * Stores the response and completes the key. Repeating it with the same response succeeds
   * again, so it is retried within the budget after transient failures.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   * @param response the response (at most the coordinator's limit, 1 MiB by default)
   * @param retention counted from the completion (1 s – 30 d), or null for the one the key was
   *     claimed with
   * @return when it was completed and until when it is kept
   */
  public Completion complete(String namespace, String key, long token, byte[] response, Duration retention) {
    return await("Complete", completeAsync(namespace, key, token, response, retention));
  }

  /**
   * {@link #complete} asynchronously.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   * @param response the response
   * @param retention counted from the completion, or null
   * @return when it was completed and until when it is kept
   */
  public CompletableFuture<Completion> completeAsync(
      String namespace, String key, long token, byte[] response, Duration retention) {
    Validation.key("namespace", namespace, key);
    Validation.token(token);
    Validation.notNull("response", response);
    Validation.retention("retention", retention, true);
    var m = CompleteRequest.newBuilder().setNamespace(namespace).setKey(key).setLeaseToken(token)
        .setResponse(Protos.bytes(response));
    if (retention != null) {
      m.setRetention(Protos.duration(retention));
    }
    return caller.call("Complete", IdempotencyServiceGrpc.getCompleteMethod(), Caller.Retry.TRANSIENT, m.build())
        .thenApply(a -> new Completion(Protos.instant(a.getCompletedAt(), a.hasCompletedAt()),
            Protos.instant(a.getExpiresAt(), a.hasExpiresAt())));
  }

  /**
   * Gives a claim up: the key is absent afterwards, so a retry starts fresh.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   */
  public void release(String namespace, String key, long token) {
    await("Release", releaseAsync(namespace, key, token));
  }

  /**
   * {@link #release} asynchronously.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   * @return completes when released
   */
  public CompletableFuture<Void> releaseAsync(String namespace, String key, long token) {
    Validation.key("namespace", namespace, key);
    Validation.token(token);
    var m = ReleaseRequest.newBuilder().setNamespace(namespace).setKey(key).setLeaseToken(token).build();
    return caller.call("Release", IdempotencyServiceGrpc.getReleaseMethod(), Caller.Retry.TRANSIENT, m)
        .thenApply(a -> null);
  }

  /**
   * Moves the lease's expiry to now + {@code leaseTtl}, and saves a checkpoint when one is given.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   * @param leaseTtl 100 ms – 24 h, or null for the coordinator's default (30 s)
   * @param checkpoint null keeps the stored one; an array (even empty) replaces it; at most 64 KiB
   * @return the new expiry
   */
  public Instant extendLease(String namespace, String key, long token, Duration leaseTtl, byte[] checkpoint) {
    return await("ExtendLease", extendLeaseAsync(namespace, key, token, leaseTtl, checkpoint));
  }

  /**
   * {@link #extendLease} asynchronously.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   * @param leaseTtl 100 ms – 24 h, or null
   * @param checkpoint null keeps the stored one; an array replaces it
   * @return the new expiry
   */
  public CompletableFuture<Instant> extendLeaseAsync(
      String namespace, String key, long token, Duration leaseTtl, byte[] checkpoint) {
    return extendLeaseAsync(namespace, key, token, leaseTtl, checkpoint, Caller.Retry.TRANSIENT);
  }

  CompletableFuture<Instant> extendLeaseAsync(
      String namespace, String key, long token, Duration leaseTtl, byte[] checkpoint, Caller.Retry retry) {
    Validation.key("namespace", namespace, key);
    Validation.token(token);
    Validation.lease("lease_ttl", leaseTtl, true);
    Validation.bytes("checkpoint", checkpoint, Limits.MAX_CHECKPOINT_BYTES);
    var m = ExtendLeaseRequest.newBuilder().setNamespace(namespace).setKey(key).setLeaseToken(token);
    if (leaseTtl != null) {
      m.setLeaseTtl(Protos.duration(leaseTtl));
    }
    if (checkpoint != null) {
      m.setCheckpoint(Protos.bytes(checkpoint)); // present, even empty: replaces the stored one
    }
    return caller.call("ExtendLease", IdempotencyServiceGrpc.getExtendLeaseMethod(), retry, m.build())
        .thenApply(a -> Protos.instant(a.getLeaseExpiresAt(), a.hasLeaseExpiresAt()));
  }

  /**
   * Reads a key's state without changing it.
   *
   * @param namespace the scope
   * @param key the key
   * @return the state
   */
  public KeyState lookup(String namespace, String key) {
    return await("Lookup", lookupAsync(namespace, key));
  }

  /**
   * {@link #lookup} asynchronously.
   *
   * @param namespace the scope
   * @param key the key
   * @return the state
   */
  public CompletableFuture<KeyState> lookupAsync(String namespace, String key) {
    Validation.key("namespace", namespace, key);
    var m = LookupRequest.newBuilder().setNamespace(namespace).setKey(key).build();
    return caller.call("Lookup", IdempotencyServiceGrpc.getLookupMethod(), Caller.Retry.TRANSIENT, m)
        .thenApply(Protos::keyState);
  }

  /**
   * Records, atomically for the batch, that {@code consumer} handled the events, and answers the
   * ids that were new, in request order (an id twice in one call is new the first time). Retried
   * only when refused at the door (rate limited, overloaded): a retry after a lost answer would
   * report the events as already processed. It records <em>that</em> an event was handled; for an
   * effect that must happen exactly once, use {@link #processOnce}.
   *
   * @param consumer 1–64 characters of {@code A-Z a-z 0-9 . _ - :}
   * @param eventIds 1–1000 ids, each 1–255 bytes of UTF-8 without control characters
   * @return the ids that were new
   */
  public List<String> markProcessed(String consumer, List<String> eventIds) {
    return markProcessed(consumer, eventIds, null);
  }

  /**
   * {@link #markProcessed(String, List)} with a retention.
   *
   * @param consumer the consumer
   * @param eventIds 1–1000 ids
   * @param retention how long the events are remembered (1 s – 30 d), or null for the
   *     coordinator's (7 d)
   * @return the ids that were new
   */
  public List<String> markProcessed(String consumer, List<String> eventIds, Duration retention) {
    return await("MarkProcessed", markProcessedAsync(consumer, eventIds, retention));
  }

  /**
   * {@link #markProcessed(String, List, Duration)} asynchronously.
   *
   * @param consumer the consumer
   * @param eventIds 1–1000 ids
   * @param retention 1 s – 30 d, or null
   * @return the ids that were new
   */
  public CompletableFuture<List<String>> markProcessedAsync(String consumer, List<String> eventIds, Duration retention) {
    Validation.scope("consumer", consumer);
    Validation.notNull("event_ids", eventIds);
    if (eventIds.isEmpty() || eventIds.size() > Limits.MAX_EVENT_IDS) {
      throw Validation.invalid("event_ids", "must hold 1-" + Limits.MAX_EVENT_IDS + " ids (got " + eventIds.size() + ")");
    }
    for (int i = 0; i < eventIds.size(); i++) {
      Validation.text("event_ids[" + i + "]", eventIds.get(i), Limits.MAX_KEY_BYTES, false);
    }
    Validation.retention("retention", retention, true);
    var m = MarkProcessedRequest.newBuilder().setConsumer(consumer).addAllEventIds(eventIds);
    if (retention != null) {
      m.setRetention(Protos.duration(retention));
    }
    return caller.call("MarkProcessed", IdempotencyServiceGrpc.getMarkProcessedMethod(), Caller.Retry.AT_THE_DOOR,
            m.build())
        .thenApply(a -> {
          List<String> fresh = new ArrayList<>();
          for (ProcessedEvent e : a.getResultsList()) {
            if (!e.getAlreadyProcessed()) {
              fresh.add(e.getEventId());
            }
          }
          return List.copyOf(fresh);
        });
  }

  // ---------------------------------------------------------------------------------------

  /**
   * Closes the connection the client made (a channel given to the builder is the caller's) and
   * stops its timers. Runs still holding keys lose their heartbeats.
   */
  @Override
  public void close() {
    scheduler.shutdownNow();
    if (owned != null) {
      owned.shutdown();
      boolean interrupted = false;
      try {
        if (!owned.awaitTermination(5, TimeUnit.SECONDS)) {
          owned.shutdownNow();
        }
      } catch (InterruptedException e) {
        interrupted = true;
        owned.shutdownNow();
      }
      if (interrupted) {
        Thread.currentThread().interrupt();
      }
    }
  }

  ScheduledExecutorService scheduler() {
    return scheduler;
  }

  System.Logger log() {
    return log;
  }

  /** 128 random bits in hex: one per logical attempt. */
  private static String newAttemptId() {
    byte[] b = new byte[16];
    RANDOM.nextBytes(b);
    return HexFormat.of().formatHex(b);
  }

  private static ClientInterceptor bearer(String token) {
    String value = "Bearer " + token;
    return new ClientInterceptor() {
      @Override
      public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
        return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(method, options)) {
          @Override
          public void start(Listener<R> listener, Metadata headers) {
            headers.put(AUTHORIZATION, value);
            super.start(listener, headers);
          }
        };
      }
    };
  }

  /**
   * Waits for a call; an interrupt cancels it, sets the flag again and throws {@link
   * CancelledException}.
   */
  static <T> T await(String op, CompletableFuture<T> future) {
    try {
      return future.get();
    } catch (InterruptedException e) {
      future.cancel(true);
      Thread.currentThread().interrupt();
      throw Errors.cancelled(op, "the caller's thread was interrupted", e);
    } catch (ExecutionException | CancellationException e) {
      throw rethrow(Errors.asApiFailure(op, e));
    }
  }

  /** Waits for a call that must not be abandoned half-way; an interrupt is kept for after. */
  static <T> T awaitUninterruptibly(String op, CompletableFuture<T> future) {
    boolean interrupted = false;
    try {
      while (true) {
        try {
          return future.get();
        } catch (InterruptedException e) {
          interrupted = true;
        } catch (ExecutionException | CancellationException e) {
          throw rethrow(Errors.asApiFailure(op, e));
        }
      }
    } finally {
      if (interrupted) {
        Thread.currentThread().interrupt();
      }
    }
  }

  /**
   * Throws {@code t} as it is. Checked exceptions reach here only from the work, whose signature
   * declares them ({@code Work<T, E>}), so rethrowing them unchecked keeps the caller's contract.
   */
  private static RuntimeException rethrow(Throwable t) {
    if (t instanceof RuntimeException r) {
      throw r;
    }
    if (t instanceof Error e) {
      throw e;
    }
    throw IdempotencyClient.<RuntimeException>sneaky(t);
  }

  @SuppressWarnings("unchecked")
  private static <X extends Throwable> X sneaky(Throwable t) throws X {
    throw (X) t;
  }

  @Override
  public String toString() {
    return "IdempotencyClient[" + (owned != null ? owned.authority() : "channel") + "]";
  }

}

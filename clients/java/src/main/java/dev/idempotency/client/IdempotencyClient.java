package dev.idempotency.client;

import io.grpc.Channel;
import io.grpc.ManagedChannel;
import java.time.Duration;
import java.time.Instant;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

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
  private static final AtomicInteger CLIENTS = new AtomicInteger();

  private final ManagedChannel owned;
  private final ScheduledThreadPoolExecutor scheduler;
  private final Rpcs rpcs;
  private final Runs runs;

  private IdempotencyClient(Builder b, Channel channel, ManagedChannel owned) {
    this.owned = owned;
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
    Caller caller = new Caller(Channels.withToken(channel, b.token), b.callTimeout, b.retryPolicy, scheduler, b.logger);
    this.rpcs = new Rpcs(caller);
    this.runs = new Runs(rpcs, caller, b.defaultLease, b.defaultWait);
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
     * works on plaintext loopback too). Null sends none, as without this call: {@code
     * token(System.getenv("COORDINATOR_TOKEN"))} works both against a coordinator with {@code
     * --tokens-file} and, with the variable unset, against one without.
     *
     * @param value printable ASCII, not empty; or null for no token
     * @return this builder
     */
    public Builder token(String value) {
      if (value == null) {
        this.token = null;
        return this;
      }
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
      ManagedChannel made = Channels.open(target,
          new Channels.Security(tls, trustedCertificates, clientCertificateChain, clientPrivateKey));
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
   *   <li>Counts the lease from the sending of the TryStart that won it. When that TryStart took
   *       longer than a tenth of the lease (it waited for a holder), renews the lease with
   *       ExtendLease before the work starts, so that the work has its whole lease, counted from the
   *       renewal's sending. A renewal refused because the key is no longer this holder's is {@link
   *       LeaseLostException}; one that cannot get through within the lease or the retry budget
   *       throws its error after releasing the key; the work does not run in either case.
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
    return runs.run(runs.spec("namespace", namespace, key, request, options), codec, work);
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
    return runs.run(runs.spec("consumer", consumer, eventId, event, options), codec, work);
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
    return runs.runAsync(runs.spec("namespace", namespace, key, request, options), codec, work);
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
    return runs.runAsync(runs.spec("consumer", consumer, eventId, event, options), codec, work);
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
    return Futures.await("TryStart", tryStartAsync(request));
  }

  /**
   * {@link #tryStart} asynchronously.
   *
   * @param request the TryStart
   * @return the outcome
   */
  public CompletableFuture<Claim> tryStartAsync(TryStartRequest request) {
    return rpcs.tryStart(request);
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
    return Futures.await("Complete", completeAsync(namespace, key, token, response, retention));
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
    return rpcs.complete(namespace, key, token, response, retention);
  }

  /**
   * Gives a claim up: the key is absent afterwards, so a retry starts fresh.
   *
   * @param namespace the scope
   * @param key the key
   * @param token the holder's fencing token
   */
  public void release(String namespace, String key, long token) {
    Futures.await("Release", releaseAsync(namespace, key, token));
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
    return rpcs.release(namespace, key, token);
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
    return Futures.await("ExtendLease", extendLeaseAsync(namespace, key, token, leaseTtl, checkpoint));
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
    return rpcs.extendLease(namespace, key, token, leaseTtl, checkpoint, Caller.Retry.TRANSIENT);
  }

  /**
   * Reads a key's state without changing it.
   *
   * @param namespace the scope
   * @param key the key
   * @return the state
   */
  public KeyState lookup(String namespace, String key) {
    return Futures.await("Lookup", lookupAsync(namespace, key));
  }

  /**
   * {@link #lookup} asynchronously.
   *
   * @param namespace the scope
   * @param key the key
   * @return the state
   */
  public CompletableFuture<KeyState> lookupAsync(String namespace, String key) {
    return rpcs.lookup(namespace, key);
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
    return Futures.await("MarkProcessed", markProcessedAsync(consumer, eventIds, retention));
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
    return rpcs.markProcessed(consumer, eventIds, retention);
  }

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

  @Override
  public String toString() {
    return "IdempotencyClient[" + (owned != null ? owned.authority() : "channel") + "]";
  }
}

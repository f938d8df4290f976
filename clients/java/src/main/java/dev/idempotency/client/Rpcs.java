package dev.idempotency.client;

import dev.idempotency.v1.CompleteRequest;
import dev.idempotency.v1.ExtendLeaseRequest;
import dev.idempotency.v1.ExtendLeaseResponse;
import dev.idempotency.v1.IdempotencyServiceGrpc;
import dev.idempotency.v1.LookupRequest;
import dev.idempotency.v1.MarkProcessedRequest;
import dev.idempotency.v1.ProcessedEvent;
import dev.idempotency.v1.ReleaseRequest;
import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import java.util.concurrent.CompletableFuture;

/**
 * Every RPC of the contract with Java types: checks the input (bad input is an {@link
 * IllegalArgumentException}, thrown before anything is sent), builds the message, sends it with
 * its retry class, and reads the answer. The client's plain methods and {@code runOnce} both call
 * the coordinator through here.
 */
final class Rpcs {
  private static final SecureRandom RANDOM = new SecureRandom();

  private final Caller caller;

  Rpcs(Caller caller) {
    this.caller = caller;
  }

  /** 128 random bits in hex: one per logical attempt. */
  static String newAttemptId() {
    byte[] b = new byte[16];
    RANDOM.nextBytes(b);
    return HexFormat.of().formatHex(b);
  }

  CompletableFuture<Claim> tryStart(TryStartRequest request) {
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

  static dev.idempotency.v1.TryStartRequest tryStartMessage(String namespace, String key, byte[] fingerprint,
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

  CompletableFuture<Completion> complete(String namespace, String key, long token, byte[] response, Duration retention) {
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

  CompletableFuture<Void> release(String namespace, String key, long token) {
    return release(namespace, key, token, Caller.Retry.TRANSIENT);
  }

  /** Release, retried as {@code retry} says. */
  CompletableFuture<Void> release(String namespace, String key, long token, Caller.Retry retry) {
    Validation.key("namespace", namespace, key);
    Validation.token(token);
    var m = ReleaseRequest.newBuilder().setNamespace(namespace).setKey(key).setLeaseToken(token).build();
    return caller.call("Release", IdempotencyServiceGrpc.getReleaseMethod(), retry, m).thenApply(a -> null);
  }

  /** ExtendLease, retried as {@code retry} says (a heartbeat is never retried: the next beat is). */
  CompletableFuture<Instant> extendLease(
      String namespace, String key, long token, Duration leaseTtl, byte[] checkpoint, Caller.Retry retry) {
    Validation.key("namespace", namespace, key);
    Validation.token(token);
    Validation.lease("lease_ttl", leaseTtl, true);
    Validation.bytes("checkpoint", checkpoint, Limits.MAX_CHECKPOINT_BYTES);
    return caller.call("ExtendLease", IdempotencyServiceGrpc.getExtendLeaseMethod(), retry,
            extendLeaseMessage(namespace, key, token, leaseTtl, checkpoint))
        .thenApply(Rpcs::leaseExpiry);
  }

  static ExtendLeaseRequest extendLeaseMessage(
      String namespace, String key, long token, Duration leaseTtl, byte[] checkpoint) {
    var m = ExtendLeaseRequest.newBuilder().setNamespace(namespace).setKey(key).setLeaseToken(token);
    if (leaseTtl != null) {
      m.setLeaseTtl(Protos.duration(leaseTtl));
    }
    if (checkpoint != null) {
      m.setCheckpoint(Protos.bytes(checkpoint)); // present, even empty: replaces the stored one
    }
    return m.build();
  }

  /** When an ExtendLease's answer says the lease now runs out. */
  static Instant leaseExpiry(ExtendLeaseResponse answer) {
    return Protos.instant(answer.getLeaseExpiresAt(), answer.hasLeaseExpiresAt());
  }

  CompletableFuture<KeyState> lookup(String namespace, String key) {
    Validation.key("namespace", namespace, key);
    var m = LookupRequest.newBuilder().setNamespace(namespace).setKey(key).build();
    return caller.call("Lookup", IdempotencyServiceGrpc.getLookupMethod(), Caller.Retry.TRANSIENT, m)
        .thenApply(Protos::keyState);
  }

  /** MarkProcessed: retried only at the door, since a retry after a lost answer would misreport. */
  CompletableFuture<List<String>> markProcessed(String consumer, List<String> eventIds, Duration retention) {
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
}

package dev.idempotency.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.protobuf.Any;
import com.google.rpc.BadRequest;
import com.google.rpc.Code;
import com.google.rpc.ErrorInfo;
import com.google.rpc.RetryInfo;
import dev.idempotency.v1.IdempotencyServiceGrpc;
import dev.idempotency.v1.KeyAbsent;
import dev.idempotency.v1.LookupRequest;
import dev.idempotency.v1.LookupResponse;
import dev.idempotency.v1.MarkProcessedRequest;
import dev.idempotency.v1.MarkProcessedResponse;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Server;
import io.grpc.StatusRuntimeException;
import io.grpc.inprocess.InProcessChannelBuilder;
import io.grpc.inprocess.InProcessServerBuilder;
import io.grpc.protobuf.StatusProto;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.nio.channels.ClosedChannelException;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.Collections;
import java.util.Deque;
import java.util.List;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Consumer;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * The client's own decisions (retries, RetryInfo, error decoding, every bound it checks) against an
 * in-process gRPC server that answers as scripted.
 */
class ScriptedServerTest {
  /** Failures to answer, in order; once they run out, calls succeed. */
  private final Deque<StatusRuntimeException> script = new ArrayDeque<>();
  private final AtomicInteger calls = new AtomicInteger();
  private Server server;
  private ManagedChannel channel;

  @BeforeEach
  void start() throws IOException {
    String name = InProcessServerBuilder.generateName();
    server = InProcessServerBuilder.forName(name).directExecutor().addService(new IdempotencyServiceGrpc.IdempotencyServiceImplBase() {
      @Override
      public void lookup(LookupRequest request, StreamObserver<LookupResponse> answer) {
        respond(answer, LookupResponse.newBuilder().setAbsent(KeyAbsent.getDefaultInstance()).build());
      }

      @Override
      public void tryStart(dev.idempotency.v1.TryStartRequest request, StreamObserver<dev.idempotency.v1.TryStartResponse> answer) {
        respond(answer, dev.idempotency.v1.TryStartResponse.newBuilder()
            .setFingerprintMismatch(dev.idempotency.v1.FingerprintMismatch.getDefaultInstance()).build());
      }

      @Override
      public void markProcessed(MarkProcessedRequest request, StreamObserver<MarkProcessedResponse> answer) {
        respond(answer, MarkProcessedResponse.getDefaultInstance());
      }
    }).build().start();
    channel = InProcessChannelBuilder.forName(name).directExecutor().build();
  }

  private <T> void respond(StreamObserver<T> answer, T value) {
    calls.incrementAndGet();
    StatusRuntimeException failure;
    synchronized (script) {
      failure = script.poll();
    }
    if (failure != null) {
      answer.onError(failure);
    } else {
      answer.onNext(value);
      answer.onCompleted();
    }
  }

  @AfterEach
  void stop() {
    channel.shutdownNow();
    server.shutdownNow();
  }

  private IdempotencyClient client(Duration budget) {
    return IdempotencyClient.builder(channel).retryBudget(budget).build();
  }

  private static StatusRuntimeException status(Code code, String reason, Duration retryDelay, Consumer<com.google.rpc.Status.Builder> more) {
    var s = com.google.rpc.Status.newBuilder().setCode(code.getNumber()).setMessage("scripted");
    if (reason != null) {
      s.addDetails(Any.pack(ErrorInfo.newBuilder().setReason(reason).setDomain("idempotency.v1").build()));
    }
    if (retryDelay != null) {
      s.addDetails(Any.pack(RetryInfo.newBuilder().setRetryDelay(com.google.protobuf.Duration.newBuilder()
          .setSeconds(retryDelay.getSeconds()).setNanos(retryDelay.getNano())).build()));
    }
    more.accept(s);
    return StatusProto.toStatusRuntimeException(s.build());
  }

  private static StatusRuntimeException status(Code code, String reason) {
    return status(code, reason, null, s -> {});
  }

  @Test
  void transientFailuresAreRetriedAndRetryInfoLengthensThePause() {
    try (IdempotencyClient client = client(Duration.ofSeconds(10))) {
      script.add(status(Code.UNAVAILABLE, null));
      script.add(status(Code.UNAVAILABLE, "STORE_UNAVAILABLE", Duration.ofMillis(400), s -> {}));
      script.add(status(Code.RESOURCE_EXHAUSTED, "RATE_LIMITED", Duration.ofMillis(300), s -> {}));
      long start = System.nanoTime();
      assertInstanceOf(KeyState.Absent.class, client.lookup("ns", "k"));
      long elapsed = Duration.ofNanos(System.nanoTime() - start).toMillis();
      assertEquals(4, calls.get());
      assertTrue(elapsed >= 700, "the pauses were at least the RetryInfo delays: " + elapsed + " ms");
    }
  }

  @Test
  void theBudgetBoundsTheRetries() {
    try (IdempotencyClient client = client(Duration.ofMillis(300))) {
      client.lookup("ns", "warm-up"); // the first call of a JVM is slow; the budget counts it
      calls.set(0);
      for (int i = 0; i < 100; i++) {
        script.add(status(Code.UNAVAILABLE, "STORE_UNAVAILABLE", Duration.ofMillis(100), s -> {}));
      }
      StoreUnavailableException e = assertThrows(StoreUnavailableException.class, () -> client.lookup("ns", "k"));
      assertTrue(calls.get() >= 2 && calls.get() <= 4, "calls: " + calls.get());
      assertEquals(Duration.ofMillis(100), e.retryDelay().orElseThrow());
      assertTrue(e.isTransient());
      assertInstanceOf(UnavailableException.class, e);
    }
  }

  @Test
  void markProcessedIsRetriedOnlyWhenRefusedAtTheDoor() {
    try (IdempotencyClient client = client(Duration.ofSeconds(5))) {
      script.add(status(Code.RESOURCE_EXHAUSTED, "OVERLOADED", Duration.ofMillis(10), s -> {}));
      assertEquals(List.of(), client.markProcessed("c", List.of("e")));
      assertEquals(2, calls.get());
      script.add(status(Code.UNAVAILABLE, null));
      assertThrows(UnavailableException.class, () -> client.markProcessed("c", List.of("e")));
      assertEquals(3, calls.get(), "a lost answer is not retried: the events would read as processed");
    }
  }

  /**
   * grpc-java's Netty transport fails a call whose connection broke under it (the coordinator
   * killed) with UNKNOWN "channel closed" and the ClosedChannelException as its cause: that is the
   * coordinator unreachable, retried, and UnavailableException once the budget is spent. An
   * UNKNOWN the server sent (no cause) stays UnexpectedStatusException (everyReasonHasItsException).
   */
  @Test
  void aConnectionThatBrokeUnderACallIsUnavailableAndRetried() {
    AtomicInteger broken = new AtomicInteger();
    ClientInterceptor breaking = new ClientInterceptor() {
      @Override
      public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
        if (broken.getAndDecrement() <= 0) {
          return next.newCall(method, options);
        }
        return new ClientCall<>() {
          @Override
          public void start(Listener<R> listener, Metadata headers) {
            listener.onClose(io.grpc.Status.UNKNOWN.withDescription("channel closed")
                .withCause(new ClosedChannelException()), new Metadata());
          }

          @Override
          public void request(int n) {}

          @Override
          public void cancel(String message, Throwable cause) {}

          @Override
          public void halfClose() {}

          @Override
          public void sendMessage(Q message) {}
        };
      }
    };
    Channel flaky = ClientInterceptors.intercept(channel, breaking);
    try (IdempotencyClient client = IdempotencyClient.builder(flaky).retryBudget(Duration.ofSeconds(5)).build()) {
      broken.set(1);
      assertInstanceOf(KeyState.Absent.class, client.lookup("ns", "k"));
      assertEquals(1, calls.get(), "retried after the broken connection");
    }
    try (IdempotencyClient client = IdempotencyClient.builder(flaky).retryBudget(Duration.ZERO).build()) {
      broken.set(1);
      UnavailableException e = assertThrows(UnavailableException.class, () -> client.lookup("ns", "k"));
      assertEquals(io.grpc.Status.Code.UNAVAILABLE, e.code());
      assertEquals(io.grpc.Status.Code.UNKNOWN, e.status().orElseThrow().getCode(), "the status as received");
      assertInstanceOf(ClosedChannelException.class, e.getCause());
      assertTrue(e.isTransient());
    }
  }

  @Test
  void everyReasonHasItsException() {
    record Case(Code code, String reason, Class<? extends IdempotencyException> type) {}
    List<Case> cases = List.of(
        new Case(Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", InvalidArgumentException.class),
        new Case(Code.ABORTED, "LEASE_LOST", LeaseLostException.class),
        new Case(Code.NOT_FOUND, "KEY_NOT_FOUND", KeyNotFoundException.class),
        new Case(Code.FAILED_PRECONDITION, "ALREADY_COMPLETED", AlreadyCompletedException.class),
        new Case(Code.UNAUTHENTICATED, "UNAUTHENTICATED", UnauthenticatedException.class),
        new Case(Code.PERMISSION_DENIED, "PERMISSION_DENIED", PermissionDeniedException.class),
        new Case(Code.INTERNAL, "INTERNAL", InternalException.class),
        new Case(Code.ABORTED, null, LeaseLostException.class),
        new Case(Code.DEADLINE_EXCEEDED, null, DeadlineExceededException.class),
        new Case(Code.RESOURCE_EXHAUSTED, null, UnexpectedStatusException.class),
        new Case(Code.UNKNOWN, null, UnexpectedStatusException.class));
    try (IdempotencyClient client = client(Duration.ZERO)) {
      for (Case c : cases) {
        script.add(status(c.code(), c.reason(), null, s -> s.addDetails(Any.pack(BadRequest.newBuilder()
            .addFieldViolations(BadRequest.FieldViolation.newBuilder().setField("event_ids[3]").setDescription("bad"))
            .build()))));
        IdempotencyException e = assertThrows(IdempotencyException.class, () -> client.lookup("ns", "k"));
        assertInstanceOf(c.type(), e, c.toString());
        assertEquals(c.code().name(), e.code().name());
        assertEquals(c.reason(), e.reason().orElse(null));
        assertEquals("event_ids[3]", e.violations().get(0).field());
        assertTrue(e.status().isPresent());
      }
    }
  }

  @Test
  void badInputIsRefusedBeforeAnythingIsSent() {
    try (IdempotencyClient client = client(Duration.ZERO)) {
      List<Runnable> refused = List.of(
          () -> client.lookup("ns", ""),
          () -> client.lookup("ns", "x".repeat(256)),
          () -> client.lookup("ns", "é".repeat(128)), // 256 bytes of UTF-8
          () -> client.lookup("ns", "a\u0085b"),
          () -> client.lookup("ns", "a\nb"),
          () -> client.lookup("ns", "a\ud800"),
          () -> client.lookup("", "k"),
          () -> client.lookup("n".repeat(65), "k"),
          () -> client.lookup("ns/x", "k"),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").leaseTtl(Duration.ofMillis(99)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").leaseTtl(Duration.ofHours(24).plusNanos(1)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").retention(Duration.ofMillis(999)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").retention(Duration.ofDays(30).plusSeconds(1)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").maxWait(Duration.ofSeconds(61)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").maxWait(Duration.ofMillis(-1)).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").fingerprint(new byte[65]).build()),
          () -> client.tryStart(TryStartRequest.builder("ns", "k").attemptId("a".repeat(129)).build()),
          () -> client.complete("ns", "k", 0, new byte[0], null),
          () -> client.complete("ns", "k", -1, new byte[0], null),
          () -> client.release("ns", "k", 0),
          () -> client.extendLease("ns", "k", 1, null, new byte[64 * 1024 + 1]),
          () -> client.markProcessed("c", List.of()),
          () -> client.markProcessed("c", Collections.nCopies(1001, "e")),
          () -> client.markProcessed("c", List.of("ok", "")),
          () -> client.markProcessed("c", List.of("e"), Duration.ofMillis(500)),
          () -> client.runOnce("ns", "k", null, ResultCodec.utf8(),
              RunOptions.builder().lease(Duration.ofMillis(99)).build(), lease -> "x"),
          () -> client.runOnce("ns", "k", null, ResultCodec.utf8(),
              RunOptions.builder().lease(Duration.ofDays(2)).build(), lease -> "x"),
          () -> client.runOnce("ns", "k", null, ResultCodec.utf8(),
              RunOptions.builder().maxWait(Duration.ofSeconds(-1)).build(), lease -> "x"),
          () -> client.runOnce("ns", "k", null, ResultCodec.utf8(),
              RunOptions.builder().heartbeat(Duration.ZERO).build(), lease -> "x"),
          () -> client.runOnce("ns", "k", null, ResultCodec.utf8(),
              RunOptions.builder().fingerprint(new byte[65]).build(), lease -> "x"),
          () -> client.runOnce("ns", "k", List.of(1L << 53), ResultCodec.utf8(), RunOptions.defaults(), lease -> "x"));
      for (int i = 0; i < refused.size(); i++) {
        assertThrows(IllegalArgumentException.class, refused.get(i)::run, "case " + i);
      }
      assertEquals(0, calls.get(), "nothing was sent");
      // The bounds themselves are accepted.
      Claim sent = client.tryStart(TryStartRequest.builder("n".repeat(64), "x".repeat(255)).leaseTtl(Duration.ofMillis(100))
          .retention(Duration.ofSeconds(1)).maxWait(Duration.ZERO).fingerprint(new byte[64]).attemptId("a".repeat(128))
          .build());
      assertInstanceOf(Claim.FingerprintMismatch.class, sent);
      assertEquals(1, calls.get());
    }
    assertThrows(IllegalArgumentException.class,
        () -> IdempotencyClient.builder("127.0.0.1:1").defaultLease(Duration.ofMillis(99)));
    assertThrows(IllegalArgumentException.class, () -> IdempotencyClient.builder("127.0.0.1:1").token(""));
    assertThrows(IllegalArgumentException.class,
        () -> IdempotencyClient.builder(channel).useTransportSecurity().build());
  }
}

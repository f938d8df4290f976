package dev.idempotency.client;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.BadRequest;
import com.google.rpc.ErrorInfo;
import com.google.rpc.RetryInfo;
import dev.idempotency.client.IdempotencyException.Details;
import io.grpc.Status;
import io.grpc.protobuf.StatusProto;
import java.io.IOException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;
import java.util.function.Function;

/** Turns failed calls into the exception of their reason (or, without one, of their code). */
final class Errors {
  static final String INVALID_ARGUMENT = "INVALID_ARGUMENT";
  static final String LEASE_LOST = "LEASE_LOST";
  static final String KEY_NOT_FOUND = "KEY_NOT_FOUND";
  static final String ALREADY_COMPLETED = "ALREADY_COMPLETED";
  static final String STORE_UNAVAILABLE = "STORE_UNAVAILABLE";
  static final String UNAUTHENTICATED = "UNAUTHENTICATED";
  static final String PERMISSION_DENIED = "PERMISSION_DENIED";
  static final String RATE_LIMITED = "RATE_LIMITED";
  static final String OVERLOADED = "OVERLOADED";
  static final String INTERNAL = "INTERNAL";

  private Errors() {}

  /** The exception for a call that failed with {@code failure} (a gRPC status, normally). */
  static IdempotencyException fromCall(String operation, Throwable failure) {
    Status status = Status.fromThrowable(failure);
    String reason = null;
    Duration retryDelay = null;
    List<FieldViolation> violations = new ArrayList<>();
    com.google.rpc.Status rich = StatusProto.fromThrowable(failure);
    if (rich != null) {
      for (Any detail : rich.getDetailsList()) {
        try {
          if (detail.is(ErrorInfo.class)) {
            ErrorInfo info = detail.unpack(ErrorInfo.class);
            if (IdempotencyException.ERROR_DOMAIN.equals(info.getDomain())) {
              reason = info.getReason();
            }
          } else if (detail.is(BadRequest.class)) {
            for (BadRequest.FieldViolation v : detail.unpack(BadRequest.class).getFieldViolationsList()) {
              violations.add(new FieldViolation(v.getField(), v.getDescription()));
            }
          } else if (detail.is(RetryInfo.class)) {
            com.google.protobuf.Duration delay = detail.unpack(RetryInfo.class).getRetryDelay();
            if (delay.getSeconds() >= 0 && delay.getNanos() >= 0) {
              retryDelay = Duration.ofSeconds(delay.getSeconds(), delay.getNanos());
            }
          }
        } catch (InvalidProtocolBufferException malformed) {
          // A detail that does not decode is ignored: the code still says what happened.
        }
      }
    }
    Status.Code code = status.getCode();
    String message = status.getDescription() != null ? status.getDescription() : code.name();
    if (code == Status.Code.UNKNOWN && reason == null && brokenConnection(status.getCause())) {
      // grpc-java's Netty transport reports a connection that broke under a call (the coordinator
      // killed, a reset) as UNKNOWN "channel closed" (grpc/grpc-java#10120): it is the coordinator
      // unreachable, UNAVAILABLE as every other client sees it, and retried like it.
      code = Status.Code.UNAVAILABLE;
      message = "the connection was lost (" + message + ")";
    }
    Details details = new Details(operation, code, reason, message, violations, retryDelay, status, status.getCause());
    return byReason(details);
  }

  /**
   * Whether a status the client made itself (one from the coordinator has no cause) comes from an
   * I/O failure of the connection, such as a {@link java.nio.channels.ClosedChannelException}.
   */
  private static boolean brokenConnection(Throwable cause) {
    for (Throwable t = cause; t != null; t = t.getCause() == t ? null : t.getCause()) {
      if (t instanceof IOException) {
        return true;
      }
    }
    return false;
  }

  /** An exception of the contract: its reason, the code that stands for it without one, its constructor. */
  private record Kind(String reason, Status.Code code, Function<Details, IdempotencyException> make) {}

  /**
   * The exception of each reason and, for a status without a reason (made by the transport, or by
   * a proxy) or with a reason of a newer coordinator, of its code, as the other clients sort them.
   * RESOURCE_EXHAUSTED without a reason is left out on purpose: gRPC itself answers it for a
   * message over the receive limit, which no retry cures.
   */
  private static final List<Kind> KINDS = List.of(
      new Kind(INVALID_ARGUMENT, Status.Code.INVALID_ARGUMENT, InvalidArgumentException::new),
      new Kind(LEASE_LOST, Status.Code.ABORTED, LeaseLostException::new),
      new Kind(KEY_NOT_FOUND, Status.Code.NOT_FOUND, KeyNotFoundException::new),
      new Kind(ALREADY_COMPLETED, Status.Code.FAILED_PRECONDITION, AlreadyCompletedException::new),
      new Kind(STORE_UNAVAILABLE, null, StoreUnavailableException::new),
      new Kind(null, Status.Code.UNAVAILABLE, UnavailableException::new),
      new Kind(null, Status.Code.DEADLINE_EXCEEDED, DeadlineExceededException::new),
      new Kind(UNAUTHENTICATED, Status.Code.UNAUTHENTICATED, UnauthenticatedException::new),
      new Kind(PERMISSION_DENIED, Status.Code.PERMISSION_DENIED, PermissionDeniedException::new),
      new Kind(RATE_LIMITED, null, RateLimitedException::new),
      new Kind(OVERLOADED, null, OverloadedException::new),
      new Kind(INTERNAL, Status.Code.INTERNAL, InternalException::new),
      new Kind(null, Status.Code.CANCELLED, CancelledException::new));

  private static IdempotencyException byReason(Details d) {
    for (Kind kind : KINDS) {
      if (d.reason() != null && d.reason().equals(kind.reason())) {
        return kind.make().apply(d);
      }
    }
    for (Kind kind : KINDS) {
      if (d.code() == kind.code()) {
        return kind.make().apply(d);
      }
    }
    return new UnexpectedStatusException(d);
  }

  /** The caller gave up: its thread was interrupted, or it cancelled. */
  static CancelledException cancelled(String operation, String message, Throwable cause) {
    return new CancelledException(Details.local(operation, Status.Code.CANCELLED, null, message, cause));
  }

  static LeaseLostException leaseLost(String operation, String message, Throwable cause) {
    return new LeaseLostException(Details.local(operation, Status.Code.ABORTED, LEASE_LOST, message, cause));
  }

  static FingerprintMismatchException mismatch(String operation) {
    return new FingerprintMismatchException(
        Details.local(
            operation,
            Status.Code.OK,
            null,
            "the key was used for a different request (fingerprint mismatch)",
            null));
  }

  static ResultCodecException codec(String operation, String message, Throwable cause) {
    return new ResultCodecException(Details.local(operation, Status.Code.OK, null, message, cause));
  }

  static UnexpectedStatusException unexpected(String operation, String message) {
    return new UnexpectedStatusException(Details.local(operation, Status.Code.UNKNOWN, null, message, null));
  }

  /** What a future failed with, without the wrappers of CompletableFuture. */
  static Throwable unwrap(Throwable failure) {
    Throwable t = failure;
    while ((t instanceof CompletionException || t instanceof ExecutionException) && t.getCause() != null) {
      t = t.getCause();
    }
    return t;
  }

  /** A failure of a call, as the exception the API throws; a cancelled future is CancelledException. */
  static Throwable asApiFailure(String operation, Throwable failure) {
    Throwable t = unwrap(failure);
    if (t instanceof CancellationException) {
      return cancelled(operation, "the call was cancelled", t);
    }
    return t;
  }
}

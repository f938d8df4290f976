package dev.idempotency.client;

import io.grpc.Status;
import java.time.Duration;
import java.util.List;
import java.util.Optional;

/**
 * Every failure of this client: one unchecked hierarchy, one subclass per reason of the contract
 * (docs/contract.md, "Errors") and per outcome of {@code runOnce} that is not a result. Each
 * carries the gRPC status code and the contract's reason as received (or, for the client's own
 * verdicts, the ones the coordinator would have given), and the {@code RetryInfo} delay where
 * there is one.
 *
 * <p>Bad input is not an {@code IdempotencyException}: the client refuses it before anything is
 * sent with an {@link IllegalArgumentException}, and nothing changes.
 */
public abstract sealed class IdempotencyException extends RuntimeException
    permits InvalidArgumentException,
        LeaseLostException,
        KeyNotFoundException,
        AlreadyCompletedException,
        UnavailableException,
        DeadlineExceededException,
        UnauthenticatedException,
        PermissionDeniedException,
        RateLimitedException,
        OverloadedException,
        InternalException,
        UnexpectedStatusException,
        CancelledException,
        FingerprintMismatchException,
        InProgressException,
        ResultNotStoredException,
        ResultCodecException {

  private static final long serialVersionUID = 1L;

  /** The ErrorInfo domain of the coordinator's reasons. */
  public static final String ERROR_DOMAIN = "idempotency.v1";

  /** The RPC or client operation that failed. */
  private final String operation;
  /** The gRPC status code. */
  private final Status.Code code;
  /** The contract's reason, or null. */
  private final String reason;
  /** The RetryInfo delay, or null. */
  private final Duration retryDelay;
  /** The bad fields of an INVALID_ARGUMENT. */
  private final List<FieldViolation> violations;
  private final transient Status status;

  /**
   * What an exception is made of.
   *
   * @param operation the RPC or client operation that failed ("TryStart", "RunOnce", ...)
   * @param code the gRPC status code
   * @param reason the contract's reason, or null when none was sent
   * @param message the message
   * @param violations the bad fields of an INVALID_ARGUMENT, else empty
   * @param retryDelay the RetryInfo delay, or null
   * @param status the status as received, or null when the client made the verdict
   * @param cause the cause, or null
   */
  record Details(
      String operation,
      Status.Code code,
      String reason,
      String message,
      List<FieldViolation> violations,
      Duration retryDelay,
      Status status,
      Throwable cause) {
    Details {
      violations = violations == null ? List.of() : List.copyOf(violations);
    }

    /** A verdict of the client itself, shaped like one of the coordinator's. */
    static Details local(String operation, Status.Code code, String reason, String message, Throwable cause) {
      return new Details(operation, code, reason, message, List.of(), null, null, cause);
    }
  }

  IdempotencyException(Details details) {
    super(label(details), details.cause());
    this.operation = details.operation();
    this.code = details.code();
    this.reason = details.reason();
    this.retryDelay = details.retryDelay();
    this.violations = details.violations();
    this.status = details.status();
  }

  private static String label(Details d) {
    String what = d.reason() != null ? d.reason() : d.code() == Status.Code.OK ? null : d.code().name();
    return d.operation() + ": " + (what == null ? "" : what + ": ") + d.message();
  }

  /**
   * The RPC or client operation that failed.
   *
   * @return "TryStart", "Complete", "Release", "ExtendLease", "Lookup", "MarkProcessed" or "RunOnce"
   */
  public String operation() {
    return operation;
  }

  /**
   * The gRPC status code received, or the one the coordinator would have given.
   *
   * @return the code
   */
  public Status.Code code() {
    return code;
  }

  /**
   * The contract's reason (ErrorInfo in domain {@value #ERROR_DOMAIN}), when there is one.
   *
   * @return the reason, empty when none was sent (the transport failed, a deadline passed)
   */
  public Optional<String> reason() {
    return Optional.ofNullable(reason);
  }

  /**
   * How long the coordinator asked the caller to wait ({@code RetryInfo}).
   *
   * @return the delay, empty when it gave none
   */
  public Optional<Duration> retryDelay() {
    return Optional.ofNullable(retryDelay);
  }

  /**
   * The bad fields of an {@code INVALID_ARGUMENT}, in the coordinator's order.
   *
   * @return the violations, empty for other failures
   */
  public List<FieldViolation> violations() {
    return violations;
  }

  /**
   * The status as received, details included.
   *
   * @return the status, empty when the client made the verdict itself
   */
  public Optional<Status> status() {
    return Optional.ofNullable(status);
  }

  /**
   * Whether the same call may succeed later: the coordinator was unreachable, slow, its store
   * down, or it asked the caller to slow down.
   *
   * @return true for a transient failure: an {@link UnavailableException} (a {@link
   *     StoreUnavailableException} too), {@link DeadlineExceededException}, {@link
   *     RateLimitedException} or {@link OverloadedException}
   */
  public boolean isTransient() {
    return this instanceof UnavailableException
        || this instanceof DeadlineExceededException
        || this instanceof RateLimitedException
        || this instanceof OverloadedException;
  }
}

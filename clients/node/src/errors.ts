// Typed errors: one class per reason of the coordinator's contract, plus the outcomes that
// runOnce turns into errors (in progress, fingerprint mismatch). Callers branch with
// `instanceof`, never on a bare status code.
import * as grpc from '@grpc/grpc-js';

import { readStatusDetails, type FieldViolation, type StatusDetails } from './status-details';

/** The root of every error this package throws on its own account. */
export class IdempotencyError extends Error {
  override name = 'IdempotencyError';
}

/** A call to the coordinator failed with a gRPC status. */
export class CoordinatorError extends IdempotencyError {
  override name = 'CoordinatorError';
  /** The gRPC status code (`grpc.status`). */
  readonly code: grpc.status;
  /** The ErrorInfo reason (e.g. `LEASE_LOST`), when the server sent one. */
  readonly reason: string | undefined;
  /** Field violations of a BadRequest detail (empty for other errors). */
  readonly fieldViolations: readonly FieldViolation[];
  /** RetryInfo's delay in milliseconds, when the server said when to retry. */
  readonly retryDelayMs: number | undefined;

  constructor(message: string, code: grpc.status, details: StatusDetails, options?: ErrorOptions) {
    super(message, options);
    this.code = code;
    this.reason = details.reason;
    this.fieldViolations = details.fieldViolations;
    this.retryDelayMs = details.retryDelayMs;
  }
}

/** `INVALID_ARGUMENT`: a field was missing, malformed or out of bounds; nothing was written. */
export class InvalidArgumentError extends CoordinatorError {
  override name = 'InvalidArgumentError';
  /** The names of the fields at fault, e.g. `['namespace', 'lease_ttl']`. */
  get fields(): string[] {
    return this.fieldViolations.map((violation) => violation.field);
  }
}

/**
 * `ABORTED` / `LEASE_LOST`: the lease token is no longer the key's current one. Someone else
 * took the key over (after this holder's lease ran out) and owns its result now.
 */
export class LeaseLostError extends CoordinatorError {
  override name = 'LeaseLostError';
}

/** `NOT_FOUND` / `KEY_NOT_FOUND`: Complete, Release or ExtendLease on an absent or expired key. */
export class KeyNotFoundError extends CoordinatorError {
  override name = 'KeyNotFoundError';
}

/** `FAILED_PRECONDITION` / `ALREADY_COMPLETED`: the key is completed (with another response). */
export class AlreadyCompletedError extends CoordinatorError {
  override name = 'AlreadyCompletedError';
}

/**
 * `UNAVAILABLE`: the store is unreachable or timed out (reason `STORE_UNAVAILABLE`, nothing was
 * written), or the coordinator itself could not be reached (no reason). Safe to retry.
 */
export class UnavailableError extends CoordinatorError {
  override name = 'UnavailableError';
}

/** `DEADLINE_EXCEEDED`: no answer within the call's deadline; the outcome is unknown. */
export class DeadlineExceededError extends CoordinatorError {
  override name = 'DeadlineExceededError';
}

/** `UNAUTHENTICATED`: no bearer token, or one the coordinator does not know. */
export class UnauthenticatedError extends CoordinatorError {
  override name = 'UnauthenticatedError';
}

/** `PERMISSION_DENIED`: the token does not hold this namespace or consumer. */
export class PermissionDeniedError extends CoordinatorError {
  override name = 'PermissionDeniedError';
}

/** `RESOURCE_EXHAUSTED` / `RATE_LIMITED`: the token is over its rate limit; see retryDelayMs. */
export class RateLimitedError extends CoordinatorError {
  override name = 'RateLimitedError';
}

/** `INTERNAL`: an unexpected failure inside the coordinator (its log has the cause). */
export class InternalError extends CoordinatorError {
  override name = 'InternalError';
}

/**
 * runOnce: another caller holds the key and did not finish within the `waitMs` you allowed.
 * Answer HTTP 409 with `Retry-After: retryAfterSeconds`, or try again at `retryAt`.
 */
export class InProgressError extends IdempotencyError {
  override name = 'InProgressError';
  /** When the holder's lease runs out (a retry then may take the key over). */
  readonly leaseExpiresAt: Date;
  /** The holder's attempt number. */
  readonly attempt: number;

  constructor(leaseExpiresAt: Date, attempt: number) {
    super(`the key is in progress (attempt ${attempt}) until ${leaseExpiresAt.toISOString()}`);
    this.leaseExpiresAt = leaseExpiresAt;
    this.attempt = attempt;
  }

  /** Whole seconds until the holder's lease runs out, at least 1 (for `Retry-After`). */
  get retryAfterSeconds(): number {
    return Math.max(1, Math.ceil((this.leaseExpiresAt.getTime() - Date.now()) / 1000));
  }
}

/** runOnce: the key was claimed for a different request (HTTP 422). Nothing changed. */
export class FingerprintMismatchError extends IdempotencyError {
  override name = 'FingerprintMismatchError';
  constructor() {
    super('the idempotency key was used for a different request (fingerprint mismatch)');
  }
}

type CoordinatorErrorClass = new (
  message: string,
  code: grpc.status,
  details: StatusDetails,
  options?: ErrorOptions,
) => CoordinatorError;

// The reason decides where there is one; the code is the fallback for statuses the coordinator
// did not make itself (a proxy, the transport, the client's own deadline).
const CLASS_BY_REASON: Record<string, CoordinatorErrorClass> = {
  INVALID_ARGUMENT: InvalidArgumentError,
  LEASE_LOST: LeaseLostError,
  KEY_NOT_FOUND: KeyNotFoundError,
  ALREADY_COMPLETED: AlreadyCompletedError,
  STORE_UNAVAILABLE: UnavailableError,
  UNAUTHENTICATED: UnauthenticatedError,
  PERMISSION_DENIED: PermissionDeniedError,
  RATE_LIMITED: RateLimitedError,
  INTERNAL: InternalError,
};

const CLASS_BY_CODE: Partial<Record<grpc.status, CoordinatorErrorClass>> = {
  [grpc.status.INVALID_ARGUMENT]: InvalidArgumentError,
  [grpc.status.ABORTED]: LeaseLostError,
  [grpc.status.NOT_FOUND]: KeyNotFoundError,
  [grpc.status.FAILED_PRECONDITION]: AlreadyCompletedError,
  [grpc.status.UNAVAILABLE]: UnavailableError,
  [grpc.status.DEADLINE_EXCEEDED]: DeadlineExceededError,
  [grpc.status.UNAUTHENTICATED]: UnauthenticatedError,
  [grpc.status.PERMISSION_DENIED]: PermissionDeniedError,
  [grpc.status.INTERNAL]: InternalError,
};

/** Turns a failed call into the typed error for its reason (or code). */
export function errorFromStatus(error: grpc.ServiceError): CoordinatorError {
  const details = readStatusDetails(error.metadata);
  const errorClass =
    (details.reason !== undefined ? CLASS_BY_REASON[details.reason] : undefined) ??
    CLASS_BY_CODE[error.code] ??
    CoordinatorError;
  return new errorClass(error.details || error.message, error.code, details, { cause: error });
}

/** Whether a failed call may be repeated as it is: nothing was written, or a retry settles it. */
export function isTransient(error: unknown): boolean {
  return error instanceof UnavailableError || error instanceof DeadlineExceededError;
}

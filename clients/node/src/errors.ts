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

/**
 * A subclass of CoordinatorError named `name`. The name is given as a string rather than read
 * from the class, so that it survives minifiers; the declared base stays CoordinatorError.
 */
function coordinatorError(name: string): typeof CoordinatorError {
  return class extends CoordinatorError {
    override name = name;
  };
}

/** `INVALID_ARGUMENT`: a field was missing, malformed or out of bounds; nothing was written. */
export class InvalidArgumentError extends coordinatorError('InvalidArgumentError') {
  /** The names of the fields at fault, e.g. `['namespace', 'lease_ttl']`. */
  get fields(): string[] {
    return this.fieldViolations.map((violation) => violation.field);
  }
}

/**
 * `ABORTED` / `LEASE_LOST`: the lease token is no longer the key's current one. Someone else
 * took the key over (after this holder's lease ran out) and owns its result now.
 */
export class LeaseLostError extends coordinatorError('LeaseLostError') {}

/** `NOT_FOUND` / `KEY_NOT_FOUND`: Complete, Release or ExtendLease on an absent or expired key. */
export class KeyNotFoundError extends coordinatorError('KeyNotFoundError') {}

/** `FAILED_PRECONDITION` / `ALREADY_COMPLETED`: the key is completed (with another response). */
export class AlreadyCompletedError extends coordinatorError('AlreadyCompletedError') {}

/**
 * `UNAVAILABLE`: the store is unreachable or timed out (reason `STORE_UNAVAILABLE`, nothing was
 * written), or the coordinator itself could not be reached (no reason). Safe to retry.
 */
export class UnavailableError extends coordinatorError('UnavailableError') {}

/** `DEADLINE_EXCEEDED`: no answer within the call's deadline; the outcome is unknown. */
export class DeadlineExceededError extends coordinatorError('DeadlineExceededError') {}

/** `UNAUTHENTICATED`: no bearer token, or one the coordinator does not know. */
export class UnauthenticatedError extends coordinatorError('UnauthenticatedError') {}

/** `PERMISSION_DENIED`: the token does not hold this namespace or consumer. */
export class PermissionDeniedError extends coordinatorError('PermissionDeniedError') {}

/** `RESOURCE_EXHAUSTED` / `RATE_LIMITED`: the token is over its rate limit; see retryDelayMs. */
export class RateLimitedError extends coordinatorError('RateLimitedError') {}

/**
 * `RESOURCE_EXHAUSTED` / `OVERLOADED`: the coordinator is short of room for responses not yet
 * read, and refused a call that wrote nothing; see retryDelayMs.
 */
export class OverloadedError extends coordinatorError('OverloadedError') {}

/** `INTERNAL`: an unexpected failure inside the coordinator (its log has the cause). */
export class InternalError extends coordinatorError('InternalError') {}

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

/**
 * runOnce: the work ran and returned `result`, but Complete could not store it (the coordinator
 * unreachable for the whole retry budget, or a refusal); `cause` is Complete's error, and
 * `code`, `reason` and `retryDelayMs` are its. The key stays claimed until its lease runs out,
 * and a retry after that runs the work again: answer with `result` if the effect must not be
 * repeated, knowing it is not recorded. A lost lease is a LeaseLostError instead.
 */
export class ResultNotStoredError<T = unknown> extends CoordinatorError {
  override name = 'ResultNotStoredError';
  readonly result: T;

  constructor(result: T, cause: CoordinatorError) {
    super(
      `the work ran but its result was not stored: ${cause.message}`,
      cause.code,
      { reason: cause.reason, fieldViolations: [...cause.fieldViolations], retryDelayMs: cause.retryDelayMs },
      { cause },
    );
    this.result = result;
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

// Which class a failed call becomes, one row per class: the reason decides where there is one;
// the code is the fallback for statuses the coordinator did not make itself (a proxy, the
// transport, the client's own deadline). A row without a code is chosen by its reason alone.
const ERROR_CLASSES: readonly { errorClass: CoordinatorErrorClass; reason?: string; code?: grpc.status }[] = [
  { errorClass: InvalidArgumentError, reason: 'INVALID_ARGUMENT', code: grpc.status.INVALID_ARGUMENT },
  { errorClass: LeaseLostError, reason: 'LEASE_LOST', code: grpc.status.ABORTED },
  { errorClass: KeyNotFoundError, reason: 'KEY_NOT_FOUND', code: grpc.status.NOT_FOUND },
  { errorClass: AlreadyCompletedError, reason: 'ALREADY_COMPLETED', code: grpc.status.FAILED_PRECONDITION },
  { errorClass: UnavailableError, reason: 'STORE_UNAVAILABLE', code: grpc.status.UNAVAILABLE },
  { errorClass: DeadlineExceededError, code: grpc.status.DEADLINE_EXCEEDED },
  { errorClass: UnauthenticatedError, reason: 'UNAUTHENTICATED', code: grpc.status.UNAUTHENTICATED },
  { errorClass: PermissionDeniedError, reason: 'PERMISSION_DENIED', code: grpc.status.PERMISSION_DENIED },
  // RESOURCE_EXHAUSTED without a reason is not the coordinator's refusal (grpc-js answers it for
  // a message over its own limit, which no retry cures): a plain CoordinatorError.
  { errorClass: RateLimitedError, reason: 'RATE_LIMITED' },
  { errorClass: OverloadedError, reason: 'OVERLOADED' },
  { errorClass: InternalError, reason: 'INTERNAL', code: grpc.status.INTERNAL },
];

/** Turns a failed call into the typed error for its reason (or code). */
export function errorFromStatus(error: grpc.ServiceError): CoordinatorError {
  const details = readStatusDetails(error.metadata);
  const row =
    ERROR_CLASSES.find((candidate) => details.reason !== undefined && candidate.reason === details.reason) ??
    ERROR_CLASSES.find((candidate) => candidate.code === error.code);
  const errorClass = row?.errorClass ?? CoordinatorError;
  return new errorClass(error.details || error.message, error.code, details, { cause: error });
}

/**
 * Whether a failed call may succeed when sent again: the coordinator was unreachable, slow, or
 * refused it at the door. For calls whose repetition is harmless (TryStart with its attempt_id,
 * Complete with the same response, Release, ExtendLease, Lookup).
 */
export function isTransient(error: unknown): boolean {
  return error instanceof UnavailableError || error instanceof DeadlineExceededError || isRefusedAtTheDoor(error);
}

/**
 * Refused before anything ran (`RATE_LIMITED`, `OVERLOADED`), so that even a call whose
 * repetition is not harmless (MarkProcessed) may be sent again.
 */
export function isRefusedAtTheDoor(error: unknown): boolean {
  return error instanceof RateLimitedError || error instanceof OverloadedError;
}

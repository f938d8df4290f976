package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the ErrorInfo domain of the coordinator's reasons.
const ErrorDomain = "idempotency.v1"

// The reasons the coordinator puts in its ErrorInfo (docs/contract.md, "Errors").
const (
	ReasonInvalidArgument  = "INVALID_ARGUMENT"
	ReasonLeaseLost        = "LEASE_LOST"
	ReasonKeyNotFound      = "KEY_NOT_FOUND"
	ReasonAlreadyCompleted = "ALREADY_COMPLETED"
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
	ReasonUnauthenticated  = "UNAUTHENTICATED"
	ReasonPermissionDenied = "PERMISSION_DENIED"
	ReasonRateLimited      = "RATE_LIMITED"
	ReasonOverloaded       = "OVERLOADED"
	ReasonInternal         = "INTERNAL"
)

// Sentinels for errors.Is. Every error a call returns is an *Error that matches exactly one of
// them (ErrStoreUnavailable also matches ErrUnavailable); the outcomes that are not results
// (ErrInProgress, ErrMismatch) and ErrResultNotStored come from RunOnce.
var (
	// ErrMismatch: the key was claimed for a different request (HTTP 422). Nothing changed.
	ErrMismatch = errors.New("idempotency: the key was used for a different request (fingerprint mismatch)")
	// ErrInProgress: another caller holds the key and did not finish within the wait (HTTP 409).
	// The concrete type is *InProgressError.
	ErrInProgress = errors.New("idempotency: the key is in progress elsewhere")
	// ErrLeaseLost: this caller no longer holds the key (ABORTED / LEASE_LOST, or the lease ran
	// out while the coordinator was unreachable). The new holder owns the result.
	ErrLeaseLost = errors.New("idempotency: the lease was lost")
	// ErrKeyNotFound: Complete, Release or ExtendLease on an absent or expired key (NOT_FOUND).
	ErrKeyNotFound = errors.New("idempotency: key not found")
	// ErrAlreadyCompleted: the key holds another result (FAILED_PRECONDITION).
	ErrAlreadyCompleted = errors.New("idempotency: key already completed")
	// ErrInvalidArgument: a field is missing, malformed or out of bounds (INVALID_ARGUMENT),
	// found by the coordinator or, before any call, by this client. Nothing was written.
	ErrInvalidArgument = errors.New("idempotency: invalid argument")
	// ErrUnauthenticated: no token, or one the coordinator does not know.
	ErrUnauthenticated = errors.New("idempotency: unauthenticated")
	// ErrPermissionDenied: the token does not hold this namespace or consumer.
	ErrPermissionDenied = errors.New("idempotency: permission denied")
	// ErrRateLimited: RESOURCE_EXHAUSTED / RATE_LIMITED, after the retries ran out.
	ErrRateLimited = errors.New("idempotency: rate limited")
	// ErrOverloaded: RESOURCE_EXHAUSTED / OVERLOADED (the coordinator's response budget is
	// full), after the retries ran out.
	ErrOverloaded = errors.New("idempotency: coordinator overloaded")
	// ErrUnavailable: the coordinator or its store could not be reached (UNAVAILABLE), after
	// the retries ran out.
	ErrUnavailable = errors.New("idempotency: coordinator unavailable")
	// ErrStoreUnavailable: UNAVAILABLE / STORE_UNAVAILABLE; nothing was written. It also
	// matches ErrUnavailable.
	ErrStoreUnavailable = errors.New("idempotency: the coordinator's store is unavailable")
	// ErrDeadline: a call did not answer within the call timeout (DEADLINE_EXCEEDED), or the
	// caller's own deadline passed (the error then also matches context.DeadlineExceeded).
	ErrDeadline = errors.New("idempotency: deadline exceeded")
	// ErrInternal: an unexpected failure inside the coordinator (INTERNAL), a bug to report.
	ErrInternal = errors.New("idempotency: internal error in the coordinator")
	// ErrResultNotStored: the work ran and returned a result, but Complete could not store it.
	// The concrete type is *ResultNotStoredError[T], which carries the result.
	ErrResultNotStored = errors.New("idempotency: the work's result was not stored")
)

// FieldViolation is one bad field of a request, as the coordinator (or this client) named it:
// "event_ids[3]" for an element.
type FieldViolation struct {
	Field       string
	Description string
}

// Error is a failed call: the gRPC status, decoded. errors.Is matches it against the sentinel
// of its reason (or, without one, of its code); errors.As gets it from any wrapped error; and
// GRPCStatus keeps the status whole, so status.FromError and status.Code work on it.
type Error struct {
	// Op is the RPC that failed ("TryStart", ...).
	Op string
	// Code is the gRPC status code.
	Code codes.Code
	// Reason is the contract's reason (ErrorInfo in domain idempotency.v1), or "" when none was
	// sent (the transport failed, a deadline passed on this side).
	Reason string
	// Message is the status message.
	Message string
	// Violations names every bad field of an INVALID_ARGUMENT.
	Violations []FieldViolation
	// RetryDelay is how long the coordinator asked the caller to wait (RetryInfo); 0 if it did not.
	RetryDelay time.Duration

	status *status.Status
	cause  error
}

func (e *Error) Error() string {
	label := e.Reason
	if label == "" {
		label = e.Code.String()
	}
	return fmt.Sprintf("idempotency: %s: %s: %s", e.Op, label, e.Message)
}

// GRPCStatus returns the status the call failed with, details included.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Unwrap returns what ended the call on this side, when it was not the coordinator: the
// caller's context (context.Canceled, context.DeadlineExceeded), or nil.
func (e *Error) Unwrap() error { return e.cause }

// Is matches the sentinel of the error's reason, or of its code when it has no reason.
func (e *Error) Is(target error) bool {
	sentinel := e.sentinel()
	if sentinel == nil {
		return false
	}
	return target == sentinel || (sentinel == ErrStoreUnavailable && target == ErrUnavailable)
}

// Fields lists the names of the bad fields, in the coordinator's order.
func (e *Error) Fields() []string {
	names := make([]string, len(e.Violations))
	for i, v := range e.Violations {
		names[i] = v.Field
	}
	return names
}

var byReason = map[string]error{
	ReasonInvalidArgument:  ErrInvalidArgument,
	ReasonLeaseLost:        ErrLeaseLost,
	ReasonKeyNotFound:      ErrKeyNotFound,
	ReasonAlreadyCompleted: ErrAlreadyCompleted,
	ReasonStoreUnavailable: ErrStoreUnavailable,
	ReasonUnauthenticated:  ErrUnauthenticated,
	ReasonPermissionDenied: ErrPermissionDenied,
	ReasonRateLimited:      ErrRateLimited,
	ReasonOverloaded:       ErrOverloaded,
	ReasonInternal:         ErrInternal,
}

// A status without a reason (made by the transport, or by a proxy) is sorted by its code, as the
// other clients do. RESOURCE_EXHAUSTED without a reason is left out on purpose: grpc-go itself
// answers it for a message over the receive limit, which no retry cures.
var byCode = map[codes.Code]error{
	codes.InvalidArgument:    ErrInvalidArgument,
	codes.Aborted:            ErrLeaseLost,
	codes.NotFound:           ErrKeyNotFound,
	codes.FailedPrecondition: ErrAlreadyCompleted,
	codes.Unavailable:        ErrUnavailable,
	codes.DeadlineExceeded:   ErrDeadline,
	codes.Unauthenticated:    ErrUnauthenticated,
	codes.PermissionDenied:   ErrPermissionDenied,
	codes.Internal:           ErrInternal,
}

func (e *Error) sentinel() error {
	if s, ok := byReason[e.Reason]; ok {
		return s
	}
	return byCode[e.Code]
}

// transient reports a failure after which the same call may succeed: the coordinator was
// unreachable, slow, or asked the caller to slow down.
func (e *Error) transient() bool {
	switch e.sentinel() {
	case ErrUnavailable, ErrStoreUnavailable, ErrDeadline, ErrRateLimited, ErrOverloaded:
		return true
	}
	return false
}

// refusedAtTheDoor reports a call refused before anything ran, so that even a call whose
// repetition is not harmless (MarkProcessed) may be sent again.
func (e *Error) refusedAtTheDoor() bool {
	s := e.sentinel()
	return s == ErrRateLimited || s == ErrOverloaded
}

// fromStatus decodes a failed call's status and its rich details.
func fromStatus(op string, st *status.Status) *Error {
	e := &Error{Op: op, Code: st.Code(), Message: st.Message(), status: st}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			if d.GetDomain() == ErrorDomain {
				e.Reason = d.GetReason()
			}
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				e.Violations = append(e.Violations, FieldViolation{Field: v.GetField(), Description: v.GetDescription()})
			}
		case *errdetails.RetryInfo:
			if delay := d.GetRetryDelay(); delay != nil && delay.IsValid() {
				e.RetryDelay = delay.AsDuration()
			}
		}
	}
	return e
}

// invalid is the client's own refusal of bad input, shaped like the coordinator's, so that one
// errors.Is(err, ErrInvalidArgument) covers both. Nothing was sent.
func invalid(op, field, description string) *Error {
	st := status.New(codes.InvalidArgument, field+": "+description)
	if withDetails, err := st.WithDetails(
		&errdetails.ErrorInfo{Reason: ReasonInvalidArgument, Domain: ErrorDomain},
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: description}}},
	); err == nil {
		st = withDetails
	}
	return &Error{
		Op:         op,
		Code:       codes.InvalidArgument,
		Reason:     ReasonInvalidArgument,
		Message:    st.Message(),
		Violations: []FieldViolation{{Field: field, Description: description}},
		status:     st,
	}
}

// gaveUp is the error of a call whose caller's context ended, whenever it ended: during a try,
// during a pause between tries, or while RunOnce waited for another holder. It is always an
// *Error with the context's code (DEADLINE_EXCEEDED, so that it matches ErrDeadline, or
// CANCELLED) that unwraps to the context's error, so that errors.Is(err,
// context.DeadlineExceeded) or errors.Is(err, context.Canceled) holds, and to its cause when the
// caller gave one (context.WithDeadlineCause). during says what the call was doing, if not a try.
func gaveUp(ctx context.Context, op, during string) *Error {
	ended := ctx.Err()
	code := codes.Canceled
	if errors.Is(ended, context.DeadlineExceeded) {
		code = codes.DeadlineExceeded
	}
	message := "the caller's context ended: " + ended.Error()
	if during != "" {
		message += ", " + during
	}
	cause := ended
	if why := context.Cause(ctx); why != nil && why != ended {
		cause = errors.Join(ended, why)
	}
	return &Error{Op: op, Code: code, Message: message, status: status.New(code, message), cause: cause}
}

// unanswered is the error of a call that got no answer in time, seen from a lease: the
// coordinator stopped answering (it hangs, or the network drops its packets), which is what
// ErrUnavailable names, so that a lease that ran out while its heartbeat hung says so rather
// than "deadline exceeded". last is the call's own failure, if it ended at all.
func unanswered(op string, last error) *Error {
	message := "no answer from the coordinator within the lease"
	if last != nil {
		message += " (" + last.Error() + ")"
	}
	return &Error{Op: op, Code: codes.Unavailable, Message: message, status: status.New(codes.Unavailable, message)}
}

// noAnswer reports a failure that is a try's own deadline passing without an answer
// (DEADLINE_EXCEEDED made on this side: no reason, not the caller's context).
func noAnswer(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == codes.DeadlineExceeded && e.Reason == "" && e.cause == nil
}

// InProgressError is what RunOnce returns when another caller still holds the key after the
// wait; errors.Is(err, ErrInProgress) matches it. Answer HTTP 409 with Retry-After.
type InProgressError struct {
	// LeaseExpiresAt is when the holder's lease runs out, by the coordinator's clock.
	LeaseExpiresAt time.Time
	// Attempt is the holder's attempt (1, or more after takeovers).
	Attempt uint32
	// RetryAfter is the time until the holder's lease runs out by this machine's clock; 0 when
	// it has already run out (the next try may take the key over).
	RetryAfter time.Duration
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("%v (attempt %d); retry in %v", ErrInProgress, e.Attempt, e.RetryAfter.Round(time.Millisecond))
}

// Is matches ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// ResultNotStoredError is what RunOnce returns when the work ran and returned Result, but
// Complete failed (the coordinator stayed unreachable for the whole retry budget, or refused the
// response, e.g. over its size limit). Only the result was lost: the claim stays until its lease
// runs out, and a retry after that runs the work again. errors.Is(err, ErrResultNotStored)
// matches it, and errors.Is/As also see the Complete's own error through Unwrap.
type ResultNotStoredError[T any] struct {
	Result T
	Err    error
}

func (e *ResultNotStoredError[T]) Error() string {
	return fmt.Sprintf("%v: %v", ErrResultNotStored, e.Err)
}

// Is matches ErrResultNotStored.
func (e *ResultNotStoredError[T]) Is(target error) bool { return target == ErrResultNotStored }

// Unwrap returns the Complete's error.
func (e *ResultNotStoredError[T]) Unwrap() error { return e.Err }

// leaseLost is the cause given to the work's context and returned by RunOnce when the lease is
// gone: it matches ErrLeaseLost and keeps why (a LEASE_LOST status, or the failure that kept the
// heartbeat from the coordinator until the lease ran out).
type leaseLost struct{ why error }

func (e *leaseLost) Error() string {
	if e.why == nil {
		return ErrLeaseLost.Error()
	}
	return fmt.Sprintf("%v: %v", ErrLeaseLost, e.why)
}

func (e *leaseLost) Is(target error) bool { return target == ErrLeaseLost }
func (e *leaseLost) Unwrap() error        { return e.why }

package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyv1"
)

// StartRequest is a TryStart. Zero durations are absent: the coordinator's defaults apply.
type StartRequest struct {
	Namespace   string
	Key         string
	Fingerprint []byte        // at most 64 bytes; empty matches only empty
	LeaseTTL    time.Duration // 100 ms – 24 h; 0: the coordinator's default (30 s)
	Retention   time.Duration // 1 s – 30 d; 0: the coordinator's default (24 h)
	// AttemptID makes the TryStart safe to send again (at most 128 bytes). When empty the client
	// makes one, so that its own retries of a call whose answer was lost get the claim back;
	// Claim.AttemptID says which.
	AttemptID string
	// Wait is how long the coordinator may hold the call for another holder (0 – 60 s).
	Wait time.Duration
}

// ClaimOutcome is what a TryStart answered.
type ClaimOutcome int

const (
	// Started: the caller holds the key (Claim.Token, Claim.Attempt, Claim.Checkpoint).
	Started ClaimOutcome = iota + 1
	// InProgress: another caller holds it (Claim.LeaseExpiresAt, Claim.Attempt).
	InProgress
	// Completed: the key holds a response (Claim.Response, Claim.CompletedAt, Claim.ExpiresAt).
	Completed
	// FingerprintMismatch: the key was claimed for a different request. Nothing changed.
	FingerprintMismatch
)

func (o ClaimOutcome) String() string {
	switch o {
	case Started:
		return "started"
	case InProgress:
		return "in_progress"
	case Completed:
		return "completed"
	case FingerprintMismatch:
		return "fingerprint_mismatch"
	}
	return "unknown"
}

// Claim is a TryStart's answer. Outcomes are answers, not errors.
type Claim struct {
	Outcome   ClaimOutcome
	AttemptID string // the attempt_id that was sent
	Token     uint64 // Started
	Attempt   uint32 // Started, InProgress
	// LeaseExpiresAt: Started (this claim's lease) and InProgress (the holder's).
	LeaseExpiresAt time.Time
	// Checkpoint is what the previous holder saved (Started after a takeover); nil when none.
	Checkpoint  []byte
	Response    []byte    // Completed
	CompletedAt time.Time // Completed
	ExpiresAt   time.Time // Completed
}

// TryStart claims a key, or reports who holds it, its stored response, or a mismatch. It is
// retried within the budget after transient failures, with the same attempt_id.
func (c *Client) TryStart(ctx context.Context, r StartRequest) (Claim, error) {
	const op = "TryStart"
	if err := r.check(op); err != nil {
		return Claim{}, err
	}
	if err := checkDuration(op, "wait", r.Wait, 0, MaxServerWait, true); err != nil {
		return Claim{}, err
	}
	if r.AttemptID == "" {
		r.AttemptID = newAttemptID()
	}
	req := r.message()
	var answer *pb.TryStartResponse
	err := c.call(ctx, op, retryTransient, func() (time.Duration, func(context.Context) error) {
		return r.Wait, func(ctx context.Context) (err error) {
			answer, err = c.rpc.TryStart(ctx, req)
			return err
		}
	})
	if err != nil {
		return Claim{}, err
	}
	claim := readClaim(answer)
	claim.AttemptID = r.AttemptID
	return claim, nil
}

func (r *StartRequest) check(op string) error {
	if err := checkKey(op, "namespace", r.Namespace, r.Key); err != nil {
		return err
	}
	if err := checkBytes(op, "fingerprint", r.Fingerprint, MaxFingerprint); err != nil {
		return err
	}
	if err := checkDuration(op, "lease_ttl", r.LeaseTTL, MinLease, MaxLease, true); err != nil {
		return err
	}
	if err := checkDuration(op, "retention", r.Retention, MinRetention, MaxRetention, true); err != nil {
		return err
	}
	return checkText(op, "attempt_id", r.AttemptID, MaxAttemptIDBytes, true)
}

func (r *StartRequest) message() *pb.TryStartRequest {
	return &pb.TryStartRequest{
		Namespace:   r.Namespace,
		Key:         r.Key,
		Fingerprint: r.Fingerprint,
		AttemptId:   r.AttemptID,
		LeaseTtl:    optionalDuration(r.LeaseTTL),
		Retention:   optionalDuration(r.Retention),
		Wait:        optionalDuration(r.Wait),
	}
}

func readClaim(answer *pb.TryStartResponse) Claim {
	switch o := answer.GetOutcome().(type) {
	case *pb.TryStartResponse_Started:
		return Claim{
			Outcome:        Started,
			Token:          o.Started.GetLeaseToken(),
			Attempt:        o.Started.GetAttempt(),
			LeaseExpiresAt: instant(o.Started.GetLeaseExpiresAt()),
			Checkpoint:     presentBytes(o.Started.Checkpoint),
		}
	case *pb.TryStartResponse_InProgress:
		return Claim{
			Outcome:        InProgress,
			Attempt:        o.InProgress.GetAttempt(),
			LeaseExpiresAt: instant(o.InProgress.GetLeaseExpiresAt()),
		}
	case *pb.TryStartResponse_Completed:
		return Claim{
			Outcome:     Completed,
			Response:    nonNil(o.Completed.GetResponse()),
			CompletedAt: instant(o.Completed.GetCompletedAt()),
			ExpiresAt:   instant(o.Completed.GetExpiresAt()),
		}
	case *pb.TryStartResponse_FingerprintMismatch:
		return Claim{Outcome: FingerprintMismatch}
	}
	return Claim{}
}

// CompleteRequest stores a response under the current holder's token.
type CompleteRequest struct {
	Namespace string
	Key       string
	Token     uint64
	Response  []byte
	// Retention counts from the completion (1 s – 30 d); 0: the one the key was claimed with.
	Retention time.Duration
}

// Completion is when a key was completed and until when it is kept.
type Completion struct {
	CompletedAt time.Time
	ExpiresAt   time.Time
}

// Complete stores the response and completes the key. Repeating it with the same response
// succeeds again, so it is retried within the budget after transient failures.
func (c *Client) Complete(ctx context.Context, r CompleteRequest) (Completion, error) {
	const op = "Complete"
	if err := checkKey(op, "namespace", r.Namespace, r.Key); err != nil {
		return Completion{}, err
	}
	if err := checkToken(op, r.Token); err != nil {
		return Completion{}, err
	}
	if err := checkDuration(op, "retention", r.Retention, MinRetention, MaxRetention, true); err != nil {
		return Completion{}, err
	}
	req := &pb.CompleteRequest{Namespace: r.Namespace, Key: r.Key, LeaseToken: r.Token, Response: r.Response,
		Retention: optionalDuration(r.Retention)}
	answer, err := unary(ctx, c, op, retryTransient, c.rpc.Complete, req)
	if err != nil {
		return Completion{}, err
	}
	return Completion{CompletedAt: instant(answer.GetCompletedAt()), ExpiresAt: instant(answer.GetExpiresAt())}, nil
}

// Release gives a claim up: the key is absent afterwards, so a retry starts fresh.
func (c *Client) Release(ctx context.Context, namespace, key string, token uint64) error {
	const op = "Release"
	if err := checkKey(op, "namespace", namespace, key); err != nil {
		return err
	}
	if err := checkToken(op, token); err != nil {
		return err
	}
	return c.release(ctx, namespace, key, token, time.Time{})
}

// release sends Release, retried within the budget and not after until (zero: the budget alone).
func (c *Client) release(ctx context.Context, namespace, key string, token uint64, until time.Time) error {
	req := &pb.ReleaseRequest{Namespace: namespace, Key: key, LeaseToken: token}
	return c.callUntil(ctx, "Release", retryTransient, until, func() (time.Duration, func(context.Context) error) {
		return 0, func(ctx context.Context) error {
			_, err := c.rpc.Release(ctx, req)
			return err
		}
	})
}

// ExtendRequest moves a lease's expiry to now + LeaseTTL and may save a checkpoint.
type ExtendRequest struct {
	Namespace string
	Key       string
	Token     uint64
	LeaseTTL  time.Duration // 100 ms – 24 h; 0: the coordinator's default (30 s)
	// Checkpoint replaces the stored one when non-nil (even empty: []byte{}); nil keeps it.
	// At most 64 KiB.
	Checkpoint []byte
}

// ExtendLease renews the lease and answers its new expiry.
func (c *Client) ExtendLease(ctx context.Context, r ExtendRequest) (time.Time, error) {
	expiresAt, _, err := c.extend(ctx, r, retryTransient, time.Time{})
	return expiresAt, err
}

// extend sends ExtendLease, retried as class allows and not after until (zero: within the
// budget), and answers the new expiry and when the try that got it was sent: the coordinator
// renewed the lease after that instant, so a lease counted from it is never later than its own.
func (c *Client) extend(ctx context.Context, r ExtendRequest, class retryClass, until time.Time) (expiresAt, sentAt time.Time, err error) {
	const op = "ExtendLease"
	if err := checkKey(op, "namespace", r.Namespace, r.Key); err != nil {
		return time.Time{}, time.Time{}, err
	}
	if err := checkToken(op, r.Token); err != nil {
		return time.Time{}, time.Time{}, err
	}
	if err := checkDuration(op, "lease_ttl", r.LeaseTTL, MinLease, MaxLease, true); err != nil {
		return time.Time{}, time.Time{}, err
	}
	if err := checkBytes(op, "checkpoint", r.Checkpoint, MaxCheckpoint); err != nil {
		return time.Time{}, time.Time{}, err
	}
	req := &pb.ExtendLeaseRequest{Namespace: r.Namespace, Key: r.Key, LeaseToken: r.Token,
		LeaseTtl: optionalDuration(r.LeaseTTL), Checkpoint: r.Checkpoint} // a nil checkpoint is absent
	var answer *pb.ExtendLeaseResponse
	err = c.callUntil(ctx, op, class, until, func() (time.Duration, func(context.Context) error) {
		return 0, func(ctx context.Context) (err error) {
			sentAt = time.Now()
			answer, err = c.rpc.ExtendLease(ctx, req)
			return err
		}
	})
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	return instant(answer.GetLeaseExpiresAt()), sentAt, nil
}

// KeyStatus is the state of a key as Lookup sees it.
type KeyStatus int

const (
	// KeyAbsent: never claimed, released, or past its retention.
	KeyAbsent KeyStatus = iota + 1
	// KeyInProgress: claimed and not completed (its lease may have run out).
	KeyInProgress
	// KeyCompleted: holds a response.
	KeyCompleted
)

func (s KeyStatus) String() string {
	switch s {
	case KeyAbsent:
		return "absent"
	case KeyInProgress:
		return "in_progress"
	case KeyCompleted:
		return "completed"
	}
	return "unknown"
}

// KeyState is a Lookup's answer.
type KeyState struct {
	Status         KeyStatus
	Fingerprint    []byte    // InProgress, Completed
	LeaseExpiresAt time.Time // InProgress
	Attempt        uint32    // InProgress
	Response       []byte    // Completed
	CompletedAt    time.Time // Completed
	ExpiresAt      time.Time // Completed
}

// Lookup reads a key's state without changing it.
func (c *Client) Lookup(ctx context.Context, namespace, key string) (KeyState, error) {
	const op = "Lookup"
	if err := checkKey(op, "namespace", namespace, key); err != nil {
		return KeyState{}, err
	}
	req := &pb.LookupRequest{Namespace: namespace, Key: key}
	answer, err := unary(ctx, c, op, retryTransient, c.rpc.Lookup, req)
	if err != nil {
		return KeyState{}, err
	}
	switch s := answer.GetState().(type) {
	case *pb.LookupResponse_InProgress:
		return KeyState{
			Status:         KeyInProgress,
			Fingerprint:    nonNil(s.InProgress.GetFingerprint()),
			LeaseExpiresAt: instant(s.InProgress.GetLeaseExpiresAt()),
			Attempt:        s.InProgress.GetAttempt(),
		}, nil
	case *pb.LookupResponse_Completed:
		return KeyState{
			Status:      KeyCompleted,
			Fingerprint: nonNil(s.Completed.GetFingerprint()),
			Response:    nonNil(s.Completed.GetResponse()),
			CompletedAt: instant(s.Completed.GetCompletedAt()),
			ExpiresAt:   instant(s.Completed.GetExpiresAt()),
		}, nil
	}
	return KeyState{Status: KeyAbsent}, nil
}

// A MarkOption configures MarkProcessed.
type MarkOption struct{ retention time.Duration }

// WithEventRetention is how long the events are remembered (1 s – 30 d; the coordinator's
// default is 7 days).
func WithEventRetention(d time.Duration) MarkOption { return MarkOption{retention: d} }

// MarkProcessed records, atomically for the batch (1–1000 ids), that consumer handled the events,
// and answers the ids that were new, in request order (an id twice in one call is new the first
// time). It is retried only when refused at the door (rate limited, overloaded): a retry after a
// lost answer would report the events as already processed, and the caller would skip them, so
// other failures are returned instead. For an effect that must happen exactly once, use
// ProcessOnce, which claims the event before the effect.
func (c *Client) MarkProcessed(ctx context.Context, consumer string, ids []string, opts ...MarkOption) ([]string, error) {
	const op = "MarkProcessed"
	if err := checkScope(op, "consumer", consumer); err != nil {
		return nil, err
	}
	if len(ids) == 0 || len(ids) > MaxEventIDs {
		return nil, invalid(op, "event_ids", "must hold 1-1000 ids")
	}
	for i, id := range ids {
		if err := checkText(op, "event_ids["+strconv.Itoa(i)+"]", id, MaxKeyBytes, false); err != nil {
			return nil, err
		}
	}
	req := &pb.MarkProcessedRequest{Consumer: consumer, EventIds: ids}
	for _, o := range opts {
		if o.retention == 0 {
			continue
		}
		if err := checkDuration(op, "retention", o.retention, MinRetention, MaxRetention, false); err != nil {
			return nil, err
		}
		req.Retention = durationpb.New(o.retention)
	}
	answer, err := unary(ctx, c, op, retryAtTheDoor, c.rpc.MarkProcessed, req)
	if err != nil {
		return nil, err
	}
	fresh := []string{}
	for _, r := range answer.GetResults() {
		if !r.GetAlreadyProcessed() {
			fresh = append(fresh, r.GetEventId())
		}
	}
	return fresh, nil
}

// optionalDuration is d as sent to the coordinator: absent (nil; its default applies) when zero.
func optionalDuration(d time.Duration) *durationpb.Duration {
	if d <= 0 {
		return nil
	}
	return durationpb.New(d)
}

// instant is an instant from the coordinator; the zero time when absent.
func instant(ts *timestamppb.Timestamp) time.Time {
	if ts == nil {
		return time.Time{}
	}
	return ts.AsTime()
}

// presentBytes keeps the difference between an absent optional bytes field (nil) and a present
// empty one ([]byte{}).
func presentBytes(b []byte) []byte {
	if b == nil {
		return nil
	}
	return nonNil(b)
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// newAttemptID is 128 random bits in hex: one per logical attempt.
func newAttemptID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+).
	return hex.EncodeToString(b[:])
}

package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
)

// Outcome is what RunOnce returns: the result, and whether it was replayed from an earlier run
// (true) or produced by this call's own work (false).
type Outcome[T any] struct {
	Value    T
	Replayed bool
}

// A RunOption configures one RunOnce or ProcessOnce.
type RunOption struct{ apply func(*runSettings) }

type runSettings struct {
	lease          time.Duration
	retention      time.Duration
	wait           time.Duration
	heartbeat      time.Duration // 0: lease / HeartbeatDivisor
	noHeartbeat    bool
	fingerprint    []byte
	hasFingerprint bool
	codec          any
}

// WithLease is how long the claim is held without a heartbeat (default: the client's, 30 s;
// 100 ms – 24 h).
func WithLease(d time.Duration) RunOption {
	return RunOption{func(s *runSettings) { s.lease = d }}
}

// WithRetention is how long the key is kept (1 s – 30 d; default: the coordinator's, 24 h).
func WithRetention(d time.Duration) RunOption {
	return RunOption{func(s *runSettings) { s.retention = d }}
}

// WithWait is how long to wait for another holder before failing with ErrInProgress (default:
// the client's, 0). The coordinator holds each TryStart until the holder completes, releases or
// loses its lease (up to 60 s per TryStart; a longer wait asks again), so nothing polls.
func WithWait(d time.Duration) RunOption {
	return RunOption{func(s *runSettings) { s.wait = d }}
}

// WithHeartbeat extends the lease at this interval instead of every third of it.
func WithHeartbeat(interval time.Duration) RunOption {
	return RunOption{func(s *runSettings) { s.heartbeat, s.noHeartbeat = interval, false }}
}

// WithoutHeartbeat sends no ExtendLease while the work runs: only for work well within its
// lease. The work's context is still cancelled when the lease runs out.
func WithoutHeartbeat() RunOption {
	return RunOption{func(s *runSettings) { s.noHeartbeat = true }}
}

// WithFingerprint sends this fingerprint (at most 64 bytes) instead of hashing the request.
func WithFingerprint(fingerprint []byte) RunOption {
	return RunOption{func(s *runSettings) { s.fingerprint, s.hasFingerprint = fingerprint, true }}
}

// WithCodec stores results with this codec instead of JSONCodec. Its type must match the work's
// result type (RunOnce returns ErrInvalidArgument otherwise).
func WithCodec[T any](codec Codec[T]) RunOption {
	return RunOption{func(s *runSettings) { s.codec = codec }}
}

// Lease is the claim a running work holds. Its context (the one the work gets) is cancelled the
// moment the lease is lost, or may have run out while the coordinator could not be reached;
// context.Cause then matches ErrLeaseLost.
type Lease struct {
	Namespace string
	Key       string
	// Token is the claim's fencing token: strictly increasing per key, so a downstream store
	// that keeps the highest one it has seen can refuse a late write of an earlier holder.
	Token uint64
	// Attempt is 1 for a fresh claim, one more for every takeover.
	Attempt uint32
	// Checkpoint is what a previous holder saved with SaveCheckpoint before it released or its
	// lease ran out; nil when none was.
	Checkpoint []byte

	client   *Client
	leaseTTL time.Duration
	cancel   context.CancelCauseFunc

	mu        sync.Mutex
	expiresAt time.Time
	runsOutAt time.Time // the latest the lease can last, by this machine's clock
	lastBeat  error     // the last heartbeat's failure, for the cause of a lease that ran out
	extending int       // ExtendLease calls sent and not answered yet
	lost      error
	watchdog  *time.Timer
	stopped   bool // the work has returned: the watchdog is off for good
}

// ExpiresAt is when the lease runs out by the coordinator's clock, as last renewed.
func (l *Lease) ExpiresAt() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.expiresAt
}

// Err is nil while the lease is held, and why it was lost after (it matches ErrLeaseLost).
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lost
}

// SaveCheckpoint saves progress (at most 64 KiB) and renews the lease. If this holder dies, the
// caller that takes the key over finds it in Lease.Checkpoint. It fails with ErrLeaseLost (and
// the work's context is cancelled) when the key is no longer this holder's.
func (l *Lease) SaveCheckpoint(ctx context.Context, checkpoint []byte) error {
	if checkpoint == nil {
		checkpoint = []byte{}
	}
	if err := l.Err(); err != nil {
		return err
	}
	return l.extend(ctx, checkpoint, retryTransient)
}

func (l *Lease) extend(ctx context.Context, checkpoint []byte, class retryClass) error {
	l.mu.Lock()
	l.extending++
	l.mu.Unlock()
	expiresAt, sentAt, err := l.client.extend(ctx, ExtendRequest{
		Namespace: l.Namespace, Key: l.Key, Token: l.Token, LeaseTTL: l.leaseTTL, Checkpoint: checkpoint,
	}, class, time.Time{})
	l.mu.Lock()
	l.extending--
	l.mu.Unlock()
	if err != nil {
		if errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrKeyNotFound) || errors.Is(err, ErrAlreadyCompleted) {
			return l.lose(err)
		}
		l.mu.Lock()
		l.lastBeat = err
		l.mu.Unlock()
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.expiresAt = expiresAt
	l.lastBeat = nil
	// Counted from before the call was sent, so never later than the coordinator's expiry.
	if runsOut := sentAt.Add(l.leaseTTL); runsOut.After(l.runsOutAt) {
		l.runsOutAt = runsOut
		if l.watchdog != nil && !l.stopped {
			l.watchdog.Reset(time.Until(runsOut))
		}
	}
	return nil
}

// lose marks the lease lost (once) and cancels the work's context with the reason.
func (l *Lease) lose(why error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lost == nil {
		l.lost = &leaseLost{why: why}
		l.client.log.Warn("idempotency: lease lost; cancelling the work", "namespace", l.Namespace, "cause", why)
		l.cancel(l.lost)
	}
	return l.lost
}

// ranOut fires when the lease may have run out unrenewed: another caller may hold the key now,
// so the work must stop.
func (l *Lease) ranOut() {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return
	}
	if wait := time.Until(l.runsOutAt); wait > 0 {
		l.watchdog.Reset(wait) // renewed meanwhile
		l.mu.Unlock()
		return
	}
	why, hanging := l.lastBeat, l.extending > 0
	l.mu.Unlock()
	switch {
	case hanging || noAnswer(why):
		// A heartbeat sent and never answered: the coordinator stopped answering, which is
		// unreachable (ErrUnavailable), not a deadline of the caller's.
		why = fmt.Errorf("the lease ran out while the coordinator did not answer: %w", unanswered("ExtendLease", why))
	case why != nil:
		why = fmt.Errorf("the lease ran out while the coordinator could not be reached: %w", why)
	default:
		why = errors.New("the lease ran out before a heartbeat renewed it")
	}
	l.lose(why)
}

// beat renews the lease every interval until ctx ends. A missed beat is harmless while the
// lease runs (the next one is the retry); the watchdog stops the work once it may have run out.
func (l *Lease) beat(ctx context.Context, interval time.Duration) {
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		err := l.extend(ctx, nil, retryNever)
		switch {
		case err == nil:
		case errors.Is(err, ErrLeaseLost):
			return
		case ctx.Err() != nil:
			return
		default:
			l.client.log.Info("idempotency: heartbeat failed; trying again at the next beat", "namespace", l.Namespace, "error", err)
		}
	}
}

// RunOnce runs work at most once for key in namespace, or returns the result of the run that did
// (Outcome.Replayed).
//
// The request is fingerprinted with Fingerprint (nil: no fingerprint; []byte: SHA-256 of the
// bytes; anything else: SHA-256 of its RFC 8785 canonical JSON), so that the key cannot be reused
// for another request (ErrMismatch). A completed key is replayed without running work; a key held
// elsewhere is waited for (WithWait) and then ErrInProgress (*InProgressError). A claim whose
// TryStart took longer than a tenth of the lease (it waited) is renewed before work starts, so
// that work gets its whole lease. While work runs, a heartbeat renews its lease; its context is
// cancelled at once when the lease is lost. Its
// result is stored with Complete (*ResultNotStoredError if that fails); its error or panic
// releases the key, so that a retry starts fresh, and is returned (or goes on panicking).
//
// RunOnce is a function rather than a method because Go methods cannot have type parameters.
func RunOnce[T any](ctx context.Context, c *Client, namespace, key string, request any,
	work func(ctx context.Context, lease *Lease) (T, error), opts ...RunOption,
) (Outcome[T], error) {
	return runOnce(ctx, c, "namespace", namespace, key, request, work, opts)
}

// ProcessOnce handles a consumed event at most once: RunOnce with the consumer as namespace and
// the event id as key, claimed before the effect and completed after it. For effects that must
// happen once (a charge, an email); MarkProcessed only records that events were seen.
func ProcessOnce[T any](ctx context.Context, c *Client, consumer, eventID string, event any,
	work func(ctx context.Context, lease *Lease) (T, error), opts ...RunOption,
) (Outcome[T], error) {
	return runOnce(ctx, c, "consumer", consumer, eventID, event, work, opts)
}

type spec struct {
	namespace   string
	key         string
	fingerprint []byte
	lease       time.Duration
	retention   time.Duration
	wait        time.Duration
	heartbeat   time.Duration // 0: none
}

func runOnce[T any](ctx context.Context, c *Client, scopeField, namespace, key string, request any,
	work func(context.Context, *Lease) (T, error), opts []RunOption,
) (Outcome[T], error) {
	const op = "RunOnce"
	var zero Outcome[T]
	if c == nil {
		return zero, invalid(op, "client", "must not be nil")
	}
	if work == nil {
		return zero, invalid(op, "work", "must not be nil")
	}
	rs := runSettings{lease: c.s.leaseTTL, wait: c.s.wait}
	for _, o := range opts {
		if o.apply != nil {
			o.apply(&rs)
		}
	}
	var codec Codec[T] = JSONCodec[T]{}
	if rs.codec != nil {
		typed, ok := rs.codec.(Codec[T])
		if !ok {
			return zero, invalid(op, "codec", fmt.Sprintf("a %T does not encode the work's result type", rs.codec))
		}
		codec = typed
	}
	sp := spec{namespace: namespace, key: key, lease: rs.lease, retention: rs.retention, wait: rs.wait}
	if err := checkKey(op, scopeField, namespace, key); err != nil {
		return zero, err
	}
	if err := checkDuration(op, "lease_ttl", rs.lease, MinLease, MaxLease, false); err != nil {
		return zero, err
	}
	if err := checkDuration(op, "retention", rs.retention, MinRetention, MaxRetention, true); err != nil {
		return zero, err
	}
	if rs.wait < 0 {
		return zero, invalid(op, "wait", fmt.Sprintf("must not be negative (got %v)", rs.wait))
	}
	switch {
	case rs.noHeartbeat:
	case rs.heartbeat == 0:
		sp.heartbeat = rs.lease / HeartbeatDivisor
	case rs.heartbeat < 0:
		return zero, invalid(op, "heartbeat", fmt.Sprintf("must be positive (got %v)", rs.heartbeat))
	default:
		sp.heartbeat = rs.heartbeat
	}
	if rs.hasFingerprint {
		sp.fingerprint = rs.fingerprint
	} else {
		fp, err := Fingerprint(request)
		if err != nil {
			return zero, invalid(op, "request", err.Error())
		}
		sp.fingerprint = fp
	}
	if err := checkBytes(op, "fingerprint", sp.fingerprint, MaxFingerprint); err != nil {
		return zero, err
	}

	claim, askedAt, err := c.claim(ctx, &sp)
	answeredAt := time.Now()
	if err != nil {
		return zero, err
	}
	if claim.Outcome == Completed {
		value, err := codec.Decode(claim.Response)
		if err != nil {
			return zero, fmt.Errorf("idempotency: the stored result cannot be decoded: %w", err)
		}
		return Outcome[T]{Value: value, Replayed: true}, nil
	}
	return runHolding(ctx, c, &sp, claim, askedAt, answeredAt, codec, work)
}

// renewAfterWaitDivisor: a claim whose TryStart took longer than lease/renewAfterWaitDivisor
// (it waited for another holder) is renewed before the work starts (docs/contract.md, "A claim
// that waited"). Below it, counting the lease from the TryStart's sending loses little; above
// it, the first heartbeat (at lease/3) would have too little margin left, and a wait longer than
// the lease would leave none.
const renewAfterWaitDivisor = 10

// runHolding runs the work under the claim, with its heartbeat and watchdog, then completes or
// releases the key. askedAt and answeredAt are when the TryStart that claimed was sent and
// answered.
func runHolding[T any](ctx context.Context, c *Client, sp *spec, claim Claim, askedAt, answeredAt time.Time,
	codec Codec[T], work func(context.Context, *Lease) (T, error),
) (Outcome[T], error) {
	var zero Outcome[T]
	workCtx, cancelWork := context.WithCancelCause(ctx)
	defer cancelWork(nil)
	lease := &Lease{
		Namespace:  sp.namespace,
		Key:        sp.key,
		Token:      claim.Token,
		Attempt:    claim.Attempt,
		Checkpoint: claim.Checkpoint,
		client:     c,
		leaseTTL:   sp.lease,
		cancel:     cancelWork,
		expiresAt:  claim.LeaseExpiresAt,
		// Counted from before the winning TryStart was sent: never later than the coordinator's.
		runsOutAt: askedAt.Add(sp.lease),
	}
	if answeredAt.Sub(askedAt) > sp.lease/renewAfterWaitDivisor {
		// The coordinator may have granted the lease long after the TryStart was sent: renew it,
		// so that the work starts with its whole lease, counted from the renewal's sending.
		if err := lease.renewAfterWait(ctx, answeredAt); err != nil {
			return zero, err
		}
	}
	lease.mu.Lock()
	lease.watchdog = time.AfterFunc(time.Until(lease.runsOutAt), lease.ranOut)
	lease.mu.Unlock()

	// The heartbeat's calls outlive a caller that gave up (the work is still running); they end
	// with the work.
	beatCtx, stopBeat := context.WithCancel(context.WithoutCancel(ctx))
	var beating sync.WaitGroup
	if sp.heartbeat > 0 {
		beating.Go(func() { lease.beat(beatCtx, sp.heartbeat) })
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			stopBeat()
			beating.Wait()
			lease.mu.Lock()
			lease.stopped = true
			lease.watchdog.Stop()
			lease.mu.Unlock()
		}
	}
	// Settle calls outlive a caller that gave up too: the work ran, so its result is stored (or
	// its claim released) whatever became of the caller.
	settleCtx := context.WithoutCancel(ctx)
	settled := false
	defer func() {
		stop()
		if !settled {
			// The work (or the codec) panicked or called runtime.Goexit: release the key so that a
			// retry starts fresh; the panic goes on once this returns.
			c.giveBack(settleCtx, lease, time.Time{})
		}
	}()

	value, workErr := work(workCtx, lease)
	stop()
	if lost := lease.Err(); lost != nil {
		// The new holder owns the key: neither this result nor this error may be reported as
		// the key's. Nothing is released: the claim is no longer this holder's, or its lease has
		// already run out.
		settled = true
		if workErr != nil && !errors.Is(workErr, context.Canceled) {
			return zero, fmt.Errorf("%w (the work returned: %w)", lost, workErr)
		}
		return zero, lost
	}
	if workErr != nil {
		settled = true
		c.giveBack(settleCtx, lease, time.Time{})
		return zero, workErr
	}
	response, err := codec.Encode(value)
	if err != nil {
		settled = true
		c.giveBack(settleCtx, lease, time.Time{})
		return zero, fmt.Errorf("idempotency: the result cannot be encoded (the key was released): %w", err)
	}
	settled = true
	if err := c.complete(settleCtx, lease, response); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			return zero, err
		}
		return zero, &ResultNotStoredError[T]{Result: value, Err: err}
	}
	return Outcome[T]{Value: value}, nil
}

// claim sends TryStart with one attempt_id for the whole logical attempt, so that a try whose
// answer was lost is recognised when it is sent again (by the retries) and a TryStart after
// in_progress finds this caller's own claim if it had one. It answers Started or Completed, and
// when the winning TryStart was first sent.
//
// It is the one place that waits for a holder: each TryStart asks the coordinator to wait (what is
// left of the caller's limit, at most 60 s) and is given that long on top of the call timeout. A
// coordinator that answers in_progress clearly before the wait it was asked for (it is at its
// waiter limit) is asked again after a short pause, so that a full coordinator is not hammered.
func (c *Client) claim(ctx context.Context, sp *spec) (Claim, time.Time, error) {
	const op = "TryStart"
	start := StartRequest{
		Namespace: sp.namespace, Key: sp.key, Fingerprint: sp.fingerprint,
		LeaseTTL: sp.lease, Retention: sp.retention, AttemptID: newAttemptID(),
	}
	waitUntil := time.Now().Add(sp.wait)
	polls := backoff{step: 50 * time.Millisecond, p: RetryPolicy{InitialBackoff: 50 * time.Millisecond, MaxBackoff: time.Second, Multiplier: 1.5}}
	for {
		askedAt := time.Now()
		askedWait := serverWait(waitUntil)
		var claim Claim
		err := c.call(ctx, op, retryTransient, func() (time.Duration, func(context.Context) error) {
			// Recomputed for every try, so that a retry never waits past the limit.
			r := start
			r.Wait = serverWait(waitUntil)
			req := r.message()
			return r.Wait, func(ctx context.Context) error {
				answer, err := c.rpc.TryStart(ctx, req)
				if err == nil {
					claim = readClaim(answer)
				}
				return err
			}
		})
		if err != nil {
			return Claim{}, time.Time{}, err
		}
		switch claim.Outcome {
		case Started, Completed:
			return claim, askedAt, nil
		case FingerprintMismatch:
			return Claim{}, time.Time{}, ErrMismatch
		case InProgress:
		default:
			return Claim{}, time.Time{}, &Error{Op: op, Code: codes.Unknown, Message: "TryStart answered an outcome this client does not know"}
		}
		remaining := time.Until(waitUntil)
		if remaining < waitSlack {
			return Claim{}, time.Time{}, &InProgressError{
				LeaseExpiresAt: claim.LeaseExpiresAt,
				Attempt:        claim.Attempt,
				RetryAfter:     max(0, time.Until(claim.LeaseExpiresAt)),
			}
		}
		if time.Since(askedAt) < askedWait/2 {
			// The coordinator did not wait (it is at its waiter limit): pause before asking again.
			timer := time.NewTimer(min(polls.next(), remaining))
			select {
			case <-timer.C:
			case <-ctx.Done():
				timer.Stop()
				return Claim{}, time.Time{}, gaveUp(ctx, op, "while waiting for another holder")
			}
		}
	}
}

// waitSlack: what is left of the caller's limit when a waiting TryStart comes back that is too
// little to ask again for; the coordinator waited until about the limit.
const waitSlack = 20 * time.Millisecond

// serverWait is what a TryStart sent now asks the coordinator to wait: what is left of the
// caller's limit, at most 60 s, in whole milliseconds.
func serverWait(waitUntil time.Time) time.Duration {
	left := time.Until(waitUntil).Truncate(time.Millisecond)
	return max(0, min(MaxServerWait, left))
}

// renewAfterWait renews, before the work starts, a claim whose TryStart took long (it waited for
// another holder; answeredAt is when it was answered): one ExtendLease with the same lease,
// retried like any other until it succeeds or the lease counted from the TryStart's sending (or
// the retry budget) runs out; the lease is then counted from the renewal's sending. A renewal
// refused LEASE_LOST or KEY_NOT_FOUND is a lost lease; one that cannot get through is returned
// as it is, after the claim is released (best effort) so that a retry need not wait for the
// lease to run out. Either way the work does not run.
func (l *Lease) renewAfterWait(ctx context.Context, answeredAt time.Time) error {
	c := l.client
	expiresAt, sentAt, err := c.extend(ctx, ExtendRequest{
		Namespace: l.Namespace, Key: l.Key, Token: l.Token, LeaseTTL: l.leaseTTL,
	}, retryTransient, l.runsOutAt)
	switch {
	case err == nil:
		l.expiresAt, l.runsOutAt = expiresAt, sentAt.Add(l.leaseTTL)
		return nil
	case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrKeyNotFound), errors.Is(err, ErrAlreadyCompleted):
		c.log.Warn("idempotency: the lease was lost before the work started", "namespace", l.Namespace, "cause", err)
		l.lost = &leaseLost{why: err}
		return l.lost
	}
	// The claim cannot outlive the lease counted from the TryStart's answer (the coordinator
	// granted it before answering), so the release is not retried past that.
	c.giveBack(context.WithoutCancel(ctx), l, answeredAt.Add(l.leaseTTL))
	return err
}

// giveBack releases the claim so that a retry starts fresh, retried within the budget and not
// after until (zero: the budget alone). Failing to is not the caller's error: the claim frees
// itself when its lease runs out; so it is logged, not returned.
func (c *Client) giveBack(ctx context.Context, l *Lease, until time.Time) {
	err := c.release(ctx, l.Namespace, l.Key, l.Token, until)
	switch {
	case err == nil, errors.Is(err, ErrKeyNotFound):
		// Already absent: an earlier try of this Release worked, or the key expired.
	case errors.Is(err, ErrLeaseLost):
		l.lose(err)
	default:
		c.log.Warn("idempotency: could not release a claim; it frees when its lease runs out", "namespace", l.Namespace, "error", err)
	}
}

// complete stores the result. A Complete that finds this very result already stored (an earlier
// try whose answer was lost) counts as success.
func (c *Client) complete(ctx context.Context, l *Lease, response []byte) error {
	_, err := c.Complete(ctx, CompleteRequest{Namespace: l.Namespace, Key: l.Key, Token: l.Token, Response: response})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrLeaseLost), errors.Is(err, ErrKeyNotFound):
		return &leaseLost{why: err}
	case errors.Is(err, ErrAlreadyCompleted):
		state, lookupErr := c.Lookup(ctx, l.Namespace, l.Key)
		if lookupErr != nil {
			return lookupErr
		}
		if state.Status == KeyCompleted && bytes.Equal(state.Response, response) {
			return nil
		}
	}
	return err
}

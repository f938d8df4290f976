package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The defaults every client must use (clients/conformance/defaults.json).
func TestDefaultsMatchTheConformanceVectors(t *testing.T) {
	raw := readConformance(t, "defaults.json")
	var want struct {
		CallTimeoutMs int64 `json:"call_timeout_ms"`
		Retry         struct {
			BudgetMs          int64   `json:"budget_ms"`
			InitialBackoffMs  int64   `json:"initial_backoff_ms"`
			MaxBackoffMs      int64   `json:"max_backoff_ms"`
			Multiplier        float64 `json:"multiplier"`
			JitterLowFraction float64 `json:"jitter_low_fraction"`
		} `json:"retry"`
		LeaseTTLMs       int64 `json:"lease_ttl_ms"`
		HeartbeatDivisor int   `json:"heartbeat_divisor"`
		WaitMs           int64 `json:"wait_ms"`
	}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.DisallowUnknownFields() // a new default must be added here too
	if err := dec.Decode(&want); err != nil {
		t.Fatal(err)
	}
	ms := func(n int64) time.Duration { return time.Duration(n) * time.Millisecond }
	s, err := build(nil)
	if err != nil {
		t.Fatal(err)
	}
	policy := DefaultRetryPolicy()
	checks := []struct {
		name      string
		got, want any
	}{
		{"call timeout", s.callTimeout, ms(want.CallTimeoutMs)},
		{"retry budget", policy.Budget, ms(want.Retry.BudgetMs)},
		{"initial backoff", policy.InitialBackoff, ms(want.Retry.InitialBackoffMs)},
		{"max backoff", policy.MaxBackoff, ms(want.Retry.MaxBackoffMs)},
		{"multiplier", policy.Multiplier, want.Retry.Multiplier},
		{"jitter low fraction", jitterLowFraction, want.Retry.JitterLowFraction},
		{"lease", s.leaseTTL, ms(want.LeaseTTLMs)},
		{"heartbeat divisor", HeartbeatDivisor, want.HeartbeatDivisor},
		{"wait", s.wait, ms(want.WaitMs)},
		{"client retry policy", s.retry, policy},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s: the client has %v, defaults.json %v", c.name, c.got, c.want)
		}
	}
}

func TestBackoffGrowsWithinItsJitter(t *testing.T) {
	b := backoff{step: 50 * time.Millisecond, p: DefaultRetryPolicy()}
	step := 50 * time.Millisecond
	for range 10 {
		pause := b.next()
		if pause < step/2 || pause > step {
			t.Fatalf("pause %v outside [%v, %v]", pause, step/2, step)
		}
		step = min(2*time.Second, 2*step)
	}
}

func TestTransientFailuresAreRetriedWithTheSameAttemptID(t *testing.T) {
	f := &fake{failures: []error{
		status.Error(codes.Unavailable, "connection refused"),
		rich(codes.Unavailable, ReasonStoreUnavailable, 0),
		status.Error(codes.DeadlineExceeded, "slow"),
		rich(codes.ResourceExhausted, ReasonRateLimited, 0),
		rich(codes.ResourceExhausted, ReasonOverloaded, 0),
	}}
	c := startFake(t, f)
	claim, err := c.TryStart(context.Background(), StartRequest{Namespace: "ns", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if claim.Outcome != Started || claim.Token != 7 {
		t.Fatalf("claim %+v", claim)
	}
	if len(f.tryStarts) != 6 {
		t.Fatalf("%d tries, want 6", len(f.tryStarts))
	}
	for _, r := range f.tryStarts {
		if r.GetAttemptId() == "" || r.GetAttemptId() != claim.AttemptID {
			t.Fatalf("attempt ids differ: %q vs %q", r.GetAttemptId(), claim.AttemptID)
		}
	}
}

func TestARetryInfoLengthensThePause(t *testing.T) {
	f := &fake{failures: []error{rich(codes.ResourceExhausted, ReasonRateLimited, 300*time.Millisecond)}}
	c := startFake(t, f)
	start := time.Now()
	if _, err := c.Lookup(context.Background(), "ns", "k"); err != nil {
		t.Fatal(err)
	}
	if elapsed := time.Since(start); elapsed < 300*time.Millisecond {
		t.Fatalf("retried after %v, before the RetryInfo's 300ms", elapsed)
	}
}

func TestRetriesStopAtTheBudget(t *testing.T) {
	f := &fake{failures: []error{errFakeForever}}
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{InitialBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Multiplier: 2, Budget: 300 * time.Millisecond}))
	start := time.Now()
	err := c.Release(context.Background(), "ns", "k", 1)
	elapsed := time.Since(start)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("got %v", err)
	}
	if elapsed > time.Second || f.callCount() < 3 {
		t.Fatalf("%d tries in %v", f.callCount(), elapsed)
	}
	noRetry := &fake{failures: []error{errFakeForever}}
	c = startFake(t, noRetry, WithRetryBudget(0))
	if err := c.Release(context.Background(), "ns", "k", 1); !errors.Is(err, ErrUnavailable) || noRetry.callCount() != 1 {
		t.Fatalf("budget 0: %v after %d tries", err, noRetry.callCount())
	}
}

// MarkProcessed is sent again only when it was refused before it ran: after a lost answer a
// retry would report the events as already processed.
func TestMarkProcessedIsRetriedOnlyWhenRefusedAtTheDoor(t *testing.T) {
	for _, tc := range []struct {
		failure error
		retried bool
	}{
		{rich(codes.ResourceExhausted, ReasonRateLimited, 0), true},
		{rich(codes.ResourceExhausted, ReasonOverloaded, 0), true},
		{status.Error(codes.Unavailable, "connection reset"), false},
		{rich(codes.Unavailable, ReasonStoreUnavailable, 0), false},
		{status.Error(codes.DeadlineExceeded, "slow"), false},
	} {
		f := &fake{failures: []error{tc.failure}}
		c := startFake(t, f)
		fresh, err := c.MarkProcessed(context.Background(), "billing", []string{"e1"})
		if tc.retried && (err != nil || len(fresh) != 1 || f.marks != 2) {
			t.Errorf("%v: %v, %v after %d calls; want a retry", tc.failure, fresh, err, f.marks)
		}
		if !tc.retried && (err == nil || f.marks != 1) {
			t.Errorf("%v: %v after %d calls; want no retry", tc.failure, err, f.marks)
		}
	}
}

func TestErrorsMatchTheirSentinelAndKeepTheStatus(t *testing.T) {
	for _, tc := range []struct {
		failure error
		want    error
	}{
		{rich(codes.InvalidArgument, ReasonInvalidArgument, 0, "key", "lease_ttl"), ErrInvalidArgument},
		{rich(codes.Aborted, ReasonLeaseLost, 0), ErrLeaseLost},
		{rich(codes.NotFound, ReasonKeyNotFound, 0), ErrKeyNotFound},
		{rich(codes.FailedPrecondition, ReasonAlreadyCompleted, 0), ErrAlreadyCompleted},
		{rich(codes.Unavailable, ReasonStoreUnavailable, time.Second), ErrStoreUnavailable},
		{rich(codes.Unavailable, ReasonStoreUnavailable, time.Second), ErrUnavailable},
		{rich(codes.Unauthenticated, ReasonUnauthenticated, 0), ErrUnauthenticated},
		{rich(codes.PermissionDenied, ReasonPermissionDenied, 0), ErrPermissionDenied},
		{rich(codes.ResourceExhausted, ReasonRateLimited, time.Second), ErrRateLimited},
		{rich(codes.ResourceExhausted, ReasonOverloaded, time.Second), ErrOverloaded},
		{rich(codes.Internal, ReasonInternal, 0), ErrInternal},
		{status.Error(codes.Unavailable, "no reason"), ErrUnavailable},
		{status.Error(codes.DeadlineExceeded, "no reason"), ErrDeadline},
		{status.Error(codes.Aborted, "no reason"), ErrLeaseLost},
	} {
		f := &fake{failures: []error{tc.failure}}
		c := startFake(t, f, WithRetryBudget(0))
		_, err := c.Lookup(context.Background(), "ns", "k")
		if !errors.Is(err, tc.want) {
			t.Errorf("%v: got %v, want %v", tc.failure, err, tc.want)
			continue
		}
		var e *Error
		if !errors.As(err, &e) || e.Op != "Lookup" {
			t.Errorf("%v: no *Error", err)
			continue
		}
		want := status.Convert(tc.failure)
		got, ok := status.FromError(err)
		if !ok || got.Code() != want.Code() || len(got.Details()) != len(want.Details()) || e.Code != want.Code() {
			t.Errorf("%v: the status was not kept: %v", err, got)
		}
		if tc.want == ErrRateLimited && e.RetryDelay != time.Second {
			t.Errorf("RetryInfo not read: %v", e.RetryDelay)
		}
		if tc.want == ErrInvalidArgument && strings.Join(e.Fields(), ",") != "key,lease_ttl" {
			t.Errorf("fields %v", e.Fields())
		}
	}
	// Without a reason, RESOURCE_EXHAUSTED is grpc-go's own "message too large": no sentinel, no
	// retry.
	f := &fake{failures: []error{status.Error(codes.ResourceExhausted, "grpc: received message larger than max")}}
	c := startFake(t, f)
	if _, err := c.Lookup(context.Background(), "ns", "k"); err == nil || errors.Is(err, ErrRateLimited) || f.callCount() != 1 {
		t.Errorf("a reasonless RESOURCE_EXHAUSTED: %v after %d calls", err, f.callCount())
	}
}

func TestACallerThatGivesUpIsNotRetried(t *testing.T) {
	f := &fake{failures: []error{errFakeForever}}
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{InitialBackoff: 100 * time.Millisecond, MaxBackoff: time.Second, Multiplier: 2, Budget: time.Minute}))
	ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Lookup(ctx, "ns", "k")
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Fatalf("got %v after %v", err, time.Since(start))
	}
}

func TestAWaitingTryStartGetsTheWaitOnTopOfTheCallTimeout(t *testing.T) {
	f := &fake{}
	c := startFake(t, f, WithCallTimeout(2*time.Second))
	if _, err := c.TryStart(context.Background(), StartRequest{Namespace: "ns", Key: "k", Wait: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	if got := f.tryStarts[0].GetWait().AsDuration(); got != 5*time.Second {
		t.Fatalf("wait sent: %v", got)
	}
	if d := f.deadlines[0]; d < 6*time.Second || d > 7*time.Second {
		t.Fatalf("deadline %v, want about 7s", d)
	}
}

// Every bound the client checks refuses bad input at once, naming the field, and sends nothing.
func TestBadInputIsRefusedBeforeAnythingIsSent(t *testing.T) {
	f := &fake{}
	c := startFake(t, f)
	ctx := context.Background()
	long := strings.Repeat("k", 256)
	work := func(context.Context, *Lease) (int, error) { t.Fatal("the work ran"); return 0, nil }
	run := func(ns, key string, request any, opts ...RunOption) error {
		_, err := RunOnce(ctx, c, ns, key, request, work, opts...)
		return err
	}
	cases := []struct {
		name  string
		field string
		err   error
	}{
		{"empty namespace", "namespace", run("", "k", nil)},
		{"long namespace", "namespace", run(strings.Repeat("n", 65), "k", nil)},
		{"namespace charset", "namespace", run("pay ments", "k", nil)},
		{"empty key", "key", run("ns", "", nil)},
		{"long key", "key", run("ns", long, nil)},
		{"key with a control character", "key", run("ns", "a\nb", nil)},
		{"key with a C1 control character", "key", run("ns", "a\u0085b", nil)},
		{"key not UTF-8", "key", run("ns", "a\xffb", nil)},
		{"lease too short", "lease_ttl", run("ns", "k", nil, WithLease(99*time.Millisecond))},
		{"lease too long", "lease_ttl", run("ns", "k", nil, WithLease(24*time.Hour+time.Nanosecond))},
		{"retention too short", "retention", run("ns", "k", nil, WithRetention(999*time.Millisecond))},
		{"retention too long", "retention", run("ns", "k", nil, WithRetention(30*24*time.Hour+time.Second))},
		{"negative wait", "wait", run("ns", "k", nil, WithWait(-time.Second))},
		{"negative heartbeat", "heartbeat", run("ns", "k", nil, WithHeartbeat(-time.Second))},
		{"long fingerprint", "fingerprint", run("ns", "k", nil, WithFingerprint(make([]byte, 65)))},
		{"request not JSON", "request", run("ns", "k", func() {})},
		{"codec of another type", "codec", run("ns", "k", nil, WithCodec[string](JSONCodec[string]{}))},
		{"nil work", "work", func() error { _, err := RunOnce[int](ctx, c, "ns", "k", nil, nil); return err }()},
		{"process once: bad consumer", "consumer", func() error {
			_, err := ProcessOnce(ctx, c, "bad consumer", "e", nil, work)
			return err
		}()},
		{"try start: long attempt id", "attempt_id", func() error {
			_, err := c.TryStart(ctx, StartRequest{Namespace: "ns", Key: "k", AttemptID: strings.Repeat("a", 129)})
			return err
		}()},
		{"try start: wait over 60s", "wait", func() error {
			_, err := c.TryStart(ctx, StartRequest{Namespace: "ns", Key: "k", Wait: 61 * time.Second})
			return err
		}()},
		{"complete: no token", "lease_token", func() error {
			_, err := c.Complete(ctx, CompleteRequest{Namespace: "ns", Key: "k"})
			return err
		}()},
		{"release: token over 2^63-1", "lease_token", c.Release(ctx, "ns", "k", 1<<63)},
		{"extend: checkpoint over 64 KiB", "checkpoint", func() error {
			_, err := c.ExtendLease(ctx, ExtendRequest{Namespace: "ns", Key: "k", Token: 1, Checkpoint: make([]byte, 64<<10+1)})
			return err
		}()},
		{"extend: lease too short", "lease_ttl", func() error {
			_, err := c.ExtendLease(ctx, ExtendRequest{Namespace: "ns", Key: "k", Token: 1, LeaseTTL: time.Millisecond})
			return err
		}()},
		{"lookup: empty key", "key", func() error { _, err := c.Lookup(ctx, "ns", ""); return err }()},
		{"mark: no ids", "event_ids", func() error { _, err := c.MarkProcessed(ctx, "billing", nil); return err }()},
		{"mark: 1001 ids", "event_ids", func() error {
			_, err := c.MarkProcessed(ctx, "billing", make([]string, 1001))
			return err
		}()},
		{"mark: an empty id", "event_ids[1]", func() error {
			_, err := c.MarkProcessed(ctx, "billing", []string{"a", ""})
			return err
		}()},
		{"mark: retention too long", "retention", func() error {
			_, err := c.MarkProcessed(ctx, "billing", []string{"a"}, WithEventRetention(31*24*time.Hour))
			return err
		}()},
	}
	for _, tc := range cases {
		var e *Error
		if !errors.Is(tc.err, ErrInvalidArgument) || !errors.As(tc.err, &e) || strings.Join(e.Fields(), ",") != tc.field {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT on %s", tc.name, tc.err, tc.field)
			continue
		}
		if st, ok := status.FromError(tc.err); !ok || st.Code() != codes.InvalidArgument {
			t.Errorf("%s: status %v", tc.name, st)
		}
	}
	if n := f.callCount(); n != 0 {
		t.Fatalf("%d calls reached the coordinator", n)
	}
	// The bounds themselves are accepted.
	for _, opts := range [][]RunOption{{WithLease(MinLease)}, {WithLease(MaxLease), WithRetention(MaxRetention)}, {WithRetention(MinRetention)}} {
		if _, err := RunOnce(ctx, c, "ns", strings.Repeat("k", 255), nil, func(context.Context, *Lease) (int, error) { return 1, nil }, opts...); errors.Is(err, ErrInvalidArgument) {
			t.Errorf("a bound was refused: %v", err)
		}
	}
}

func TestBadOptionsAreRefused(t *testing.T) {
	for name, opt := range map[string]Option{
		"zero call timeout":     WithCallTimeout(0),
		"negative retry budget": WithRetryBudget(-time.Second),
		"lease below bounds":    WithDefaultLease(time.Millisecond),
		"negative wait":         WithDefaultWait(-time.Second),
		"token not ASCII":       WithToken("tök"),
		"empty token":           WithToken(""),
		"multiplier below 1":    WithRetryPolicy(RetryPolicy{InitialBackoff: time.Millisecond, MaxBackoff: time.Second, Multiplier: 0.5, Budget: time.Second}),
		"max below initial":     WithRetryPolicy(RetryPolicy{InitialBackoff: time.Second, MaxBackoff: time.Millisecond, Multiplier: 2, Budget: time.Second}),
		"nil logger":            WithLogger(nil),
	} {
		if _, err := New("127.0.0.1:1", opt); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := New("127.0.0.1:1", WithRootCAsPEM([]byte("not PEM"))); err == nil {
		t.Error("a CA that is not PEM was accepted")
	}
	if _, err := NewFromConn(nil); err == nil {
		t.Error("a nil connection was accepted")
	}
	c, err := New("127.0.0.1:1")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := NewFromConn(c.owned, WithTLS(nil)); err == nil {
		t.Error("TLS options were accepted with a connection")
	}
}

package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// RunOnce and ProcessOnce against a real coordinator, the path where nothing fails: the work runs
// once for concurrent callers of one key, a completed key is replayed and another request under
// it is a mismatch, a duplicate event is skipped, and a caller that finds the key held elsewhere
// waits, then gets in_progress, or one error when its own context ends.

func TestTwoConcurrentRunsOfOneKeyRunTheWorkOnce(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		var runs atomic.Int32
		work := func(ctx context.Context, lease *idempotency.Lease) (charge, error) {
			n := runs.Add(1)
			time.Sleep(300 * time.Millisecond)
			return charge{ID: "ch_" + string(rune('0'+n)), Amount: 1250}, nil
		}
		var wg sync.WaitGroup
		outcomes := make([]idempotency.Outcome[charge], 2)
		errs := make([]error, 2)
		for i := range 2 {
			// Two services, each with a client of its own.
			c := testenv.NewClient(t, coordinator.Addr)
			wg.Go(func() {
				outcomes[i], errs[i] = idempotency.RunOnce(context.Background(), c, "payments", "order-42", order{"o-42", 1250}, work,
					idempotency.WithWait(10*time.Second))
			})
		}
		wg.Wait()
		for i := range 2 {
			if errs[i] != nil {
				t.Fatalf("run %d: %v", i, errs[i])
			}
		}
		if runs.Load() != 1 {
			t.Fatalf("the work ran %d times", runs.Load())
		}
		if outcomes[0].Value != outcomes[1].Value || outcomes[0].Value.ID != "ch_1" {
			t.Fatalf("different results: %+v %+v", outcomes[0], outcomes[1])
		}
		if outcomes[0].Replayed == outcomes[1].Replayed {
			t.Fatalf("exactly one must be replayed: %+v %+v", outcomes[0], outcomes[1])
		}
	})
}

func TestACompletedKeyIsReplayedAndAnotherRequestIsAMismatch(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
		ctx := context.Background()
		runs := 0
		work := func(context.Context, *idempotency.Lease) (charge, error) { runs++; return charge{"ch_1", 1250}, nil }
		first, err := idempotency.RunOnce(ctx, c, "payments", "k", order{"o-1", 1250}, work)
		if err != nil || first.Replayed {
			t.Fatalf("%+v, %v", first, err)
		}
		// The same request with its fields in another order, from a map: the same fingerprint.
		again, err := idempotency.RunOnce(ctx, c, "payments", "k", map[string]any{"amount": 1250, "order": "o-1"}, work)
		if err != nil || !again.Replayed || again.Value != first.Value || runs != 1 {
			t.Fatalf("%+v, %v after %d runs", again, err, runs)
		}
		_, err = idempotency.RunOnce(ctx, c, "payments", "k", order{"o-1", 9999}, work)
		if !errors.Is(err, idempotency.ErrMismatch) || runs != 1 {
			t.Fatalf("another request: %v after %d runs", err, runs)
		}
		if state := lookup(t, c, "payments", "k"); state.Status != idempotency.KeyCompleted || string(state.Response) != `{"id":"ch_1","amount":1250}` {
			t.Fatalf("stored %v %s", state.Status, state.Response)
		}
	})
}

func TestAKeyHeldElsewhereIsInProgressAfterTheWait(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
		ctx := context.Background()
		release := make(chan struct{})
		started := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			_, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (int, error) {
				close(started)
				<-release
				return 1, nil
			}, idempotency.WithLease(10*time.Second))
			done <- err
		}()
		<-started
		for _, wait := range []time.Duration{0, 300 * time.Millisecond} {
			begin := time.Now()
			_, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (int, error) {
				t.Error("the work ran while the key was held")
				return 0, nil
			}, idempotency.WithWait(wait))
			var busy *idempotency.InProgressError
			if !errors.Is(err, idempotency.ErrInProgress) || !errors.As(err, &busy) {
				t.Fatalf("wait %v: %v", wait, err)
			}
			if busy.Attempt != 1 || busy.RetryAfter <= 0 || busy.RetryAfter > 10*time.Second {
				t.Fatalf("wait %v: %+v", wait, busy)
			}
			if elapsed := time.Since(begin); elapsed < wait || elapsed > wait+2*time.Second {
				t.Fatalf("wait %v answered after %v", wait, elapsed)
			}
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}

func TestConsumersDeduplicateEvents(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
		ctx := context.Background()
		fresh, err := c.MarkProcessed(ctx, "billing", []string{"e1", "e2", "e1"})
		if err != nil || len(fresh) != 2 || fresh[0] != "e1" || fresh[1] != "e2" {
			t.Fatalf("%v, %v", fresh, err)
		}
		fresh, err = c.MarkProcessed(ctx, "billing", []string{"e2", "e3"}, idempotency.WithEventRetention(time.Hour))
		if err != nil || len(fresh) != 1 || fresh[0] != "e3" {
			t.Fatalf("%v, %v", fresh, err)
		}
		sent := 0
		for range 2 {
			out, err := idempotency.ProcessOnce(ctx, c, "mailer", "evt-1", map[string]string{"to": "a@example.com"},
				func(context.Context, *idempotency.Lease) (string, error) { sent++; return "msg-1", nil })
			if err != nil || out.Value != "msg-1" {
				t.Fatalf("%+v, %v", out, err)
			}
		}
		if sent != 1 {
			t.Fatalf("the effect happened %d times", sent)
		}
	})
}

// The caller's own deadline passes while RunOnce waits: whether the coordinator held the TryStart
// (it ends the wait as the call's deadline comes, so the deadline may pass during the call or
// just after its in_progress), answered at once (at its waiter limit) so that RunOnce paused
// between TryStarts, or a retry's pause was under way, the error is the same: an *Error with
// DEADLINE_EXCEEDED that errors.Is matches with context.DeadlineExceeded and ErrDeadline (and a
// cancelled context likewise, with CANCELLED and context.Canceled).
func TestACallerWhoseContextEndsDuringAWaitGetsOneError(t *testing.T) {
	holding := testenv.Start(t, testenv.SQLite)
	noWaiters := testenv.Start(t, testenv.SQLite, "--max-waiters", "0")
	unreachable := testenv.StartFaultProxy(t, holding.Addr)
	if err := unreachable.AddFault(json.RawMessage(`{"method":"TryStart","action":"status","code":"UNAVAILABLE","retry_delay_ms":5000,"times":-1}`)); err != nil {
		t.Fatal(err)
	}
	for _, coordinator := range []*testenv.Coordinator{holding, noWaiters} {
		holder := testenv.NewClient(t, coordinator.Addr)
		claim, err := holder.TryStart(context.Background(), idempotency.StartRequest{Namespace: "payments", Key: "held", LeaseTTL: time.Minute})
		if err != nil || claim.Outcome != idempotency.Started {
			t.Fatalf("%+v, %v", claim, err)
		}
	}
	for _, tc := range []struct {
		name     string
		addr     string
		cancel   bool
		wantCode codes.Code
		want     error
	}{
		{"the coordinator holds the TryStart", holding.Addr, false, codes.DeadlineExceeded, context.DeadlineExceeded},
		{"cancelled while the coordinator holds the TryStart", holding.Addr, true, codes.Canceled, context.Canceled},
		{"the coordinator at its waiter limit", noWaiters.Addr, false, codes.DeadlineExceeded, context.DeadlineExceeded},
		{"during a pause before a retry", unreachable.Addr, false, codes.DeadlineExceeded, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := testenv.NewClient(t, tc.addr)
			ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
			if tc.cancel {
				ctx, cancel = context.WithCancel(context.Background())
				timer := time.AfterFunc(400*time.Millisecond, cancel)
				defer timer.Stop()
			}
			defer cancel()
			begin := time.Now()
			_, err := idempotency.RunOnce(ctx, c, "payments", "held", nil, func(context.Context, *idempotency.Lease) (int, error) {
				t.Error("the work ran while the key was held")
				return 0, nil
			}, idempotency.WithWait(10*time.Second))
			if elapsed := time.Since(begin); elapsed > 3*time.Second {
				t.Errorf("RunOnce returned %v after the caller gave up at 400ms", elapsed)
			}
			var e *idempotency.Error
			if !errors.As(err, &e) || e.Code != tc.wantCode || status.Code(err) != tc.wantCode || !errors.Is(err, tc.want) {
				t.Fatalf("got %T %v, want an *Error with %v that matches %v", err, err, tc.wantCode, tc.want)
			}
			if errors.Is(err, idempotency.ErrDeadline) != (tc.want == context.DeadlineExceeded) || errors.Is(err, idempotency.ErrInProgress) ||
				errors.Is(err, idempotency.ErrUnavailable) {
				t.Fatalf("%v matches another sentinel", err)
			}
		})
	}
}

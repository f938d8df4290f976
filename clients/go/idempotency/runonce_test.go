package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

type charge struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

type order struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

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
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
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
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
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

type declined struct{ reason string }

func (d *declined) Error() string { return "declined: " + d.reason }

func TestAFailedWorkReleasesTheKeyAndItsErrorIsReturned(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		ctx := context.Background()
		_, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (int, error) {
			return 0, &declined{"insufficient funds"}
		})
		var d *declined
		if !errors.As(err, &d) || d.reason != "insufficient funds" {
			t.Fatalf("got %v", err)
		}
		if state := lookup(t, c, "payments", "k"); state.Status != idempotency.KeyAbsent {
			t.Fatalf("the key is %v after a failure", state.Status)
		}
		// A retry starts fresh.
		out, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(_ context.Context, l *idempotency.Lease) (int, error) {
			if l.Attempt != 1 {
				t.Errorf("attempt %d after a release", l.Attempt)
			}
			return 2, nil
		})
		if err != nil || out.Value != 2 || out.Replayed {
			t.Fatalf("%+v, %v", out, err)
		}
	})
}

func TestAPanickingWorkReleasesTheKeyAndPanicsOn(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		recovered := func() (r any) {
			defer func() { r = recover() }()
			_, _ = idempotency.RunOnce(context.Background(), c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (int, error) {
				panic("boom")
			})
			return nil
		}()
		if recovered != "boom" {
			t.Fatalf("recovered %v", recovered)
		}
		if state := lookup(t, c, "payments", "k"); state.Status != idempotency.KeyAbsent {
			t.Fatalf("the key is %v after a panic", state.Status)
		}
	})
}

// The heartbeat finds the key taken over (here: released with the holder's token by someone
// else, then claimed by a new holder): the work's context is cancelled at once, and RunOnce
// reports the lease lost rather than any result.
func TestALostLeaseCancelsTheWork(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		other := testenv.NewClient(t, coordinator.Addr)
		ctx := context.Background()
		cause := make(chan error, 1)
		_, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(ctx context.Context, lease *idempotency.Lease) (int, error) {
			if err := other.Release(ctx, lease.Namespace, lease.Key, lease.Token); err != nil {
				t.Error(err)
			}
			claim, err := other.TryStart(ctx, idempotency.StartRequest{Namespace: "payments", Key: "k", LeaseTTL: 10 * time.Second})
			if err != nil || claim.Outcome != idempotency.Started || claim.Token <= lease.Token {
				t.Errorf("the other claim: %+v, %v", claim, err)
			}
			select {
			case <-ctx.Done():
				cause <- context.Cause(ctx)
				return 0, ctx.Err()
			case <-time.After(5 * time.Second):
				return 1, nil
			}
		}, idempotency.WithLease(600*time.Millisecond))
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Fatalf("RunOnce: %v", err)
		}
		if why := <-cause; !errors.Is(why, idempotency.ErrLeaseLost) {
			t.Fatalf("the work's context cause: %v", why)
		}
		if state := lookup(t, c, "payments", "k"); state.Status != idempotency.KeyInProgress {
			t.Fatalf("the new holder's claim is %v", state.Status)
		}
	})
}

// The coordinator cannot be reached for a whole lease: the work's context is cancelled when the
// lease may have run out (another caller may take the key over), not later.
func TestALeaseThatRanOutWhileUnreachableCancelsTheWork(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		proxy := testenv.StartFaultProxy(t, coordinator.Addr)
		c := testenv.NewClient(t, proxy.Addr, idempotency.WithRetryBudget(500*time.Millisecond))
		var claimedAt time.Time
		var cancelledAfter time.Duration
		var cause error
		_, err := idempotency.RunOnce(context.Background(), c, "payments", "k", nil, func(ctx context.Context, lease *idempotency.Lease) (int, error) {
			claimedAt = time.Now()
			if err := proxy.Refuse(); err != nil {
				return 0, err
			}
			<-ctx.Done()
			cancelledAfter = time.Since(claimedAt)
			cause = context.Cause(ctx)
			return 0, ctx.Err()
		}, idempotency.WithLease(time.Second))
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Fatalf("RunOnce: %v", err)
		}
		if !errors.Is(cause, idempotency.ErrLeaseLost) || !errors.Is(cause, idempotency.ErrUnavailable) {
			t.Fatalf("cause: %v", cause)
		}
		if cancelledAfter > 1300*time.Millisecond {
			t.Fatalf("cancelled %v after the claim, past the 1s lease", cancelledAfter)
		}
	})
}

// SIGKILL while the work runs, and a restart: the heartbeat misses a beat, the Complete is
// retried until the coordinator is back, and the work has run once.
func TestTheCoordinatorKilledMidWorkAndRestarted(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		ctx := context.Background()
		var runs atomic.Int32
		restarted := make(chan error, 1)
		out, err := idempotency.RunOnce(ctx, c, "payments", "k", order{"o-1", 5}, func(ctx context.Context, _ *idempotency.Lease) (charge, error) {
			runs.Add(1)
			coordinator.Kill()
			go func() {
				time.Sleep(700 * time.Millisecond)
				restarted <- coordinator.Restart()
			}()
			time.Sleep(300 * time.Millisecond) // the work ends while the coordinator is down
			return charge{"ch_9", 5}, nil
		}, idempotency.WithLease(5*time.Second))
		if rerr := <-restarted; rerr != nil {
			t.Fatal(rerr)
		}
		if err != nil || out.Value.ID != "ch_9" {
			t.Fatalf("%+v, %v", out, err)
		}
		again, err := idempotency.RunOnce(ctx, c, "payments", "k", order{"o-1", 5}, func(context.Context, *idempotency.Lease) (charge, error) {
			runs.Add(1)
			return charge{}, nil
		})
		if err != nil || !again.Replayed || again.Value.ID != "ch_9" || runs.Load() != 1 {
			t.Fatalf("%+v, %v after %d runs", again, err, runs.Load())
		}
	})
}

// Complete cannot reach the coordinator within the retry budget: the result is returned in a
// ResultNotStoredError, so the caller can tell that only the result was lost.
func TestAResultThatCouldNotBeStoredIsReturnedWithTheError(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		proxy := testenv.StartFaultProxy(t, coordinator.Addr)
		c := testenv.NewClient(t, proxy.Addr, idempotency.WithRetryBudget(400*time.Millisecond))
		_, err := idempotency.RunOnce(context.Background(), c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (charge, error) {
			if err := proxy.Refuse(); err != nil {
				return charge{}, err
			}
			return charge{"ch_7", 1}, nil
		})
		var notStored *idempotency.ResultNotStoredError[charge]
		if !errors.Is(err, idempotency.ErrResultNotStored) || !errors.As(err, &notStored) || !errors.Is(err, idempotency.ErrUnavailable) {
			t.Fatalf("got %v", err)
		}
		if notStored.Result.ID != "ch_7" {
			t.Fatalf("result %+v", notStored.Result)
		}
		direct := testenv.NewClient(t, coordinator.Addr)
		if state := lookup(t, direct, "payments", "k"); state.Status != idempotency.KeyInProgress {
			t.Fatalf("the claim is %v; it should stay until its lease runs out", state.Status)
		}
	})
}

// The TryStart reaches the coordinator but its answer is lost: the client's retry, with the same
// attempt_id, gets the same claim back instead of in_progress.
func TestATryStartWhoseAnswerWasLostGetsItsClaimBack(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		proxy := testenv.StartFaultProxy(t, coordinator.Addr)
		c := testenv.NewClient(t, proxy.Addr, idempotency.WithCallTimeout(3*time.Second))
		// The proxy lets the first TryStart reach the coordinator and answers UNAVAILABLE, as a
		// connection lost after the request went out.
		if err := proxy.AddFault(json.RawMessage(`{"method":"TryStart","action":"lose_answer","times":1}`)); err != nil {
			t.Fatal(err)
		}
		var attempts []uint32
		out, err := idempotency.RunOnce(context.Background(), c, "payments", "k", nil, func(_ context.Context, l *idempotency.Lease) (int, error) {
			attempts = append(attempts, l.Attempt)
			return 42, nil
		})
		calls, callsErr := proxy.Calls()
		if callsErr != nil || len(calls["TryStart"]) != 2 {
			t.Fatalf("TryStart calls %v, %v: the lost answer was not retried once", calls["TryStart"], callsErr)
		}
		if err != nil || out.Value != 42 || len(attempts) != 1 || attempts[0] != 1 {
			t.Fatalf("%+v, %v, attempts %v", out, err, attempts)
		}
	})
}

// A previous holder's checkpoint is handed to the caller that takes the key over.
func TestTheCheckpointIsHandedToTheNextHolder(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		ctx := context.Background()
		claim, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: "imports", Key: "batch-7", LeaseTTL: 300 * time.Millisecond})
		if err != nil || claim.Outcome != idempotency.Started || claim.Checkpoint != nil {
			t.Fatalf("%+v, %v", claim, err)
		}
		if _, err := c.ExtendLease(ctx, idempotency.ExtendRequest{Namespace: "imports", Key: "batch-7", Token: claim.Token,
			LeaseTTL: 300 * time.Millisecond, Checkpoint: []byte("row 500")}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(400 * time.Millisecond) // the first holder dies; its lease runs out
		out, err := idempotency.RunOnce(ctx, c, "imports", "batch-7", nil, func(ctx context.Context, l *idempotency.Lease) (string, error) {
			if l.Attempt != 2 || string(l.Checkpoint) != "row 500" || l.Token <= claim.Token {
				t.Errorf("lease %+v", l)
			}
			if err := l.SaveCheckpoint(ctx, []byte("row 900")); err != nil {
				t.Error(err)
			}
			return "imported from " + string(l.Checkpoint), nil
		})
		if err != nil || out.Value != "imported from row 500" {
			t.Fatalf("%+v, %v", out, err)
		}
	})
}

func TestConsumersDeduplicateEvents(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
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

// The plain RPCs, and the errors of the contract as the real coordinator answers them.
func TestThePlainCallsAndTheirErrors(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		c := testenv.NewClient(t, coordinator.Addr)
		ctx := context.Background()
		ns, key := "orders", "o-1"
		if state := lookup(t, c, ns, key); state.Status != idempotency.KeyAbsent {
			t.Fatalf("%v", state.Status)
		}
		claim, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp"), AttemptID: "a-1"})
		if err != nil || claim.Outcome != idempotency.Started || claim.Attempt != 1 || claim.AttemptID != "a-1" {
			t.Fatalf("%+v, %v", claim, err)
		}
		// Re-entry with the same attempt_id: the same claim.
		again, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp"), AttemptID: "a-1"})
		if err != nil || again.Outcome != idempotency.Started || again.Token != claim.Token {
			t.Fatalf("re-entry %+v, %v", again, err)
		}
		busy, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp")})
		if err != nil || busy.Outcome != idempotency.InProgress || busy.LeaseExpiresAt.IsZero() {
			t.Fatalf("%+v, %v", busy, err)
		}
		if state := lookup(t, c, ns, key); state.Status != idempotency.KeyInProgress || string(state.Fingerprint) != "fp" {
			t.Fatalf("%+v", state)
		}
		if _, err := c.ExtendLease(ctx, idempotency.ExtendRequest{Namespace: ns, Key: key, Token: claim.Token + 1000}); !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Fatalf("a stale token: %v", err)
		}
		done, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("ok")})
		if err != nil || done.CompletedAt.IsZero() || !done.ExpiresAt.After(done.CompletedAt) {
			t.Fatalf("%+v, %v", done, err)
		}
		// Complete repeated with the same response: the same answer.
		repeat, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("ok")})
		if err != nil || !repeat.CompletedAt.Equal(done.CompletedAt) {
			t.Fatalf("%+v, %v", repeat, err)
		}
		if _, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("other")}); !errors.Is(err, idempotency.ErrAlreadyCompleted) {
			t.Fatalf("another response: %v", err)
		}
		replay, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp")})
		if err != nil || replay.Outcome != idempotency.Completed || string(replay.Response) != "ok" {
			t.Fatalf("%+v, %v", replay, err)
		}
		mismatch, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("other")})
		if err != nil || mismatch.Outcome != idempotency.FingerprintMismatch {
			t.Fatalf("%+v, %v", mismatch, err)
		}
		if err := c.Release(ctx, ns, "never-claimed", 5); !errors.Is(err, idempotency.ErrKeyNotFound) {
			t.Fatalf("release of an absent key: %v", err)
		}
		if err := c.Release(ctx, ns, key, claim.Token); !errors.Is(err, idempotency.ErrAlreadyCompleted) {
			t.Fatalf("release of a completed key: %v", err)
		}
	})
}

// A TryStart answered late (here: its answer held by the proxy, as a coordinator that made the
// caller wait would) is renewed with one ExtendLease before the work starts, so that the work
// gets its whole lease; one answered at once is not (docs/contract.md, "A claim that waited").
// The lease here is shorter than the delay: counted from the TryStart's sending, it would have
// run out before the work started.
func TestAClaimThatWaitedIsRenewedBeforeTheWorkStarts(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	for _, tc := range []struct {
		name        string
		delay       time.Duration
		wantRenewal bool
	}{
		{"answered at once", 0, false},
		{"answered after longer than the lease", 1200 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			proxy := testenv.StartFaultProxy(t, coordinator.Addr)
			c := testenv.NewClient(t, proxy.Addr)
			if tc.delay > 0 {
				fault := fmt.Sprintf(`{"method":"TryStart","action":"delay","delay_ms":%d,"times":1}`, tc.delay.Milliseconds())
				if err := proxy.AddFault(json.RawMessage(fault)); err != nil {
					t.Fatal(err)
				}
			}
			var renewalsBeforeWork int
			var cancelled error
			key := "renewal " + tc.name
			out, err := idempotency.RunOnce(context.Background(), c, "payments", key, nil, func(ctx context.Context, _ *idempotency.Lease) (int, error) {
				calls, err := proxy.Calls()
				if err != nil {
					return 0, err
				}
				renewalsBeforeWork = len(calls["ExtendLease"])
				// Most of the lease's work, with no heartbeat to renew it: the whole lease must be
				// left when the work starts.
				select {
				case <-ctx.Done():
					cancelled = context.Cause(ctx)
					return 0, ctx.Err()
				case <-time.After(700 * time.Millisecond):
				}
				return 7, nil
			}, idempotency.WithLease(time.Second), idempotency.WithoutHeartbeat())
			if err != nil || out.Value != 7 || cancelled != nil {
				t.Fatalf("%+v, %v (the work's context: %v)", out, err, cancelled)
			}
			if want := map[bool]int{false: 0, true: 1}[tc.wantRenewal]; renewalsBeforeWork != want {
				t.Fatalf("%d ExtendLease before the work started, want %d", renewalsBeforeWork, want)
			}
		})
	}
}

// The renewal of a claim that waited is refused (the key is no longer this caller's), or cannot
// get through: the work does not run; a refusal is a lost lease and releases nothing, a renewal
// that cannot get through fails with its own error and releases the key, so that the next caller
// gets it at once.
func TestARenewalThatFailsKeepsTheWorkFromRunning(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	direct := testenv.NewClient(t, coordinator.Addr)
	for _, tc := range []struct {
		name      string
		fault     string
		want      error
		wantState idempotency.KeyStatus
	}{
		{"refused as lost", `{"method":"ExtendLease","action":"status","code":"ABORTED","reason":"LEASE_LOST","times":-1}`,
			idempotency.ErrLeaseLost, idempotency.KeyInProgress},
		{"refused as not found", `{"method":"ExtendLease","action":"status","code":"NOT_FOUND","reason":"KEY_NOT_FOUND","times":-1}`,
			idempotency.ErrLeaseLost, idempotency.KeyInProgress},
		{"unreachable", `{"method":"ExtendLease","action":"status","code":"UNAVAILABLE","times":-1}`,
			idempotency.ErrUnavailable, idempotency.KeyAbsent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			proxy := testenv.StartFaultProxy(t, coordinator.Addr)
			c := testenv.NewClient(t, proxy.Addr)
			for _, fault := range []string{`{"method":"TryStart","action":"delay","delay_ms":400,"times":1}`, tc.fault} {
				if err := proxy.AddFault(json.RawMessage(fault)); err != nil {
					t.Fatal(err)
				}
			}
			key := "renewal " + tc.name
			_, err := idempotency.RunOnce(context.Background(), c, "payments", key, nil, func(context.Context, *idempotency.Lease) (int, error) {
				t.Error("the work ran although its lease was not renewed")
				return 0, nil
			}, idempotency.WithLease(time.Second))
			if !errors.Is(err, tc.want) {
				t.Fatalf("RunOnce: %v, want %v", err, tc.want)
			}
			if tc.want == idempotency.ErrUnavailable && errors.Is(err, idempotency.ErrLeaseLost) {
				t.Fatalf("RunOnce: %v; a renewal that cannot get through is not a lost lease", err)
			}
			calls, err := proxy.Calls()
			if err != nil {
				t.Fatal(err)
			}
			if len(calls["Complete"]) != 0 {
				t.Fatalf("calls %v", calls)
			}
			if renewals := len(calls["ExtendLease"]); renewals == 0 || tc.want == idempotency.ErrLeaseLost && renewals != 1 {
				t.Fatalf("%d ExtendLease: a refusal is not retried, a failure is", renewals)
			}
			if released := len(calls["Release"]) > 0; released != (tc.wantState == idempotency.KeyAbsent) {
				t.Fatalf("released: %v (calls %v)", released, calls)
			}
			if state := lookup(t, direct, "payments", key); state.Status != tc.wantState {
				t.Fatalf("the key is %v, want %v", state.Status, tc.wantState)
			}
		})
	}
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

// The coordinator stops answering ExtendLease (the proxy holds its answers): the lease runs out
// with a heartbeat still waiting for its answer, or after one whose own call timeout passed.
// Either way the work's context is cancelled with the cause the README names, ErrUnavailable
// (and ErrLeaseLost), not a deadline.
func TestAHeartbeatThatHangsReportsTheCoordinatorUnavailable(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	for _, tc := range []struct {
		name        string
		callTimeout time.Duration
	}{
		{"the lease runs out while a heartbeat waits", idempotency.DefaultCallTimeout},
		{"the heartbeat's call timeout passed first", 250 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			proxy := testenv.StartFaultProxy(t, coordinator.Addr)
			if err := proxy.AddFault(json.RawMessage(`{"method":"ExtendLease","action":"delay","delay_ms":30000,"times":-1}`)); err != nil {
				t.Fatal(err)
			}
			c := testenv.NewClient(t, proxy.Addr, idempotency.WithCallTimeout(tc.callTimeout))
			var cause error
			_, err := idempotency.RunOnce(context.Background(), c, "payments", "hangs "+tc.name, nil, func(ctx context.Context, _ *idempotency.Lease) (int, error) {
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
				case <-time.After(10 * time.Second):
				}
				return 0, ctx.Err()
			}, idempotency.WithLease(time.Second))
			for what, got := range map[string]error{"RunOnce": err, "the work's context": cause} {
				if !errors.Is(got, idempotency.ErrLeaseLost) || !errors.Is(got, idempotency.ErrUnavailable) || errors.Is(got, idempotency.ErrDeadline) ||
					errors.Is(got, context.DeadlineExceeded) {
					t.Errorf("%s: %v, want ErrLeaseLost with ErrUnavailable", what, got)
				}
			}
		})
	}
}

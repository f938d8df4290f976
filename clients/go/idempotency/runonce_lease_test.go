package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// RunOnce's lease against a real coordinator: a lease lost, or run out while the coordinator is
// unreachable or its heartbeats hang, cancels the work; a claim that waited is renewed before the
// work starts, and a renewal that fails keeps it from running; a checkpoint is handed to the next
// holder.

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
		wantStatus(t, c, "payments", "k", idempotency.KeyInProgress, "the new holder's claim")
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

// A previous holder's checkpoint is handed to the caller that takes the key over.
func TestTheCheckpointIsHandedToTheNextHolder(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
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
			calls := proxy.CallLog(t)
			if len(calls["Complete"]) != 0 {
				t.Fatalf("calls %v", calls)
			}
			if renewals := len(calls["ExtendLease"]); renewals == 0 || tc.want == idempotency.ErrLeaseLost && renewals != 1 {
				t.Fatalf("%d ExtendLease: a refusal is not retried, a failure is", renewals)
			}
			if released := len(calls["Release"]) > 0; released != (tc.wantState == idempotency.KeyAbsent) {
				t.Fatalf("released: %v (calls %v)", released, calls)
			}
			wantStatus(t, direct, "payments", key, tc.wantState, "after the failed renewal")
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

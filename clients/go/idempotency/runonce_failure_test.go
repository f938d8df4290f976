package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// RunOnce when something fails, against a real coordinator: a work that fails or panics releases
// the key; across a coordinator killed mid-work and restarted the work still runs once; a result
// that cannot be stored comes back in a ResultNotStoredError; a TryStart whose answer was lost
// gets its claim back.

type declined struct{ reason string }

func (d *declined) Error() string { return "declined: " + d.reason }

func TestAFailedWorkReleasesTheKeyAndItsErrorIsReturned(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
		ctx := context.Background()
		_, err := idempotency.RunOnce(ctx, c, "payments", "k", nil, func(context.Context, *idempotency.Lease) (int, error) {
			return 0, &declined{"insufficient funds"}
		})
		var d *declined
		if !errors.As(err, &d) || d.reason != "insufficient funds" {
			t.Fatalf("got %v", err)
		}
		wantStatus(t, c, "payments", "k", idempotency.KeyAbsent, "after a failure")
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
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
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
		wantStatus(t, c, "payments", "k", idempotency.KeyAbsent, "after a panic")
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
		wantStatus(t, direct, "payments", "k", idempotency.KeyInProgress, "the claim stays until its lease runs out")
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

package idempotency_test

import (
	"context"
	"testing"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// coordinatorAddr is the coordinator the examples talk to: a real one, on SQLite, started by
// TestMain (the behaviour tests start one of their own each).
var coordinatorAddr string

func TestMain(m *testing.M) { testenv.Main(m, &coordinatorAddr) }

// withClientOnEachStore runs test on each store (testenv.OnEachStore) with a client of that
// store's coordinator, for the tests that need nothing else of it.
func withClientOnEachStore(t *testing.T, test func(t *testing.T, c *idempotency.Client)) {
	t.Helper()
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		test(t, testenv.NewClient(t, coordinator.Addr))
	})
}

func lookup(t *testing.T, c *idempotency.Client, namespace, key string) idempotency.KeyState {
	t.Helper()
	state, err := c.Lookup(context.Background(), namespace, key)
	if err != nil {
		t.Fatal(err)
	}
	return state
}

// wantStatus fails the test unless the key's status is want; when says at what point.
func wantStatus(t *testing.T, c *idempotency.Client, namespace, key string, want idempotency.KeyStatus, when string) {
	t.Helper()
	if got := lookup(t, c, namespace, key).Status; got != want {
		t.Fatalf("%s: the key is %v, want %v", when, got, want)
	}
}

// charge and order are the result and the request the RunOnce tests run with.
type charge struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

type order struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

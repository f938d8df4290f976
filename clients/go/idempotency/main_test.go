package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// coordinatorAddr is the coordinator the examples talk to: a real one, on SQLite, started by
// TestMain (the behaviour tests start one of their own each).
var coordinatorAddr string

func TestMain(m *testing.M) { testenv.Main(m, &coordinatorAddr) }

// until polls condition every 20 ms; the test fails after limit.
func until(t *testing.T, what string, limit time.Duration, condition func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !condition() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lookup(t *testing.T, c *idempotency.Client, namespace, key string) idempotency.KeyState {
	t.Helper()
	state, err := c.Lookup(context.Background(), namespace, key)
	if err != nil {
		t.Fatal(err)
	}
	return state
}

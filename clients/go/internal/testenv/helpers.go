package testenv

import (
	"fmt"
	"os"
	"testing"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// Main is a package's TestMain: it starts a coordinator on SQLite for the tests that share one
// (the examples), puts its address in *coordinatorAddr, runs the tests, stops it and exits.
func Main(m *testing.M, coordinatorAddr *string) {
	coordinator, err := StartCoordinator(SQLite)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	*coordinatorAddr = coordinator.Addr
	code := m.Run()
	if err := coordinator.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

// OnEachStore runs test against a coordinator of its own on PostgreSQL and on SQLite, in
// parallel.
func OnEachStore(t *testing.T, test func(t *testing.T, coordinator *Coordinator)) {
	t.Helper()
	for _, store := range Stores {
		t.Run(string(store), func(t *testing.T) {
			t.Parallel()
			test(t, Start(t, store))
		})
	}
}

// NewClient is a client of addr, closed when the test ends.
func NewClient(t testing.TB, addr string, opts ...idempotency.Option) *idempotency.Client {
	t.Helper()
	c, err := idempotency.New(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

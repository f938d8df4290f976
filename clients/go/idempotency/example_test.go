package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// Charge an order at most once per idempotency key: a retry of the same request gets the stored
// result, and the key used for another request is refused.
func Example() {
	ctx := context.Background()
	client, err := idempotency.New(coordinatorAddr) // e.g. "127.0.0.1:50051"
	if err != nil {
		panic(err)
	}
	defer client.Close()

	type Order struct {
		ID     string `json:"id"`
		Amount int    `json:"amount"`
	}
	charge := func(ctx context.Context, lease *idempotency.Lease) (string, error) {
		return "ch_1", nil // the effect: runs once per key, with ctx cancelled if the lease is lost
	}
	for _, order := range []Order{{"o-42", 1250}, {"o-42", 1250}, {"o-42", 999}} {
		outcome, err := idempotency.RunOnce(ctx, client, "payments", "example-order-42", order, charge,
			idempotency.WithWait(5*time.Second))
		switch {
		case errors.Is(err, idempotency.ErrMismatch):
			fmt.Println("422: the key was used for another request")
		case errors.Is(err, idempotency.ErrInProgress):
			fmt.Println("409: still running elsewhere")
		case err != nil:
			fmt.Println("error:", err)
		default:
			fmt.Printf("200: %s (replayed: %v)\n", outcome.Value, outcome.Replayed)
		}
	}
	// Output:
	// 200: ch_1 (replayed: false)
	// 200: ch_1 (replayed: true)
	// 422: the key was used for another request
}

// An event consumer whose effect must happen once per event id: ProcessOnce claims the id
// before the effect.
func ExampleProcessOnce() {
	ctx := context.Background()
	client, err := idempotency.New(coordinatorAddr)
	if err != nil {
		panic(err)
	}
	defer client.Close()

	deliveries := []string{"evt-1", "evt-2", "evt-1"} // evt-1 is delivered twice
	for _, id := range deliveries {
		outcome, err := idempotency.ProcessOnce(ctx, client, "example-mailer", id, nil,
			func(ctx context.Context, _ *idempotency.Lease) (string, error) {
				return "sent mail for " + id, nil
			})
		if err != nil {
			panic(err)
		}
		fmt.Println(outcome.Value, "replayed:", outcome.Replayed)
	}
	// Output:
	// sent mail for evt-1 replayed: false
	// sent mail for evt-2 replayed: false
	// sent mail for evt-1 replayed: true
}

// MarkProcessed records that events were seen and answers those that are new.
func ExampleClient_MarkProcessed() {
	ctx := context.Background()
	client, err := idempotency.New(coordinatorAddr)
	if err != nil {
		panic(err)
	}
	defer client.Close()

	fresh, _ := client.MarkProcessed(ctx, "example-billing", []string{"e1", "e2"})
	fmt.Println(fresh)
	fresh, _ = client.MarkProcessed(ctx, "example-billing", []string{"e2", "e3"})
	fmt.Println(fresh)
	// Output:
	// [e1 e2]
	// [e3]
}

// The work's result could not be stored: the caller still has it.
func ExampleResultNotStoredError() {
	var err error = &idempotency.ResultNotStoredError[string]{Result: "ch_1", Err: idempotency.ErrUnavailable}
	var lost *idempotency.ResultNotStoredError[string]
	if errors.As(err, &lost) {
		fmt.Println("charged", lost.Result, "but not recorded; unavailable:", errors.Is(err, idempotency.ErrUnavailable))
	}
	// Output:
	// charged ch_1 but not recorded; unavailable: true
}

// The plain calls, for callers that drive the protocol themselves.
func ExampleClient_TryStart() {
	ctx := context.Background()
	client, err := idempotency.New(coordinatorAddr)
	if err != nil {
		panic(err)
	}
	defer client.Close()

	claim, err := client.TryStart(ctx, idempotency.StartRequest{Namespace: "example-exports", Key: "2026-12", LeaseTTL: time.Minute})
	if err != nil {
		panic(err)
	}
	fmt.Println(claim.Outcome, claim.Attempt)
	if _, err := client.Complete(ctx, idempotency.CompleteRequest{Namespace: "example-exports", Key: "2026-12", Token: claim.Token, Response: []byte("done")}); err != nil {
		panic(err)
	}
	state, _ := client.Lookup(ctx, "example-exports", "2026-12")
	fmt.Println(state.Status, string(state.Response))
	// Output:
	// started 1
	// completed done
}

package idempotency_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// The README's first example, whole: an HTTP endpoint that charges an order at most once per
// Idempotency-Key, with the coordinator's address and token from the environment (a coordinator
// on loopback needs no token). Then, not in the README, the test serves it and sends one charge
// twice and another order under the same key.
func Example_handler() {
	os.Setenv("COORDINATOR_ADDR", coordinatorAddr) // the tests' coordinator, on loopback
	defer os.Unsetenv("COORDINATOR_ADDR")
	os.Unsetenv("COORDINATOR_TOKEN") // it needs none

	var opts []idempotency.Option
	if token := os.Getenv("COORDINATOR_TOKEN"); token != "" {
		opts = append(opts, idempotency.WithToken(token))
	}
	client, err := idempotency.New(cmp.Or(os.Getenv("COORDINATOR_ADDR"), "127.0.0.1:50051"), opts...)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	type Order struct {
		ID     string `json:"id"`
		Amount int    `json:"amount"`
	}
	// chargeCard stands for the effect: a payment provider's call, made at most once per key.
	chargeCard := func(ctx context.Context, order Order, fencingToken uint64) (string, error) {
		return "ch_" + order.ID, nil
	}

	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		var order Order
		if err := json.NewDecoder(r.Body).Decode(&order); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		outcome, err := idempotency.RunOnce(r.Context(), client, "payments", r.Header.Get("Idempotency-Key"), order,
			func(ctx context.Context, lease *idempotency.Lease) (string, error) {
				return chargeCard(ctx, order, lease.Token) // ctx ends if the lease is lost
			}, idempotency.WithWait(5*time.Second))
		var busy *idempotency.InProgressError
		switch {
		case errors.As(err, &busy): // still running elsewhere after the wait
			w.Header().Set("Retry-After", strconv.Itoa(int(busy.RetryAfter.Seconds())+1))
			http.Error(w, "in progress", http.StatusConflict)
		case errors.Is(err, idempotency.ErrMismatch):
			http.Error(w, "the key was used for another order", http.StatusUnprocessableEntity)
		case errors.Is(err, idempotency.ErrInvalidArgument): // no key, or one too long
			http.Error(w, err.Error(), http.StatusBadRequest)
		case err != nil:
			http.Error(w, err.Error(), http.StatusBadGateway)
		default:
			fmt.Fprintf(w, "%s (replayed: %v)\n", outcome.Value, outcome.Replayed)
		}
	})

	server := httptest.NewServer(mux)
	defer server.Close()
	for _, order := range []string{`{"id":"o-7","amount":1250}`, `{"id":"o-7","amount":1250}`, `{"id":"o-7","amount":999}`} {
		req, _ := http.NewRequest("POST", server.URL+"/charges", strings.NewReader(order))
		req.Header.Set("Idempotency-Key", "example-charge-7")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, strings.TrimSpace(string(body)))
	}
	// Output:
	// 200 ch_o-7 (replayed: false)
	// 200 ch_o-7 (replayed: true)
	// 422 the key was used for another order
}

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

package idempotencyhttp_test

import (
	"cmp"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyhttp"
)

// Put the middleware in front of a handler: a retry with the same Idempotency-Key gets the
// stored response, and the handler runs once. The part from the client to the mux is the
// README's example of the middleware; then, not in the README, the test serves it and sends one
// request twice.
func ExampleNew() {
	os.Setenv("COORDINATOR_ADDR", coordinatorAddr) // the tests' coordinator, on loopback
	defer os.Unsetenv("COORDINATOR_ADDR")

	client, err := idempotency.New(cmp.Or(os.Getenv("COORDINATOR_ADDR"), "127.0.0.1:50051"),
		idempotency.WithRetryBudget(2*time.Second)) // the gateway's budget
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	withIdempotency, err := idempotencyhttp.New(client, "orders", idempotencyhttp.WithWait(5*time.Second))
	if err != nil {
		log.Fatal(err)
	}

	var created atomic.Int64
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := created.Add(1) // once per key; r.Context() ends if the lease is lost
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, n)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", withIdempotency(createOrder))

	server := httptest.NewServer(mux)
	defer server.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", server.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", `"order-42"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("orders created:", created.Load())
	// Output:
	// 201 {"order":1} replayed: false
	// 201 {"order":1} replayed: true
	// orders created: 1
}

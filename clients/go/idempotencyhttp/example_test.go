package idempotencyhttp_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyhttp"
)

// Put the middleware in front of a handler: a retry with the same Idempotency-Key gets the
// stored response, and the handler runs once.
func ExampleNew() {
	client, err := idempotency.New(coordinatorAddr, idempotency.WithRetryBudget(2*time.Second))
	if err != nil {
		panic(err)
	}
	defer client.Close()
	withIdempotency, err := idempotencyhttp.New(client, "example-orders")
	if err != nil {
		panic(err)
	}

	created := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, created)
	})
	server := httptest.NewServer(withIdempotency(createOrder))
	defer server.Close()

	for range 2 {
		req, _ := http.NewRequest("POST", server.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", `"order-42"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("orders created:", created)
	// Output:
	// 201 {"order":1} replayed: false
	// 201 {"order":1} replayed: true
	// orders created: 1
}

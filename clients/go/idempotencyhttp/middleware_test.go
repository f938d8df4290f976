package idempotencyhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyhttp"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// coordinatorAddr is the coordinator the examples talk to, started by TestMain.
var coordinatorAddr string

func TestMain(m *testing.M) { testenv.Main(m, &coordinatorAddr) }

// orders is the API under test: it numbers the orders it creates, echoes the lease token it got,
// and answers 503 for the item "flaky" and a large body for "huge".
type orders struct {
	created atomic.Int32
	delay   time.Duration
}

func (o *orders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var in struct{ Item string }
	_ = json.Unmarshal(body, &in)
	time.Sleep(o.delay)
	switch in.Item {
	case "flaky":
		o.created.Add(1)
		http.Error(w, "try again", http.StatusServiceUnavailable)
		return
	case "huge":
		o.created.Add(1)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(bytes.Repeat([]byte("x"), 4096))
		return
	}
	n := o.created.Add(1)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Add("Set-Cookie", "a=1")
	w.Header().Add("Set-Cookie", "b=2")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%d,"lease_token":%q}`, n, r.Header.Get(idempotencyhttp.LeaseTokenHeader))
}

// serve puts handler behind the middleware on an httptest server.
func serve(t *testing.T, client *idempotency.Client, handler http.Handler, opts ...idempotencyhttp.Option) *httptest.Server {
	t.Helper()
	mw, err := idempotencyhttp.New(client, "orders", opts...)
	if err != nil {
		t.Fatal(err)
	}
	server := httptest.NewServer(mw(handler))
	t.Cleanup(server.Close)
	return server
}

type answer struct {
	status int
	header http.Header
	body   string
}

func send(t *testing.T, method, url, key, body string, headers ...string) answer {
	t.Helper()
	a, err := request(method, url, key, body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// sendInBackground is send on a goroutine of its own: its answer arrives on the channel (a
// failed request is the test's error and a zero answer).
func sendInBackground(t *testing.T, method, url, key, body string) <-chan answer {
	answers := make(chan answer, 1)
	go func() {
		a, err := request(method, url, key, body)
		if err != nil {
			t.Error(err)
		}
		answers <- a
	}()
	return answers
}

func request(method, url, key, body string, headers ...string) (answer, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(data)}, err
}

func problemType(t *testing.T, a answer) string {
	t.Helper()
	var p struct {
		Type   string `json:"type"`
		Status int    `json:"status"`
	}
	if err := json.Unmarshal([]byte(a.body), &p); err != nil || p.Status != a.status || a.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("not a problem document: %d %v %s", a.status, a.header, a.body)
	}
	return strings.TrimPrefix(p.Type, idempotencyhttp.ProblemTypePrefix)
}

// Twenty duplicates of one request at once: the handler runs once, and every caller gets its
// answer (the others replayed).
func TestTwentyConcurrentDuplicatesRunTheHandlerOnce(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		api := &orders{delay: 300 * time.Millisecond}
		server := serve(t, testenv.NewClient(t, coordinator.Addr), api)
		var wg sync.WaitGroup
		answers := make([]answer, 20)
		for i := range answers {
			wg.Go(func() { answers[i] = send(t, "POST", server.URL+"/orders", `"order-42"`, `{"item":"book"}`) })
		}
		wg.Wait()
		if n := api.created.Load(); n != 1 {
			t.Fatalf("the handler ran %d times", n)
		}
		replayed := 0
		for _, a := range answers {
			if a.status != 201 || a.body != answers[0].body || !strings.Contains(a.body, `"order":1`) {
				t.Fatalf("answer %d %s, first %s", a.status, a.body, answers[0].body)
			}
			if a.header.Get(idempotencyhttp.ReplayedHeader) == "true" {
				replayed++
				if got := a.header.Values("Set-Cookie"); len(got) != 2 || got[0] != "a=1" || got[1] != "b=2" {
					t.Fatalf("replayed headers %v", a.header)
				}
			}
		}
		if replayed != 19 {
			t.Fatalf("%d replayed, want 19", replayed)
		}
	})
}

func TestTheMiddlewareAnswersAsTheGatewayDoes(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		api := &orders{}
		client := testenv.NewClient(t, coordinator.Addr)
		server := serve(t, client, api, idempotencyhttp.WithRequiredKey("/payments"), idempotencyhttp.WithMaxStoredResponseBytes(1024),
			idempotencyhttp.WithMaxRequestBytes(1024))
		url := server.URL + "/orders?x=1"

		first := send(t, "POST", url, "k1", `{"item":"book"}`)
		if first.status != 201 || first.header.Get(idempotencyhttp.ReplayedHeader) != "" || !strings.Contains(first.body, `"lease_token":"`) {
			t.Fatalf("first: %+v", first)
		}
		replay := send(t, "POST", url, `"k1"`, `{"item":"book"}`) // the same key, as an sf-string
		if replay.status != 201 || replay.body != first.body || replay.header.Get(idempotencyhttp.ReplayedHeader) != "true" {
			t.Fatalf("replay: %+v", replay)
		}
		for _, other := range []answer{
			send(t, "POST", url, "k1", `{"item":"pen"}`),                       // another body
			send(t, "POST", server.URL+"/orders?x=2", "k1", `{"item":"book"}`), // another query
			send(t, "PATCH", url, "k1", `{"item":"book"}`),                     // another method
		} {
			if got := problemType(t, other); got != "key-reused" || other.status != 422 {
				t.Fatalf("reused key: %d %s", other.status, got)
			}
		}
		if n := api.created.Load(); n != 1 {
			t.Fatalf("the handler ran %d times", n)
		}
		// Unguarded methods and requests without a key pass through; a required key is required.
		if a := send(t, "GET", url, "", ""); a.status != 201 || api.created.Load() != 2 {
			t.Fatalf("GET: %+v", a)
		}
		if a := send(t, "POST", url, "", `{"item":"book"}`); a.status != 201 || api.created.Load() != 3 || strings.Contains(a.body, `"lease_token":"1`) {
			t.Fatalf("no key: %+v", a)
		}
		for _, tc := range []struct {
			a    answer
			slug string
		}{
			{send(t, "POST", server.URL+"/payments/1", "", `{}`), "key-missing"},
			{send(t, "POST", url, "", `{}`, "Idempotency-Key", "a", "Idempotency-Key", "b"), "key-repeated"},
			{send(t, "POST", url, `"a", "b"`, `{}`), "key-malformed"},
			{send(t, "POST", url, strings.Repeat("k", 129), `{}`), "key-malformed"},
			{send(t, "POST", url, "big", strings.Repeat("x", 1025)), "request-too-large"},
		} {
			if got := problemType(t, tc.a); got != tc.slug {
				t.Errorf("want %s, got %s (%d)", tc.slug, got, tc.a.status)
			}
		}
		// A client's own lease token header is replaced by the claim's.
		if a := send(t, "POST", url, "k2", `{"item":"book"}`, idempotencyhttp.LeaseTokenHeader, "999999"); strings.Contains(a.body, "999999") {
			t.Fatalf("the client's lease token reached the handler: %s", a.body)
		}
		// An answer that is not final is not stored: the retry runs again.
		flakyRuns := api.created.Load()
		for range 2 {
			if a := send(t, "POST", url, "k3", `{"item":"flaky"}`); a.status != 503 || a.header.Get(idempotencyhttp.ReplayedHeader) != "" {
				t.Fatalf("flaky: %+v", a)
			}
		}
		if api.created.Load() != flakyRuns+2 {
			t.Fatal("a 503 was replayed")
		}
		// A response too large to store reaches its caller whole, and is never run again.
		huge := send(t, "POST", url, "k4", `{"item":"huge"}`)
		if huge.status != 201 || len(huge.body) != 4096 || huge.header.Get(idempotencyhttp.WarningHeader) != "not-replayable" {
			t.Fatalf("huge: %d %v %d bytes", huge.status, huge.header, len(huge.body))
		}
		again := send(t, "POST", url, "k4", `{"item":"huge"}`)
		if got := problemType(t, again); got != "response-not-replayable" || !strings.Contains(again.body, `"original_status":201`) ||
			again.header.Get(idempotencyhttp.ReplayedHeader) != "true" {
			t.Fatalf("huge again: %s %s", got, again.body)
		}
	})
}

func TestAKeyStillRunningIsAConflictAfterTheWait(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	api := &orders{delay: 1500 * time.Millisecond}
	server := serve(t, testenv.NewClient(t, coordinator.Addr), api, idempotencyhttp.WithWait(200*time.Millisecond))
	done := sendInBackground(t, "POST", server.URL+"/orders", "slow", `{"item":"book"}`)
	time.Sleep(300 * time.Millisecond)
	busy := send(t, "POST", server.URL+"/orders", "slow", `{"item":"book"}`)
	if got := problemType(t, busy); got != "in-progress" || busy.status != 409 || busy.header.Get("Retry-After") != "1" ||
		!strings.Contains(busy.body, "still running after 200ms") {
		t.Fatalf("busy: %s %v %s", got, busy.header, busy.body)
	}
	if first := <-done; first.status != 201 {
		t.Fatalf("first: %+v", first)
	}
}

func TestAnUnreachableCoordinatorFailsClosedOrOpen(t *testing.T) {
	// Nothing listens on port 1.
	client := testenv.NewClient(t, "127.0.0.1:1", idempotency.WithRetryBudget(0))
	api := &orders{}
	closed := serve(t, client, api)
	a := send(t, "POST", closed.URL+"/orders", "k", `{}`)
	if got := problemType(t, a); got != "coordinator-unavailable" || a.status != 503 || a.header.Get("Retry-After") != "1" || api.created.Load() != 0 {
		t.Fatalf("fail closed: %s %+v", got, a)
	}
	open := serve(t, client, api, idempotencyhttp.WithFailOpen())
	a = send(t, "POST", open.URL+"/orders", "k", `{}`)
	if a.status != 201 || a.header.Get(idempotencyhttp.WarningHeader) != "not-deduplicated" || api.created.Load() != 1 {
		t.Fatalf("fail open: %+v", a)
	}
}

func TestIdentitiesKeepCallersKeysApart(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	api := &orders{}
	server := serve(t, testenv.NewClient(t, coordinator.Addr), api, idempotencyhttp.WithIdentityHeader("X-Api-Key"))
	if got := problemType(t, send(t, "POST", server.URL+"/orders", "k", `{}`)); got != "identity-missing" {
		t.Fatalf("no identity: %s", got)
	}
	alice := send(t, "POST", server.URL+"/orders", "k", `{}`, "X-Api-Key", "alice")
	bob := send(t, "POST", server.URL+"/orders", "k", `{}`, "X-Api-Key", "bob")
	if alice.body == bob.body || api.created.Load() != 2 {
		t.Fatalf("alice %s, bob %s", alice.body, bob.body)
	}
}

func TestBadSettingsAreRefused(t *testing.T) {
	client := testenv.NewClient(t, "127.0.0.1:1")
	for name, opt := range map[string]idempotencyhttp.Option{
		"wait over 60s":   idempotencyhttp.WithWait(61 * time.Second),
		"lease too short": idempotencyhttp.WithLease(time.Millisecond),
		"retention":       idempotencyhttp.WithRetention(31 * 24 * time.Hour),
		"key length":      idempotencyhttp.WithMaxKeyLength(191),
		"methods":         idempotencyhttp.WithMethods("post"),
		"prefix":          idempotencyhttp.WithRequiredKey("payments"),
		"request limit":   idempotencyhttp.WithMaxRequestBytes(10),
		"stored limit":    idempotencyhttp.WithMaxStoredResponseBytes(65 << 20),
		"header":          idempotencyhttp.WithHeader("bad header"),
		"identity header": idempotencyhttp.WithIdentityHeader(""),
	} {
		if _, err := idempotencyhttp.New(client, "orders", opt); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := idempotencyhttp.New(client, "bad namespace"); err == nil {
		t.Error("a bad namespace was accepted")
	}
	if _, err := idempotencyhttp.New(nil, "orders"); err == nil {
		t.Error("a nil client was accepted")
	}
}

// The real gateway and the middleware share keys: a request recorded by one is replayed by the
// other, both ways, with the same status, headers and body.
func TestTheGatewayAndTheMiddlewareShareKeys(t *testing.T) {
	testenv.OnEachStore(t, func(t *testing.T, coordinator *testenv.Coordinator) {
		api := &orders{}
		upstream := httptest.NewServer(api)
		t.Cleanup(upstream.Close)
		gateway := testenv.StartGateway(t, coordinator.Addr, upstream.URL, "orders")
		middleware := serve(t, testenv.NewClient(t, coordinator.Addr), api)

		check := func(firstURL, secondURL, key string) {
			t.Helper()
			before := api.created.Load()
			first := send(t, "POST", firstURL+"/orders?x=1", key, `{"item":"book"}`)
			second := send(t, "POST", secondURL+"/orders?x=1", key, `{"item":"book"}`)
			if first.status != 201 || second.status != 201 || first.body != second.body || api.created.Load() != before+1 {
				t.Fatalf("%s then %s: %d %s / %d %s (%d runs)", firstURL, secondURL, first.status, first.body, second.status, second.body, api.created.Load()-before)
			}
			if second.header.Get(idempotencyhttp.ReplayedHeader) != "true" || second.header.Get("Content-Type") != "application/json" ||
				strings.Join(second.header.Values("Set-Cookie"), ";") != "a=1;b=2" {
				t.Fatalf("replayed headers: %v", second.header)
			}
			// The other body is refused by both, with the same document.
			fromGateway := send(t, "POST", gateway.URL+"/orders?x=1", key, `{"item":"pen"}`)
			fromMiddleware := send(t, "POST", middleware.URL+"/orders?x=1", key, `{"item":"pen"}`)
			if fromGateway.status != 422 || fromGateway.body != fromMiddleware.body || fromMiddleware.status != 422 {
				t.Fatalf("key reused: gateway %d %s, middleware %d %s", fromGateway.status, fromGateway.body, fromMiddleware.status, fromMiddleware.body)
			}
		}
		check(gateway.URL, middleware.URL, `"via-gateway"`)
		check(middleware.URL, gateway.URL, `"via-middleware"`)

		// The answers made without the coordinator match too.
		for _, key := range []string{`"a", "b"`, strings.Repeat("k", 129)} {
			g := send(t, "POST", gateway.URL+"/orders", key, `{}`)
			m := send(t, "POST", middleware.URL+"/orders", key, `{}`)
			if g.status != m.status || g.body != m.body {
				t.Errorf("key %q: gateway %d %s, middleware %d %s", key, g.status, g.body, m.status, m.body)
			}
		}
	})
}

// The claim is taken over while the handler runs: its context is cancelled, and the caller gets
// 409 lease-lost, never the handler's answer (the new holder owns the key).
func TestALostLeaseIsAConflictNotTheHandlersAnswer(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	other := testenv.NewClient(t, coordinator.Addr)
	causes := make(chan error, 1)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		lease, ok := idempotencyhttp.LeaseFrom(r.Context())
		if !ok || r.Header.Get(idempotencyhttp.LeaseTokenHeader) != fmt.Sprint(lease.Token) {
			t.Error("no lease in the request")
			return
		}
		if err := other.Release(r.Context(), lease.Namespace, lease.Key, lease.Token); err != nil {
			t.Error(err)
		}
		if _, err := other.TryStart(r.Context(), idempotency.StartRequest{Namespace: lease.Namespace, Key: lease.Key, LeaseTTL: time.Minute}); err != nil {
			t.Error(err)
		}
		select {
		case <-r.Context().Done():
			causes <- context.Cause(r.Context())
		case <-time.After(5 * time.Second):
			causes <- nil
		}
		w.WriteHeader(http.StatusCreated)
	})
	server := serve(t, testenv.NewClient(t, coordinator.Addr), handler, idempotencyhttp.WithLease(600*time.Millisecond))
	a := send(t, "POST", server.URL+"/orders", "k", `{}`)
	if got := problemType(t, a); got != "lease-lost" || a.status != 409 || a.header.Get("Retry-After") != "1" {
		t.Fatalf("%s %+v", got, a)
	}
	if cause := <-causes; !errors.Is(cause, idempotency.ErrLeaseLost) {
		t.Fatalf("the handler's context: %v", cause)
	}
}

// A request that waited longer than its own lease for the key's holder (issue 36, item 2c): the
// holder's handler keeps the key for 1.5 of the waiter's leases and then answers 503, which
// releases it; the waiter (lease 2 s, wait 10 s, a handler of 1.5 s) gets the key inside its
// wait. Its handler runs once with its whole lease (the middleware renews a claim that waited),
// its answer is stored, and a later request gets it replayed, the same status, headers and body.
func TestARequestThatWaitedLongerThanItsLeaseRunsOnceAndIsStored(t *testing.T) {
	coordinator := testenv.Start(t, testenv.SQLite)
	const lease, wait, handlerTakes, holderKeeps = 2 * time.Second, 10 * time.Second, 1500 * time.Millisecond, 3 * time.Second

	holderStarted, holderGoesOn := make(chan struct{}), make(chan struct{})
	holder := serve(t, testenv.NewClient(t, coordinator.Addr), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(holderStarted)
		<-holderGoesOn
		http.Error(w, "try again", http.StatusServiceUnavailable) // not final: the key is released
	}))
	// The waiter's coordinator calls go through a proxy, so that the test sees its TryStart arrive.
	proxy := testenv.StartFaultProxy(t, coordinator.Addr)
	api := &orders{delay: handlerTakes}
	waiter := serve(t, testenv.NewClient(t, proxy.Addr), api, idempotencyhttp.WithLease(lease), idempotencyhttp.WithWait(wait))

	held := sendInBackground(t, "POST", holder.URL+"/orders", "waited", `{"item":"book"}`)
	select {
	case <-holderStarted:
	case a := <-held:
		t.Fatalf("the holder answered before its handler started: %+v", a)
	}
	began := time.Now()
	waited := sendInBackground(t, "POST", waiter.URL+"/orders", "waited", `{"item":"book"}`)
	awaitCalls(t, proxy, "TryStart", 1)
	time.Sleep(holderKeeps) // the scenario's timing: the holder keeps the key 1.5 leases
	close(holderGoesOn)
	if a := <-held; a.status != http.StatusServiceUnavailable {
		t.Fatalf("the holder: %+v", a)
	}

	first := <-waited
	if elapsed := time.Since(began); elapsed < holderKeeps+handlerTakes {
		t.Errorf("the waiter answered after %v, before the holder let go and its handler ran", elapsed)
	}
	if first.status != http.StatusCreated || first.header.Get(idempotencyhttp.ReplayedHeader) != "" || !strings.Contains(first.body, `"order":1`) {
		t.Fatalf("the waiter: %d %v %s", first.status, first.header, first.body)
	}
	if n := api.created.Load(); n != 1 {
		t.Fatalf("the waiter's handler ran %d times", n)
	}
	if calls := proxy.CallLog(t); len(calls["Complete"]) != 1 {
		t.Fatalf("the waiter's answer was not stored once: calls %v", calls)
	}

	replay := send(t, "POST", waiter.URL+"/orders", "waited", `{"item":"book"}`)
	if replay.status != first.status || replay.body != first.body || replay.header.Get(idempotencyhttp.ReplayedHeader) != "true" {
		t.Fatalf("the replay: %d %v %s, first %d %s", replay.status, replay.header, replay.body, first.status, first.body)
	}
	for _, name := range []string{"Content-Type", "Set-Cookie", "Content-Length"} {
		if got, want := strings.Join(replay.header.Values(name), ", "), strings.Join(first.header.Values(name), ", "); got != want {
			t.Errorf("the replay's %s: %q, first %q", name, got, want)
		}
	}
	if n := api.created.Load(); n != 1 {
		t.Fatalf("the handler ran %d times after the replay", n)
	}
}

// awaitCalls polls the proxy's call log until method has been called count times.
func awaitCalls(t *testing.T, proxy *testenv.FaultProxy, method string, count int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		calls := proxy.CallLog(t)
		if len(calls[method]) >= count {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s was called %d times after 20s, want %d", method, len(calls[method]), count)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

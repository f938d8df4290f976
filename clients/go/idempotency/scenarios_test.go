package idempotency_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/internal/testenv"
)

// The scenario vectors every client passes (clients/conformance/scenarios.json, described in
// its README): RunOnce against a real coordinator on SQLite, with a fault-proxy between the
// client and the coordinator, one proxy and one fresh client per scenario, run one after the
// other. Nothing here sleeps to synchronise: the runs' works report on channels, and await_calls
// polls the proxy's call log (pause_ms and a work's duration_ms are timings the scenario plays).
func TestScenarioVectors(t *testing.T) {
	scenarios := loadScenarios(t)
	coordinator := testenv.Start(t, testenv.SQLite)
	// Lookups for expect_key go straight to the coordinator, not through the proxy.
	direct := testenv.NewClient(t, coordinator.Addr)
	var runID [6]byte
	_, _ = rand.Read(runID[:])
	for i := range scenarios {
		sc := &scenarios[i]
		t.Run(sc.Name, func(t *testing.T) {
			r := newScenarioRunner(t, sc, coordinator, direct, fmt.Sprintf("go-%x/%s/", runID, sc.Name))
			for i := range sc.Steps {
				r.step(i+1, &sc.Steps[i])
			}
			r.checkAllJoined()
		})
	}
}

// scenarioLimit bounds every wait of the runner beyond what a step asks for itself (a run's
// wait, its retry budget): generous, for a loaded machine.
const scenarioLimit = 20 * time.Second

// scenarioNamespace is the suite's own namespace; keys are made unique per run of the suite.
const scenarioNamespace = "conformance-go"

// errScenarioOver is the cause the runner cancels the runs' context with when a scenario ends,
// so that a cancellation by the client is told apart from the runner's own.
var errScenarioOver = errors.New("the scenario ended")

// scenarioRunner runs one scenario's steps.
type scenarioRunner struct {
	t      *testing.T
	sc     *scenario
	proxy  *testenv.FaultProxy
	client *idempotency.Client // through the proxy
	direct *idempotency.Client // straight to the coordinator
	prefix string              // makes the scenario's keys unique to this run of the suite
	budget time.Duration       // the client's retry budget
	log    *testenv.LogBuffer  // the client's log, shown when the scenario fails

	ctx    context.Context // the runs' context, cancelled with errScenarioOver at the end
	cancel context.CancelCauseFunc
	runs   map[string]*scenarioRunState
	all    []*scenarioRunState
	wg     sync.WaitGroup
}

// scenarioRunState is one RunOnce and what its work saw. The fields below done are written by
// the run's goroutine (the work runs on it) and read only once done is closed.
type scenarioRunState struct {
	name    string
	spec    *scenarioRun
	limit   time.Duration // how long a join waits for it
	started chan struct{} // closed when the work starts
	gate    chan struct{} // closed by open_gate (or when the scenario ends)
	opened  bool
	done    chan struct{} // closed when RunOnce has returned
	joined  bool

	outcome   idempotency.Outcome[any]
	err       error
	elapsed   time.Duration // how long RunOnce took
	workRan   bool
	attempt   uint32
	cancelled bool  // the work's context was cancelled by the client while it ran
	cause     error // context.Cause of that cancellation
	workErr   error // the error a failing work returned
	problems  []string
}

func newScenarioRunner(t *testing.T, sc *scenario, coordinator *testenv.Coordinator, direct *idempotency.Client, prefix string) *scenarioRunner {
	t.Helper()
	proxy := testenv.StartFaultProxy(t, coordinator.Addr)
	log := &testenv.LogBuffer{}
	opts := []idempotency.Option{idempotency.WithLogger(slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})))}
	budget := idempotency.DefaultRetryPolicy().Budget
	if ms := sc.Client.RetryBudgetMS; ms != nil {
		budget = time.Duration(*ms) * time.Millisecond
		opts = append(opts, idempotency.WithRetryBudget(budget))
	}
	client, err := idempotency.New(proxy.Addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	r := &scenarioRunner{
		t: t, sc: sc, proxy: proxy, client: client, direct: direct, prefix: prefix, budget: budget,
		log: log, ctx: ctx, cancel: cancel, runs: map[string]*scenarioRunState{},
	}
	t.Cleanup(r.end)
	return r
}

// end stops whatever still runs (a scenario that failed half-way), waits for it, and shows the
// client's log and the proxy's call log when the scenario failed.
func (r *scenarioRunner) end() {
	r.cancel(errScenarioOver)
	for _, run := range r.all {
		if run.spec.Work.Gate && !run.opened {
			run.opened = true
			close(run.gate)
		}
	}
	_ = r.client.Close() // calls that outlive the caller (Complete, Release) end at once
	ended := make(chan struct{})
	go func() { r.wg.Wait(); close(ended) }()
	select {
	case <-ended:
	case <-time.After(scenarioLimit):
		r.t.Errorf("a run still had not returned %v after the scenario ended", scenarioLimit)
	}
	if r.t.Failed() {
		calls, err := r.proxy.Calls()
		r.t.Logf("scenario %q: %s\nproxy calls: %v %v\nclient log:\n%s", r.sc.Name, r.sc.What, calls, err, strings.TrimSpace(r.log.String()))
	}
}

func (r *scenarioRunner) step(n int, s *scenarioStep) {
	t := r.t
	t.Helper()
	switch {
	case s.Run != nil && s.Run.As != "":
		if r.runs[s.Run.As] != nil {
			t.Fatalf("step %d: a run named %q twice", n, s.Run.As)
		}
		r.runs[s.Run.As] = r.start(s.Run.As, s.Run)
	case s.Run != nil:
		run := r.start(fmt.Sprintf("step %d", n), s.Run)
		r.join(run, s.Expect)
	case s.Join != "":
		r.join(r.named(n, s.Join), s.Expect)
	case s.AwaitStarted != "":
		run := r.named(n, s.AwaitStarted)
		select {
		case <-run.started:
		case <-run.done:
			t.Fatalf("step %d: run %q ended without starting its work: %v", n, run.name, run.err)
		case <-time.After(scenarioLimit):
			t.Fatalf("step %d: run %q's work had not started after %v", n, run.name, scenarioLimit)
		}
	case s.OpenGate != "":
		run := r.named(n, s.OpenGate)
		if !run.spec.Work.Gate || run.opened {
			t.Fatalf("step %d: run %q has no gate to open", n, run.name)
		}
		run.opened = true
		close(run.gate)
	case s.Fault != nil:
		if err := r.proxy.AddFault(s.Fault); err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
	case s.Refuse != nil:
		if err := r.proxy.Refuse(); err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
	case s.Restore != nil:
		if err := r.proxy.Restore(); err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
	case s.Reset != nil:
		if err := r.proxy.Reset(); err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
	case s.AwaitCalls != nil:
		r.awaitCalls(n, s.AwaitCalls)
	case s.ExpectCalls != nil:
		r.expectCalls(n, s.ExpectCalls)
	case s.Claim != nil:
		r.claim(n, s.Claim)
	case s.PauseMS != nil:
		// The scenario's own timing (a holder that keeps the key this long), not a wait for
		// something the runner could watch.
		time.Sleep(time.Duration(*s.PauseMS) * time.Millisecond)
	case s.ExpectKey != nil:
		r.expectKey(n, s.ExpectKey)
	}
}

// claim sends one bare TryStart through the scenario's client, with the fingerprint RunOnce
// sends for the same request, and nothing after it: a holder whose process died, whose lease
// runs out.
func (r *scenarioRunner) claim(n int, c *scenarioClaim) {
	t := r.t
	t.Helper()
	request, err := decodeJSONValue(c.Request)
	if err != nil {
		t.Fatalf("step %d: the claim's request: %v", n, err)
	}
	fingerprint, err := idempotency.Fingerprint(request)
	if err != nil {
		t.Fatalf("step %d: the claim's request: %v", n, err)
	}
	ctx, cancel := context.WithTimeout(r.ctx, scenarioLimit)
	defer cancel()
	claim, err := r.client.TryStart(ctx, idempotency.StartRequest{
		Namespace: scenarioNamespace, Key: r.prefix + c.Key, Fingerprint: fingerprint,
		LeaseTTL: time.Duration(*c.LeaseTTLMS) * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("step %d: the claim's TryStart: %v", n, err)
	}
	if claim.Outcome != idempotency.Started {
		t.Fatalf("step %d: the claim's TryStart answered %v, want started", n, claim.Outcome)
	}
}

func (r *scenarioRunner) named(n int, name string) *scenarioRunState {
	run := r.runs[name]
	if run == nil {
		r.t.Fatalf("step %d: no run named %q was started", n, name)
	}
	return run
}

// start calls RunOnce on a goroutine of its own, with a work that does what the run's work says.
func (r *scenarioRunner) start(name string, spec *scenarioRun) *scenarioRunState {
	t := r.t
	t.Helper()
	request, err := decodeJSONValue(spec.Request)
	if err != nil {
		t.Fatalf("run %q: the request: %v", name, err)
	}
	var result any
	if spec.Work.Result != nil {
		if result, err = decodeJSONValue(spec.Work.Result); err != nil {
			t.Fatalf("run %q: the work's result: %v", name, err)
		}
	}
	var opts []idempotency.RunOption
	wait := time.Duration(0)
	if spec.WaitMS != nil {
		wait = time.Duration(*spec.WaitMS) * time.Millisecond
		opts = append(opts, idempotency.WithWait(wait))
	}
	if spec.LeaseTTLMS != nil {
		opts = append(opts, idempotency.WithLease(time.Duration(*spec.LeaseTTLMS)*time.Millisecond))
	}
	run := &scenarioRunState{
		name: name, spec: spec, limit: scenarioLimit + wait + r.budget,
		started: make(chan struct{}), gate: make(chan struct{}), done: make(chan struct{}),
	}
	r.all = append(r.all, run)
	work := func(ctx context.Context, lease *idempotency.Lease) (any, error) {
		run.workRan = true
		run.attempt = lease.Attempt
		close(run.started)
		if spec.Work.Gate {
			<-run.gate
		}
		if spec.Work.UntilCancelled {
			timer := time.NewTimer(scenarioLimit)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
			timer.Stop()
		}
		if spec.Work.DurationMS != nil {
			// Working: a cancellation within the duration ends the work with Go's own error
			// for it, so that a cancelled run never returns the result.
			timer := time.NewTimer(time.Duration(*spec.Work.DurationMS) * time.Millisecond)
			select {
			case <-ctx.Done():
				timer.Stop()
				run.cause = context.Cause(ctx)
				run.cancelled = !errors.Is(run.cause, errScenarioOver)
				return nil, ctx.Err()
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			run.cause = context.Cause(ctx)
			run.cancelled = !errors.Is(run.cause, errScenarioOver)
		}
		if spec.Work.RefuseAtEnd {
			if err := r.proxy.Refuse(); err != nil {
				run.problems = append(run.problems, err.Error())
			}
		}
		if spec.Work.Fail != nil {
			run.workErr = errors.New(*spec.Work.Fail)
			return nil, run.workErr
		}
		return result, nil
	}
	key := r.prefix + spec.Key
	r.wg.Go(func() {
		defer close(run.done)
		began := time.Now()
		run.outcome, run.err = idempotency.RunOnce(r.ctx, r.client, scenarioNamespace, key, request, work, opts...)
		run.elapsed = time.Since(began)
	})
	return run
}

// join waits for the run to end and checks its outcome against expect.
func (r *scenarioRunner) join(run *scenarioRunState, expect *runExpectation) {
	t := r.t
	t.Helper()
	if run.joined {
		t.Fatalf("run %q joined twice", run.name)
	}
	run.joined = true
	select {
	case <-run.done:
	case <-time.After(run.limit):
		t.Fatalf("run %q had not returned after %v", run.name, run.limit)
	}
	for _, problem := range run.problems {
		t.Errorf("run %q: %s", run.name, problem)
	}
	if expect.Result != nil {
		if run.err != nil {
			t.Errorf("run %q: want the result %s, got the error %v", run.name, expect.Result, run.err)
		} else {
			if got, want := canonicalOf(run.outcome.Value), canonicalText(expect.Result); got != want {
				t.Errorf("run %q: got the result %s, want %s", run.name, got, want)
			}
			if expect.WorkRan != nil && run.outcome.Replayed == *expect.WorkRan {
				t.Errorf("run %q: Outcome.Replayed is %v, but the work ran: %v", run.name, run.outcome.Replayed, run.workRan)
			}
		}
	}
	if expect.Error != "" {
		if run.err == nil {
			t.Errorf("run %q: want a %s error, got the result %s", run.name, expect.Error, canonicalOf(run.outcome.Value))
		} else if got := errorKindOf(run); got != expect.Error {
			t.Errorf("run %q: want a %s error, got a %s error: %v", run.name, expect.Error, got, run.err)
		}
	}
	if expect.CarriedResult != nil {
		var notStored *idempotency.ResultNotStoredError[any]
		if errors.As(run.err, &notStored) {
			if got, want := canonicalOf(notStored.Result), canonicalText(expect.CarriedResult); got != want {
				t.Errorf("run %q: the error carries the result %s, want %s", run.name, got, want)
			}
		}
	}
	if expect.WorkRan != nil && run.workRan != *expect.WorkRan {
		t.Errorf("run %q: the work ran: %v, want %v", run.name, run.workRan, *expect.WorkRan)
	}
	if expect.WorkCancelled != nil && run.cancelled != *expect.WorkCancelled {
		t.Errorf("run %q: the client cancelled the work: %v (cause: %v), want %v", run.name, run.cancelled, run.cause, *expect.WorkCancelled)
	}
	if expect.Attempt != nil {
		switch {
		case !run.workRan:
			t.Errorf("run %q: want the work to see attempt %d, but it did not run", run.name, *expect.Attempt)
		case run.attempt != *expect.Attempt:
			t.Errorf("run %q: the work saw attempt %d, want %d", run.name, run.attempt, *expect.Attempt)
		}
	}
	if expect.MinElapsedMS != nil {
		if least := time.Duration(*expect.MinElapsedMS) * time.Millisecond; run.elapsed < least {
			t.Errorf("run %q: RunOnce took %v, under %v", run.name, run.elapsed, least)
		}
	}
}

// errorKindOf sorts a run's error into the kinds of expect.error (see errorKinds), or "other".
func errorKindOf(run *scenarioRunState) string {
	err := run.err
	var notStored *idempotency.ResultNotStoredError[any]
	var inProgress *idempotency.InProgressError
	for _, kind := range errorKinds {
		var is bool
		switch kind {
		case "result_not_stored":
			is = errors.Is(err, idempotency.ErrResultNotStored) && errors.As(err, &notStored)
		case "lease_lost":
			is = errors.Is(err, idempotency.ErrLeaseLost)
		case "work_failed":
			is = run.workErr != nil && errors.Is(err, run.workErr)
		case "mismatch":
			is = errors.Is(err, idempotency.ErrMismatch)
		case "in_progress":
			is = errors.Is(err, idempotency.ErrInProgress) && errors.As(err, &inProgress)
		case "unauthenticated":
			is = errors.Is(err, idempotency.ErrUnauthenticated)
		case "unavailable":
			is = errors.Is(err, idempotency.ErrUnavailable)
		}
		if is {
			return kind
		}
	}
	return "other"
}

// awaitCalls polls the proxy's call log until the method has been called count times.
func (r *scenarioRunner) awaitCalls(n int, want *callCount) {
	t := r.t
	t.Helper()
	deadline := time.Now().Add(scenarioLimit)
	ticker := time.NewTicker(20 * time.Millisecond)
	defer ticker.Stop()
	for {
		calls, err := r.proxy.Calls()
		if err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
		if len(calls[want.Method]) >= want.Count {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("step %d: %s was called %d times after %v, want %d", n, want.Method, len(calls[want.Method]), scenarioLimit, want.Count)
		}
		<-ticker.C
	}
}

// expectCalls checks the proxy's call log: exactly count calls of the method, and the second at
// least min_gap_ms after the first.
func (r *scenarioRunner) expectCalls(n int, want *callCount) {
	t := r.t
	t.Helper()
	calls, err := r.proxy.Calls()
	if err != nil {
		t.Fatalf("step %d: %v", n, err)
	}
	at := calls[want.Method]
	if len(at) != want.Count {
		t.Errorf("step %d: %s was called %d times (at %v ms), want %d", n, want.Method, len(at), at, want.Count)
		return
	}
	if want.MinGapMS != nil {
		if gap := at[1] - at[0]; gap < *want.MinGapMS {
			t.Errorf("step %d: the second %s came %.1f ms after the first, want at least %v ms", n, want.Method, gap, *want.MinGapMS)
		}
	}
}

// expectKey looks the key up straight from the coordinator.
func (r *scenarioRunner) expectKey(n int, want *keyExpectation) {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), scenarioLimit)
	defer cancel()
	state, err := r.direct.Lookup(ctx, scenarioNamespace, r.prefix+want.Key)
	if err != nil {
		t.Fatalf("step %d: Lookup: %v", n, err)
	}
	if got := state.Status.String(); got != want.State {
		t.Errorf("step %d: the key %q is %s, want %s", n, want.Key, got, want.State)
	}
}

// checkAllJoined fails a scenario that started a run in the background and never joined it.
func (r *scenarioRunner) checkAllJoined() {
	if r.t.Failed() {
		return
	}
	for name, run := range r.runs {
		if !run.joined {
			r.t.Errorf("run %q was started and never joined", name)
		}
	}
}

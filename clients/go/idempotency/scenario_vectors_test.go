package idempotency_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// The scenario vectors' file (clients/conformance/scenarios.json) as the runner in
// scenarios_test.go reads it, strictly, and the helpers it compares values with.

// The file's shape, read strictly: a field this runner does not know fails the test rather than
// being skipped.
type scenarioFile struct {
	Scenarios []scenario `json:"scenarios"`
}

type scenario struct {
	Name   string `json:"name"`
	What   string `json:"what"`
	Client struct {
		RetryBudgetMS *int64 `json:"retry_budget_ms"`
	} `json:"client"`
	Steps []scenarioStep `json:"steps"`
}

type scenarioStep struct {
	Run          *scenarioRun    `json:"run"`
	Expect       *runExpectation `json:"expect"`
	AwaitStarted string          `json:"await_started"`
	OpenGate     string          `json:"open_gate"`
	Join         string          `json:"join"`
	Fault        json.RawMessage `json:"fault"`
	Refuse       *bool           `json:"refuse"`
	Restore      *bool           `json:"restore"`
	Reset        *bool           `json:"reset"`
	AwaitCalls   *callCount      `json:"await_calls"`
	ExpectCalls  *callCount      `json:"expect_calls"`
	Claim        *scenarioClaim  `json:"claim"`
	PauseMS      *int64          `json:"pause_ms"`
	ExpectKey    *keyExpectation `json:"expect_key"`
}

// scenarioClaim is a bare TryStart: a holder that claims the key and then dies.
type scenarioClaim struct {
	Key        string          `json:"key"`
	Request    json.RawMessage `json:"request"`
	LeaseTTLMS *int64          `json:"lease_ttl_ms"`
}

type scenarioRun struct {
	As         string          `json:"as"`
	Key        string          `json:"key"`
	Request    json.RawMessage `json:"request"`
	WaitMS     *int64          `json:"wait_ms"`
	LeaseTTLMS *int64          `json:"lease_ttl_ms"`
	Work       struct {
		Result         json.RawMessage `json:"result"`
		Fail           *string         `json:"fail"`
		Gate           bool            `json:"gate"`
		UntilCancelled bool            `json:"until_cancelled"`
		DurationMS     *int64          `json:"duration_ms"`
		RefuseAtEnd    bool            `json:"refuse_at_end"`
	} `json:"work"`
}

type runExpectation struct {
	Result        json.RawMessage `json:"result"`
	Error         string          `json:"error"`
	CarriedResult json.RawMessage `json:"carried_result"`
	WorkRan       *bool           `json:"work_ran"`
	WorkCancelled *bool           `json:"work_cancelled"`
	Attempt       *uint32         `json:"attempt"`
	MinElapsedMS  *int64          `json:"min_elapsed_ms"`
}

type callCount struct {
	Method   string   `json:"method"`
	Count    int      `json:"count"`
	MinGapMS *float64 `json:"min_gap_ms"`
}

type keyExpectation struct {
	Key   string `json:"key"`
	State string `json:"state"`
}

// The error kinds of expect.error, in the order an error is sorted into them: an error that
// wraps another is of the outer kind (a ResultNotStoredError carries Complete's UNAVAILABLE, a
// lost lease the heartbeat's failure or the work's error).
var errorKinds = []string{
	"result_not_stored", "lease_lost", "work_failed", "mismatch", "in_progress",
	"unauthenticated", "unavailable",
}

func loadScenarios(t *testing.T) []scenario {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "conformance", "scenarios.json"))
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var file scenarioFile
	if err := dec.Decode(&file); err != nil {
		t.Fatalf("scenarios.json: %v", err)
	}
	if len(file.Scenarios) == 0 {
		t.Fatal("scenarios.json holds no scenario")
	}
	names := map[string]bool{}
	for _, sc := range file.Scenarios {
		if sc.Name == "" || names[sc.Name] {
			t.Fatalf("scenarios.json: a scenario without a name, or a name twice: %q", sc.Name)
		}
		names[sc.Name] = true
		for n, step := range sc.Steps {
			if err := step.check(); err != nil {
				t.Fatalf("scenarios.json: %q, step %d: %v", sc.Name, n+1, err)
			}
		}
	}
	return file.Scenarios
}

// check refuses a step this runner would misread: none or several actions, an expect where none
// belongs, an expectation it cannot check.
func (s *scenarioStep) check() error {
	actions := 0
	for _, present := range []bool{
		s.Run != nil, s.AwaitStarted != "", s.OpenGate != "", s.Join != "", s.Fault != nil,
		s.Refuse != nil, s.Restore != nil, s.Reset != nil, s.AwaitCalls != nil, s.ExpectCalls != nil,
		s.Claim != nil, s.PauseMS != nil, s.ExpectKey != nil,
	} {
		if present {
			actions++
		}
	}
	if actions != 1 {
		return fmt.Errorf("%d actions; a step has one", actions)
	}
	for _, flag := range []*bool{s.Refuse, s.Restore, s.Reset} {
		if flag != nil && !*flag {
			return errors.New("refuse, restore and reset are true when given")
		}
	}
	wantsExpect := s.Join != "" || s.Run != nil && s.Run.As == ""
	if wantsExpect != (s.Expect != nil) {
		return errors.New("a run without as, and a join, have an expect; nothing else has")
	}
	if s.Run != nil {
		w := s.Run.Work
		if (w.Result != nil) == (w.Fail != nil) {
			return errors.New("a run's work has either a result or fail")
		}
		if s.Run.Key == "" || s.Run.Request == nil {
			return errors.New("a run has a key and a request")
		}
		if w.DurationMS != nil && *w.DurationMS <= 0 {
			return fmt.Errorf("a work's duration_ms is positive (got %d)", *w.DurationMS)
		}
	}
	if c := s.Claim; c != nil && (c.Key == "" || c.Request == nil || c.LeaseTTLMS == nil || *c.LeaseTTLMS <= 0) {
		return errors.New("a claim has a key, a request and a positive lease_ttl_ms")
	}
	if s.PauseMS != nil && *s.PauseMS <= 0 {
		return fmt.Errorf("pause_ms is positive (got %d)", *s.PauseMS)
	}
	if e := s.Expect; e != nil {
		if (e.Result != nil) == (e.Error != "") {
			return errors.New("an expect has either a result or an error")
		}
		if e.Error != "" && e.Error != "other" && !contains(errorKinds, e.Error) {
			return fmt.Errorf("unknown error kind %q", e.Error)
		}
		if e.CarriedResult != nil && e.Error != "result_not_stored" {
			return errors.New("carried_result belongs to result_not_stored")
		}
	}
	if s.AwaitCalls != nil && s.AwaitCalls.MinGapMS != nil {
		return errors.New("min_gap_ms belongs to expect_calls")
	}
	for _, c := range []*callCount{s.AwaitCalls, s.ExpectCalls} {
		if c != nil && (c.Method == "" || c.Count < 0 || c.MinGapMS != nil && c.Count < 2) {
			return fmt.Errorf("a call count needs a method, a count, and two calls for a gap: %+v", *c)
		}
	}
	if k := s.ExpectKey; k != nil && !contains([]string{"absent", "in_progress", "completed"}, k.State) {
		return fmt.Errorf("unknown key state %q", k.State)
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// decodeJSONValue reads a JSON value into maps, slices, strings, bools and json.Numbers (which
// keep each number's literal for the fingerprint and the codec).
func decodeJSONValue(raw json.RawMessage) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var value any
	if err := dec.Decode(&value); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the value")
	}
	return value, nil
}

// canonicalOf and canonicalText are two JSON values' canonical forms, so that the values are
// compared whatever the order of their members or the spelling of their numbers.
func canonicalOf(value any) string {
	canonical, err := idempotency.CanonicalJSON(value)
	if err != nil {
		return fmt.Sprintf("<%T %v: %v>", value, value, err)
	}
	return string(canonical)
}

func canonicalText(text json.RawMessage) string {
	canonical, err := idempotency.CanonicalJSONText(text)
	if err != nil {
		return fmt.Sprintf("<%s: %v>", text, err)
	}
	return string(canonical)
}

package testenv

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// FaultProxyBinary is FAULT_PROXY_BIN, or the repository's debug build of fault-proxy.
func FaultProxyBinary() string {
	if bin := os.Getenv("FAULT_PROXY_BIN"); bin != "" {
		return bin
	}
	return filepath.Join(RepoRoot(), "target", "debug", "fault-proxy")
}

// FaultProxy is one fault-proxy process (testkit/src/bin/fault-proxy.rs) in front of a
// coordinator: a gRPC proxy that loses answers, answers statuses of its own or refuses
// connections when told to through its control port, and logs when each call arrived.
type FaultProxy struct {
	// Addr is where the client connects instead of the coordinator.
	Addr string
	// Control is the control port's base URL (http://host:port).
	Control string

	http  *http.Client
	stdin io.WriteCloser
	proc  *process
}

// StartFaultProxy starts a fault-proxy in front of upstream (host:port) for the test; it stops
// when the test ends (its stdin is closed, which is how it knows).
func StartFaultProxy(t testing.TB, upstream string) *FaultProxy {
	t.Helper()
	bin := FaultProxyBinary()
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no fault-proxy binary at %s: build it (cargo build -p testkit) or set FAULT_PROXY_BIN", bin)
	}
	log := &LogBuffer{}
	first := &firstLine{line: make(chan string, 1), log: log}
	cmd := exec.Command(bin, "--upstream", upstream)
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = first, log
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	proc := &process{what: "fault-proxy", cmd: cmd, exited: make(chan struct{}), log: log}
	go func() { _ = cmd.Wait(); close(proc.exited) }()
	p := &FaultProxy{http: &http.Client{Timeout: 20 * time.Second}, stdin: stdin, proc: proc}
	t.Cleanup(p.stop)

	var line string
	select {
	case line = <-first.line:
	case <-proc.exited:
		t.Fatalf("the fault-proxy exited at start (%v):\n%s", cmd.ProcessState, log)
	case <-time.After(startupLimit):
		t.Fatalf("the fault-proxy printed no addresses within %v:\n%s", startupLimit, log)
	}
	var addresses struct {
		Proxy   string `json:"proxy"`
		Control string `json:"control"`
	}
	if err := json.Unmarshal([]byte(line), &addresses); err != nil || addresses.Proxy == "" || addresses.Control == "" {
		t.Fatalf("the fault-proxy's first line is not its addresses: %q (%v)", line, err)
	}
	p.Addr, p.Control = addresses.Proxy, "http://"+addresses.Control
	return p
}

// stop closes the proxy's stdin, so that it exits, and waits for it (killing it after 10 s).
func (p *FaultProxy) stop() {
	_ = p.stdin.Close()
	select {
	case <-p.proc.exited:
	case <-time.After(10 * time.Second):
		_ = p.proc.cmd.Process.Kill()
		<-p.proc.exited
	}
}

// Log is what the proxy printed, for explaining a failure.
func (p *FaultProxy) Log() string { return p.proc.log.String() }

// AddFault is POST /faults with this body (a JSON object: method, action, times, ...).
func (p *FaultProxy) AddFault(fault json.RawMessage) error {
	return p.post("/faults", fault)
}

// Refuse is POST /refuse: every connection is dropped and new ones are closed at once.
func (p *FaultProxy) Refuse() error { return p.post("/refuse", nil) }

// Restore is POST /restore: connections are let through again.
func (p *FaultProxy) Restore() error { return p.post("/restore", nil) }

// Reset is POST /reset: no faults, connections let through, the call log emptied.
func (p *FaultProxy) Reset() error { return p.post("/reset", nil) }

// Calls is GET /calls: for each method, the milliseconds since the proxy started at which each
// of its calls arrived, in order.
func (p *FaultProxy) Calls() (map[string][]float64, error) {
	answer, err := p.http.Get(p.Control + "/calls")
	if err != nil {
		return nil, fmt.Errorf("fault-proxy GET /calls: %w", err)
	}
	defer answer.Body.Close()
	body, err := io.ReadAll(answer.Body)
	if err != nil {
		return nil, fmt.Errorf("fault-proxy GET /calls: %w", err)
	}
	if answer.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("fault-proxy GET /calls: %s: %s", answer.Status, strings.TrimSpace(string(body)))
	}
	calls := map[string][]float64{}
	if err := json.Unmarshal(body, &calls); err != nil {
		return nil, fmt.Errorf("fault-proxy GET /calls: %w: %s", err, body)
	}
	return calls, nil
}

// CallLog is Calls for a test: a failure to get the log fails the test.
func (p *FaultProxy) CallLog(t testing.TB) map[string][]float64 {
	t.Helper()
	calls, err := p.Calls()
	if err != nil {
		t.Fatal(err)
	}
	return calls
}

func (p *FaultProxy) post(route string, body []byte) error {
	answer, err := p.http.Post(p.Control+route, "application/json", bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("fault-proxy POST %s: %w", route, err)
	}
	defer answer.Body.Close()
	text, _ := io.ReadAll(answer.Body)
	if answer.StatusCode != http.StatusOK {
		return fmt.Errorf("fault-proxy POST %s %s: %s: %s", route, body, answer.Status, strings.TrimSpace(string(text)))
	}
	return nil
}

// firstLine passes what a process writes to log, and its first line, once whole, to line.
type firstLine struct {
	mu   sync.Mutex
	buf  []byte
	sent bool
	line chan string
	log  *LogBuffer
}

func (w *firstLine) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.sent {
		w.buf = append(w.buf, p...)
		if i := bytes.IndexByte(w.buf, '\n'); i >= 0 {
			w.sent = true
			w.line <- string(w.buf[:i])
			w.buf = nil
		}
	}
	return w.log.Write(p)
}

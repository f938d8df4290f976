// Package testenv starts the real coordinator and gateway binaries for the tests, each on a port
// of its own (port 0, the bound address read from --address-file) and a store of its own: a fresh
// PostgreSQL database or a SQLite file in a fresh folder, removed again when the test ends; and
// the fault-proxy binary in front of a coordinator, for the scenario vectors. It also holds the
// setup the packages' tests share (Main, OnEachStore, NewClient).
package testenv

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Store is where a coordinator keeps its keys.
type Store string

const (
	Postgres Store = "postgres"
	SQLite   Store = "sqlite"
)

// Stores lists both, for tests that run on each.
var Stores = []Store{Postgres, SQLite}

const startupLimit = 60 * time.Second

// RepoRoot is the repository's root folder (this file is clients/go/internal/testenv/testenv.go).
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}

// CoordinatorBinary is IDEMPOTENCY_COORDINATOR_BIN, or the repository's debug build.
func CoordinatorBinary() string {
	if bin := os.Getenv("IDEMPOTENCY_COORDINATOR_BIN"); bin != "" {
		return bin
	}
	return filepath.Join(RepoRoot(), "target", "debug", "idempotency-coordinator")
}

// GatewayCommand is the command that runs the gateway: IDEMPOTENCY_GATEWAY_BIN (or the
// repository's debug build of it) when it exists, else the coordinator's own `gateway`
// subcommand. A binary whose help lists a gateway subcommand gets it.
func GatewayCommand() ([]string, error) {
	bin := os.Getenv("IDEMPOTENCY_GATEWAY_BIN")
	if bin == "" {
		bin = filepath.Join(RepoRoot(), "target", "debug", "idempotency-gateway")
		if _, err := os.Stat(bin); err != nil {
			bin = CoordinatorBinary()
		}
	}
	help, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("no gateway binary at %s (set IDEMPOTENCY_GATEWAY_BIN): %v", bin, err)
	}
	if strings.Contains(string(help), "\n  gateway") {
		return []string{bin, "gateway"}, nil
	}
	return []string{bin}, nil
}

func postgresAdminURL() string {
	if url := os.Getenv("IDEMPOTENCY_TEST_POSTGRES"); url != "" {
		return url
	}
	return "postgres://postgres@127.0.0.1:5432"
}

// childEnv is this process's environment without the settings the binaries read, so that a
// developer's DATABASE_URL cannot turn a SQLite test into a PostgreSQL one.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "IDEMPOTENCY_") || strings.HasPrefix(kv, "DATABASE_URL=") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// Coordinator is one coordinator process; Kill or Stop and then Restart keep its address and
// its store.
type Coordinator struct {
	Addr  string
	Store Store

	dir      string
	database string
	extra    []string
	tls      *tls.Config // how the readiness check connects; nil: plaintext
	proc     *process    // nil while stopped
	log      *LogBuffer
}

// process is a child process of the tests: a coordinator or a gateway.
type process struct {
	what   string // "coordinator", "gateway": for error messages
	cmd    *exec.Cmd
	exited chan struct{} // closed when it has exited
	log    *LogBuffer
}

// startProcess starts what with args, without the settings the binaries read from this process's
// environment, and its output into log.
func startProcess(what string, log *LogBuffer, args ...string) (*process, error) {
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{what: what, cmd: cmd, exited: make(chan struct{}), log: log}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	return p, nil
}

// awaitAddress waits until the process has written its bound address to addressFile (its
// --address-file) and answers it.
func (p *process) awaitAddress(addressFile string, deadline time.Time) (string, error) {
	for {
		if text, err := os.ReadFile(addressFile); err == nil && strings.TrimSpace(string(text)) != "" {
			return strings.TrimSpace(string(text)), nil
		}
		select {
		case <-p.exited:
			return "", fmt.Errorf("the %s exited at start (%v):\n%s", p.what, p.cmd.ProcessState, p.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("the %s wrote no address within %v:\n%s", p.what, startupLimit, p.log)
		}
	}
}

// terminate sends SIGTERM and waits for the exit; after limit it kills the process and answers
// false.
func (p *process) terminate(limit time.Duration) bool {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return true
	case <-time.After(limit):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return false
	}
}

func randomName() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Start starts a coordinator on store for the test, stopped (SIGTERM, exit 0) and its store
// removed when the test ends.
func Start(t testing.TB, store Store, extra ...string) *Coordinator {
	t.Helper()
	return StartTLS(t, store, nil, extra...)
}

// StartTLS is Start for a coordinator that serves TLS (the extra flags say how); clientTLS is how
// the readiness check connects to it.
func StartTLS(t testing.TB, store Store, clientTLS *tls.Config, extra ...string) *Coordinator {
	t.Helper()
	c, err := startCoordinator(store, clientTLS, extra...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// StartCoordinator is Start without a test (for TestMain); Close it.
func StartCoordinator(store Store, extra ...string) (*Coordinator, error) {
	return startCoordinator(store, nil, extra...)
}

func startCoordinator(store Store, clientTLS *tls.Config, extra ...string) (*Coordinator, error) {
	bin := CoordinatorBinary()
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("no coordinator binary at %s: build it (cargo build) or set IDEMPOTENCY_COORDINATOR_BIN", bin)
	}
	dir, err := os.MkdirTemp("", "idc-go-test-")
	if err != nil {
		return nil, err
	}
	c := &Coordinator{Store: store, dir: dir, extra: extra, tls: clientTLS, log: &LogBuffer{}}
	if store == Postgres {
		c.database = "idc_go_" + randomName()
	}
	if err := c.launch("127.0.0.1:0"); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// Dir is a folder of the coordinator's own (removed with it), for files a test makes.
func (c *Coordinator) Dir() string { return c.dir }

// Log is the tail of what the coordinator printed, for explaining a failure.
func (c *Coordinator) Log() string { return c.log.String() }

func (c *Coordinator) launch(listen string) error {
	addressFile := filepath.Join(c.dir, "address-"+randomName())
	args := []string{"serve", "--listen", listen, "--address-file", addressFile,
		"--shutdown-grace", "5s", "--health-check-interval", "200ms"}
	if c.Store == Postgres {
		args = append(args, "--database-url", postgresAdminURL()+"/"+c.database)
	} else {
		args = append(args, "--sqlite-path", filepath.Join(c.dir, "coordinator.db"))
	}
	args = append(append([]string{CoordinatorBinary()}, args...), c.extra...)
	proc, err := startProcess("coordinator", c.log, args...)
	if err != nil {
		return err
	}
	c.proc = proc
	deadline := time.Now().Add(startupLimit)
	addr, err := proc.awaitAddress(addressFile, deadline)
	if err != nil {
		return err
	}
	c.Addr = addr
	return c.awaitServing(deadline)
}

func (c *Coordinator) awaitServing(deadline time.Time) error {
	creds := insecure.NewCredentials()
	if c.tls != nil {
		creds = credentials.NewTLS(c.tls)
	}
	conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		answer, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: "idempotency.v1.IdempotencyService"})
		cancel()
		if err == nil && answer.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the coordinator never became SERVING (%v):\n%s", err, c.Log())
		}
		select {
		case <-c.proc.exited:
			return fmt.Errorf("the coordinator exited (%v):\n%s", c.proc.cmd.ProcessState, c.Log())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Kill ends the coordinator with SIGKILL, as a crash would.
func (c *Coordinator) Kill() {
	if c.proc == nil {
		return
	}
	_ = c.proc.cmd.Process.Signal(syscall.SIGKILL)
	<-c.proc.exited
	c.proc = nil
}

// Stop ends the coordinator with SIGTERM; the contract says it exits 0.
func (c *Coordinator) Stop() error {
	if c.proc == nil {
		return nil
	}
	proc := c.proc
	c.proc = nil
	if !proc.terminate(20 * time.Second) {
		return fmt.Errorf("the coordinator did not stop within 20s of SIGTERM:\n%s", c.Log())
	}
	if code := proc.cmd.ProcessState.ExitCode(); code != 0 {
		return fmt.Errorf("the coordinator exited with %d on SIGTERM:\n%s", code, c.Log())
	}
	return nil
}

// Restart starts the coordinator again on the same address and store.
func (c *Coordinator) Restart() error {
	if c.proc != nil {
		return errors.New("the coordinator is still running")
	}
	// A port just freed by a killed process can take a moment to be free for a new listener.
	var err error
	for range 50 {
		if err = c.launch(c.Addr); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// Close stops the coordinator and removes its store.
func (c *Coordinator) Close() error {
	err := c.Stop()
	if c.database != "" {
		out, dropErr := exec.Command("psql", postgresAdminURL()+"/postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1",
			"-c", fmt.Sprintf(`DROP DATABASE IF EXISTS "%s" WITH (FORCE)`, c.database)).CombinedOutput()
		if dropErr != nil {
			err = errors.Join(err, fmt.Errorf("dropping %s: %v: %s", c.database, dropErr, out))
		}
	}
	return errors.Join(err, os.RemoveAll(c.dir))
}

// Gateway is one gateway process in front of an upstream, deciding through a coordinator.
type Gateway struct {
	URL  string // http://host:port
	proc *process
}

// StartGateway starts the gateway binary for the test: listening on port 0, forwarding to
// upstream (http://host:port), deciding through the coordinator at coordinatorAddr.
func StartGateway(t testing.TB, coordinatorAddr, upstream, namespace string, extra ...string) *Gateway {
	t.Helper()
	command, err := GatewayCommand()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	addressFile := filepath.Join(dir, "address")
	args := append(command, "--listen", "127.0.0.1:0", "--address-file", addressFile,
		"--upstream", upstream, "--coordinator", "http://"+coordinatorAddr, "--namespace", namespace)
	proc, err := startProcess("gateway", &LogBuffer{}, append(args, extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proc.terminate(10 * time.Second) })
	addr, err := proc.awaitAddress(addressFile, time.Now().Add(startupLimit))
	if err != nil {
		t.Fatal(err)
	}
	return &Gateway{URL: "http://" + addr, proc: proc}
}

// Log is the tail of what the gateway printed.
func (g *Gateway) Log() string { return g.proc.log.String() }

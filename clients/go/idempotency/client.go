// Package idempotency is a client of the idempotency coordinator: RunOnce makes the protocol one
// call (claim, wait, replay, heartbeat, Complete or Release), ProcessOnce and MarkProcessed
// deduplicate consumed events, and the plain RPC methods give every call of the contract with Go
// types. See the module's README for every option and error.
package idempotency

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotencyv1"
)

// The defaults every client of the coordinator uses (clients/conformance/defaults.json).
const (
	// DefaultCallTimeout is the deadline of one call; a TryStart that asks the coordinator to
	// wait gets the wait on top.
	DefaultCallTimeout = 10 * time.Second
	// DefaultLeaseTTL is the lease RunOnce asks for.
	DefaultLeaseTTL = 30 * time.Second
	// HeartbeatDivisor: RunOnce extends the lease every lease/HeartbeatDivisor.
	HeartbeatDivisor = 3
	// DefaultWait is how long RunOnce waits for another holder (0: ErrInProgress at once).
	DefaultWait = time.Duration(0)
	// jitterLowFraction: each pause is drawn between this fraction of the step and all of it.
	jitterLowFraction = 0.5
)

// RetryPolicy says how calls that failed with UNAVAILABLE, DEADLINE_EXCEEDED or
// RESOURCE_EXHAUSTED (RATE_LIMITED, OVERLOADED) are sent again: pauses from InitialBackoff,
// growing by Multiplier up to MaxBackoff, each drawn between half the step and all of it, for at
// most Budget in all (pauses included). A RetryInfo from the coordinator lengthens a pause, never
// shortens it.
type RetryPolicy struct {
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Budget         time.Duration
}

// DefaultRetryPolicy is the policy of clients/conformance/defaults.json: 50 ms doubling up to
// 2 s, within 30 s.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{
		InitialBackoff: 50 * time.Millisecond,
		MaxBackoff:     2 * time.Second,
		Multiplier:     2,
		Budget:         30 * time.Second,
	}
}

func (p RetryPolicy) check() error {
	switch {
	case p.InitialBackoff <= 0:
		return errors.New("the retry policy's initial backoff must be positive")
	case p.MaxBackoff < p.InitialBackoff:
		return errors.New("the retry policy's max backoff must be at least its initial backoff")
	case !(p.Multiplier >= 1):
		return errors.New("the retry policy's multiplier must be at least 1")
	case p.Budget < 0:
		return errors.New("the retry budget must not be negative")
	}
	return nil
}

// backoff yields the pauses between tries, each drawn between half and all of the exponential
// step, so that callers that failed together do not retry together.
type backoff struct {
	step time.Duration
	p    RetryPolicy
}

func (b *backoff) next() time.Duration {
	low := float64(b.step) * jitterLowFraction
	pause := time.Duration(low + rand.Float64()*(float64(b.step)-low))
	b.step = min(b.p.MaxBackoff, time.Duration(float64(b.step)*b.p.Multiplier))
	return pause
}

// settings are what Options set; checked once, in New or NewFromConn.
type settings struct {
	token        string
	callTimeout  time.Duration
	retry        RetryPolicy
	leaseTTL     time.Duration
	wait         time.Duration
	logger       *slog.Logger
	tlsOn        bool
	tlsConfig    *tls.Config
	rootCAs      []byte
	clientCert   []byte
	clientKey    []byte
	dialOptions  []grpc.DialOption
	dialSpecific bool
}

// An Option configures a Client; see New.
type Option struct{ apply func(*settings) error }

func option(f func(*settings) error) Option { return Option{apply: f} }

// atLeast is an Option that sets a duration after checking that it is at least low: "the <what>
// must <rule> (got d)" otherwise.
func atLeast(what, rule string, d, low time.Duration, set func(*settings)) Option {
	return option(func(s *settings) error {
		if d < low {
			return fmt.Errorf("the %s must %s (got %v)", what, rule, d)
		}
		set(s)
		return nil
	})
}

// WithToken sends "authorization: Bearer <token>" with every call. It is call metadata rather
// than per-RPC credentials, which grpc-go refuses on plaintext connections (loopback, a mesh).
func WithToken(token string) Option {
	return option(func(s *settings) error {
		if token == "" {
			return errors.New("the token is empty")
		}
		for _, r := range token {
			if r < 0x20 || r > 0x7e {
				return errors.New("the token must be printable ASCII")
			}
		}
		s.token = token
		return nil
	})
}

// WithCallTimeout bounds each call (default 10 s). A TryStart that asks the coordinator to wait
// gets the wait on top.
func WithCallTimeout(d time.Duration) Option {
	return atLeast("call timeout", "be positive", d, time.Nanosecond, func(s *settings) { s.callTimeout = d })
}

// WithRetryBudget bounds all the tries of one call, pauses included (default 30 s; 0: no
// retries).
func WithRetryBudget(d time.Duration) Option {
	return atLeast("retry budget", "not be negative", d, 0, func(s *settings) { s.retry.Budget = d })
}

// WithRetryPolicy replaces the whole retry policy (default DefaultRetryPolicy()).
func WithRetryPolicy(p RetryPolicy) Option {
	return option(func(s *settings) error {
		if err := p.check(); err != nil {
			return err
		}
		s.retry = p
		return nil
	})
}

// WithDefaultLease sets the lease RunOnce asks for when it is not given WithLease (default 30 s;
// 100 ms – 24 h).
func WithDefaultLease(d time.Duration) Option {
	return option(func(s *settings) error {
		if err := checkLease(d); err != nil {
			return err
		}
		s.leaseTTL = d
		return nil
	})
}

// WithDefaultWait sets how long RunOnce waits for another holder when it is not given WithWait
// (default 0: ErrInProgress at once).
func WithDefaultWait(d time.Duration) Option {
	return atLeast("wait", "not be negative", d, 0, func(s *settings) { s.wait = d })
}

// WithLogger receives the client's own events: retries, failed heartbeats, lost leases, claims
// it could not release (default: none). Keys, payloads and tokens are never logged.
func WithLogger(l *slog.Logger) Option {
	return option(func(s *settings) error {
		if l == nil {
			return errors.New("the logger is nil")
		}
		s.logger = l
		return nil
	})
}

// WithTLS turns TLS on, with this configuration (cloned; nil: the system's roots). For mutual
// TLS, put the client's certificate in config.Certificates, or use WithClientCertificatePEM.
// For New only.
func WithTLS(config *tls.Config) Option {
	return option(func(s *settings) error {
		s.tlsOn, s.dialSpecific = true, true
		if config != nil {
			s.tlsConfig = config.Clone()
		}
		return nil
	})
}

// WithRootCAsPEM turns TLS on and trusts these PEM certificates instead of the system's roots.
// For New only.
func WithRootCAsPEM(pem []byte) Option {
	return option(func(s *settings) error {
		s.tlsOn, s.dialSpecific = true, true
		s.rootCAs = pem
		return nil
	})
}

// WithClientCertificatePEM turns mutual TLS on: the client presents this certificate (chain)
// and key, both PEM. For New only.
func WithClientCertificatePEM(certPEM, keyPEM []byte) Option {
	return option(func(s *settings) error {
		s.tlsOn, s.dialSpecific = true, true
		s.clientCert, s.clientKey = certPEM, keyPEM
		return nil
	})
}

// WithDialOptions are passed to grpc.NewClient as they are (after the client's own). For New
// only.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return option(func(s *settings) error {
		s.dialSpecific = true
		s.dialOptions = append(s.dialOptions, opts...)
		return nil
	})
}

// Client is a client of the coordinator. It is safe for concurrent use; Close it when done if
// New made it.
type Client struct {
	rpc   pb.IdempotencyServiceClient
	owned *grpc.ClientConn
	s     settings
	log   *slog.Logger
}

func build(opts []Option) (settings, error) {
	s := settings{
		callTimeout: DefaultCallTimeout,
		retry:       DefaultRetryPolicy(),
		leaseTTL:    DefaultLeaseTTL,
		wait:        DefaultWait,
		logger:      slog.New(slog.DiscardHandler),
	}
	for _, o := range opts {
		if o.apply == nil {
			continue
		}
		if err := o.apply(&s); err != nil {
			return s, fmt.Errorf("idempotency: %w", err)
		}
	}
	return s, nil
}

// New makes a client of the coordinator at target (a gRPC target: "127.0.0.1:50051",
// "dns:///coordinator:50051", "unix:///run/coordinator.sock"). It does not connect: the first
// call does, and a coordinator that cannot be reached is an ErrUnavailable of that call,
// retried like any other.
func New(target string, opts ...Option) (*Client, error) {
	s, err := build(opts)
	if err != nil {
		return nil, err
	}
	creds := insecure.NewCredentials()
	if s.tlsOn {
		config, err := s.tls()
		if err != nil {
			return nil, fmt.Errorf("idempotency: %w", err)
		}
		creds = credentials.NewTLS(config)
	}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, s.dialOptions...)
	conn, err := grpc.NewClient(target, dial...)
	if err != nil {
		return nil, fmt.Errorf("idempotency: target %q: %w", target, err)
	}
	return &Client{rpc: pb.NewIdempotencyServiceClient(conn), owned: conn, s: s, log: s.logger}, nil
}

// NewFromConn makes a client over a connection the caller owns (and closes): a *grpc.ClientConn
// with its own credentials and interceptors, say. TLS and dial options belong to that connection,
// so they are refused here.
func NewFromConn(conn grpc.ClientConnInterface, opts ...Option) (*Client, error) {
	if conn == nil {
		return nil, errors.New("idempotency: the connection is nil")
	}
	s, err := build(opts)
	if err != nil {
		return nil, err
	}
	if s.dialSpecific {
		return nil, errors.New("idempotency: TLS and dial options apply to New only; set them on the connection")
	}
	return &Client{rpc: pb.NewIdempotencyServiceClient(conn), s: s, log: s.logger}, nil
}

// Close closes the connection New made; for a client from NewFromConn it does nothing.
func (c *Client) Close() error {
	if c.owned == nil {
		return nil
	}
	return c.owned.Close()
}

func (s *settings) tls() (*tls.Config, error) {
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.tlsConfig != nil {
		config = s.tlsConfig
	}
	if s.rootCAs != nil {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(s.rootCAs) {
			return nil, errors.New("the root CAs hold no PEM certificate")
		}
		config.RootCAs = pool
	}
	if s.clientCert != nil || s.clientKey != nil {
		cert, err := tls.X509KeyPair(s.clientCert, s.clientKey)
		if err != nil {
			return nil, fmt.Errorf("the client certificate: %w", err)
		}
		config.Certificates = append(config.Certificates, cert)
	}
	return config, nil
}

// retryClass says after which failures a call may be sent again.
type retryClass int

const (
	// retryNever: a heartbeat, whose next beat is the retry.
	retryNever retryClass = iota
	// retryTransient: unreachable, slow, store down, rate limited or overloaded; for calls
	// whose repetition is harmless (TryStart with its attempt_id, Complete with the same
	// response, Release, ExtendLease, Lookup).
	retryTransient
	// retryAtTheDoor: only when refused before anything ran (rate limited, overloaded); for
	// MarkProcessed, whose repetition after a lost answer would report the events as seen.
	retryAtTheDoor
)

func (r retryClass) allows(e *Error) bool {
	switch r {
	case retryTransient:
		return e.transient()
	case retryAtTheDoor:
		return e.refusedAtTheDoor()
	}
	return false
}

// attempt is one try of a call: how long beyond the call timeout the coordinator may hold it (a
// TryStart's wait), and how to send it.
type attempt func() (held time.Duration, send func(context.Context) error)

// call sends a call, and sends it again while class allows, within the retry budget. Each try is
// made afresh by try, so that a TryStart never asks to wait past the caller's limit.
func (c *Client) call(ctx context.Context, op string, class retryClass, try attempt) error {
	return c.callUntil(ctx, op, class, time.Time{}, try)
}

// callUntil is call that also stops retrying at until (zero: the budget alone): for a call that
// is pointless once a lease may have run out. The first try is always sent.
func (c *Client) callUntil(ctx context.Context, op string, class retryClass, until time.Time, try attempt) error {
	if c.s.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.s.token)
	}
	giveUpAt := time.Now().Add(c.s.retry.Budget)
	if !until.IsZero() && until.Before(giveUpAt) {
		giveUpAt = until
	}
	pauses := backoff{step: c.s.retry.InitialBackoff, p: c.s.retry}
	for {
		held, send := try()
		tryCtx, cancel := context.WithTimeout(ctx, c.s.callTimeout+held)
		err := send(tryCtx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return gaveUp(ctx, op, "") // The caller gave up: no retry can help it.
		}
		e := c.callError(op, err)
		pause := max(pauses.next(), e.RetryDelay)
		if !class.allows(e) || time.Now().Add(pause).After(giveUpAt) {
			return e
		}
		c.log.InfoContext(ctx, "idempotency: call failed; retrying", "rpc", op, "code", e.Code.String(), "reason", e.Reason, "pause", pause)
		timer := time.NewTimer(pause)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return gaveUp(ctx, op, "while pausing before a retry after "+e.Error())
		}
	}
}

func (c *Client) callError(op string, err error) *Error {
	st, ok := status.FromError(err)
	if !ok {
		st = status.New(codes.Unknown, err.Error())
	}
	return fromStatus(op, st)
}

// unary sends req with method through c.call, the same way on every try, and answers the
// coordinator's response.
func unary[Req, Resp any](ctx context.Context, c *Client, op string, class retryClass,
	method func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	var answer Resp
	err := c.call(ctx, op, class, func() (time.Duration, func(context.Context) error) {
		return 0, func(ctx context.Context) (err error) {
			answer, err = method(ctx, req)
			return err
		}
	})
	return answer, err
}

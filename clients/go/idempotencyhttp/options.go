package idempotencyhttp

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// The gateway's defaults and bounds (docs/gateway.md, "Settings").
const (
	DefaultHeader            = "Idempotency-Key"
	DefaultMaxKeyLength      = 128
	MaxKeyLength             = 190 // room for the identity scope in the coordinator's 255 bytes
	DefaultWait              = 5 * time.Second
	DefaultLease             = 30 * time.Second
	DefaultRetention         = 24 * time.Hour
	DefaultMaxRequestBytes   = 1 << 20
	DefaultMaxStoredResponse = 1 << 20
	minBodyLimit             = 1 << 10
	maxBodyLimit             = 64 << 20
)

type config struct {
	namespace      string
	header         string
	methods        map[string]bool
	requireKey     []string
	maxKeyLength   int
	identityHeader string
	wait           time.Duration
	lease          time.Duration
	retention      time.Duration
	maxRequest     int
	maxStored      int
	failOpen       bool
	log            *slog.Logger
}

// An Option configures the middleware; see New.
type Option struct{ apply func(*config) error }

// bounded is an Option that sets a number after checking that it is within [low, high]: "the
// <what> must be <bounds> (got v)" otherwise.
func bounded[T int | time.Duration](what, bounds string, v, low, high T, set func(*config, T)) Option {
	return Option{func(c *config) error {
		if v < low || v > high {
			return fmt.Errorf("the %s must be %s (got %v)", what, bounds, v)
		}
		set(c, v)
		return nil
	}}
}

// WithHeader reads the key from this header instead of Idempotency-Key.
func WithHeader(name string) Option {
	return Option{func(c *config) error {
		if name == "" || len(name) > 64 || !validHeaderName([]byte(name)) {
			return fmt.Errorf("the key header must be a header name of 1-64 characters (got %q)", name)
		}
		c.header = name
		return nil
	}}
}

// WithMethods guards these methods (in capitals) instead of POST and PATCH; the others pass
// through.
func WithMethods(methods ...string) Option {
	return Option{func(c *config) error {
		if len(methods) == 0 || len(methods) > 16 {
			return errors.New("give 1-16 methods")
		}
		c.methods = map[string]bool{}
		for _, m := range methods {
			if m == "" || strings.ToUpper(m) != m || !validHeaderName([]byte(m)) {
				return fmt.Errorf("the method %q is not a method in capitals", m)
			}
			c.methods[m] = true
		}
		return nil
	}}
}

// WithRequiredKey refuses (400, key-missing) guarded requests without a key whose path starts
// with one of these prefixes; elsewhere they pass through without idempotency.
func WithRequiredKey(prefixes ...string) Option {
	return Option{func(c *config) error {
		if len(prefixes) > 64 {
			return errors.New("give at most 64 path prefixes")
		}
		for _, p := range prefixes {
			if !strings.HasPrefix(p, "/") || strings.Contains(p, "?") || len(p) > 1024 {
				return fmt.Errorf("the prefix %q must start with / and hold no ?", p)
			}
		}
		c.requireKey = append(c.requireKey, prefixes...)
		return nil
	}}
}

// WithMaxKeyLength refuses longer keys (default 128; 1-190 bytes).
func WithMaxKeyLength(n int) Option {
	return bounded("key length limit", fmt.Sprintf("1-%d bytes", MaxKeyLength), n, 1, MaxKeyLength,
		func(c *config, n int) { c.maxKeyLength = n })
}

// WithIdentityHeader scopes keys to the caller named by this header (an API key, a user id):
// the key is stored as hex(SHA-256(identity)):key, and requests without the header get 400.
func WithIdentityHeader(name string) Option {
	return Option{func(c *config) error {
		if name == "" || !validHeaderName([]byte(name)) {
			return fmt.Errorf("%q is not a header name", name)
		}
		c.identityHeader = name
		return nil
	}}
}

// WithWait is how long a request waits for another one with its key to finish before 409
// (default 5 s; 0-60 s).
func WithWait(d time.Duration) Option {
	return bounded("wait", "0-60s", d, 0, idempotency.MaxServerWait,
		func(c *config, d time.Duration) { c.wait = d })
}

// WithLease is the claim's lease (default 30 s; 100 ms-24 h), renewed every third of it.
func WithLease(d time.Duration) Option {
	return bounded("lease", "100ms-24h", d, idempotency.MinLease, idempotency.MaxLease,
		func(c *config, d time.Duration) { c.lease = d })
}

// WithRetention is how long a key and its response are kept (default 24 h; 1 s-30 d).
func WithRetention(d time.Duration) Option {
	return bounded("retention", "1s-30d", d, idempotency.MinRetention, idempotency.MaxRetention,
		func(c *config, d time.Duration) { c.retention = d })
}

// WithMaxRequestBytes refuses larger bodies with 413 (default 1 MiB; 1 KiB-64 MiB).
func WithMaxRequestBytes(n int) Option {
	return bounded("request limit", "1KiB-64MiB", n, minBodyLimit, maxBodyLimit,
		func(c *config, n int) { c.maxRequest = n })
}

// WithMaxStoredResponseBytes is the largest response stored for replay, counted as stored
// (status, headers and body; default 1 MiB; 1 KiB-64 MiB). A larger one reaches its caller
// whole, with Idempotency-Warning: not-replayable, and is never run again: a retry gets 500
// response-not-replayable. Keep it at most the coordinator's --max-response-bytes.
func WithMaxStoredResponseBytes(n int) Option {
	return bounded("stored response limit", "1KiB-64MiB", n, minBodyLimit, maxBodyLimit,
		func(c *config, n int) { c.maxStored = n })
}

// WithFailOpen runs the handler without idempotency (Idempotency-Warning: not-deduplicated)
// when the coordinator is unavailable, instead of answering 503.
func WithFailOpen() Option {
	return Option{func(c *config) error { c.failOpen = true; return nil }}
}

// WithLogger receives the middleware's own events (default: none).
func WithLogger(l *slog.Logger) Option {
	return Option{func(c *config) error {
		if l == nil {
			return errors.New("the logger is nil")
		}
		c.log = l
		return nil
	}}
}

// newConfig is the configuration of a middleware for namespace: the gateway's defaults, then
// opts in order.
func newConfig(namespace string, opts []Option) (config, error) {
	c := config{
		namespace:    namespace,
		header:       DefaultHeader,
		methods:      map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		maxKeyLength: DefaultMaxKeyLength,
		wait:         DefaultWait,
		lease:        DefaultLease,
		retention:    DefaultRetention,
		maxRequest:   DefaultMaxRequestBytes,
		maxStored:    DefaultMaxStoredResponse,
		log:          slog.New(slog.DiscardHandler),
	}
	if err := checkNamespace(namespace); err != nil {
		return config{}, err
	}
	for _, o := range opts {
		if o.apply == nil {
			continue
		}
		if err := o.apply(&c); err != nil {
			return config{}, fmt.Errorf("idempotencyhttp: %w", err)
		}
	}
	return c, nil
}

func checkNamespace(ns string) error {
	if ns == "" || len(ns) > idempotency.MaxScopeLength {
		return fmt.Errorf("idempotencyhttp: the namespace must be 1-64 characters (got %d)", len(ns))
	}
	for i := 0; i < len(ns); i++ {
		if c := ns[i]; !isAlnum(c) && !strings.ContainsRune("._-:", rune(c)) {
			return errors.New("idempotencyhttp: the namespace may hold only the characters A-Z a-z 0-9 . _ - and colon")
		}
	}
	return nil
}

// Package idempotencyhttp is the HTTP gateway of the idempotency coordinator (docs/gateway.md)
// as net/http middleware: it gives a handler the semantics of the Idempotency-Key header
// (draft-ietf-httpapi-idempotency-key-header) in-process, with the gateway's fingerprint, stored
// record and problem+json answers, so that a key recorded through the gateway is replayed by the
// middleware and the other way round.
package idempotencyhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// Headers the middleware reads or writes, as the gateway does.
const (
	// LeaseTokenHeader is set on every guarded request the handler gets: the fencing token of
	// the claim it runs under (a client's own header of this name is removed first).
	LeaseTokenHeader = "Idempotency-Lease-Token"
	// ReplayedHeader is "true" on a response replayed from the coordinator.
	ReplayedHeader = "Idempotent-Replayed"
	// WarningHeader says what the middleware could not do for a response: "not-replayable",
	// "not-recorded" or "not-deduplicated".
	WarningHeader = "Idempotency-Warning"
)

// New makes the middleware for namespace. The coordinator calls go through client, with its
// call timeout and retry budget: the gateway's budget is 2 s (--coordinator-retry), which
// idempotency.WithRetryBudget(2*time.Second) gives.
func New(client *idempotency.Client, namespace string, opts ...Option) (func(http.Handler) http.Handler, error) {
	if client == nil {
		return nil, errors.New("idempotencyhttp: the client is nil")
	}
	c, err := newConfig(namespace, opts)
	if err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		return &middleware{config: c, client: client, next: next}
	}, nil
}

type leaseKey struct{}

// LeaseFrom returns the claim a guarded request runs under, from the request's context. The
// context is cancelled when the lease is lost (context.Cause matches idempotency.ErrLeaseLost).
func LeaseFrom(ctx context.Context) (*idempotency.Lease, bool) {
	l, ok := ctx.Value(leaseKey{}).(*idempotency.Lease)
	return l, ok
}

type middleware struct {
	config
	client *idempotency.Client
	next   http.Handler
}

// ran is what the work leaves behind for the cases where RunOnce does not return its result.
type ran struct {
	started  bool
	recorder *recorder
}

// notFinal is the work's error for an answer that is not the request's outcome (5xx, 408, 409,
// 425, 429, 1xx, 3xx): the claim is released so that a retry runs again, and the answer is sent.
type notFinal struct{}

func (notFinal) Error() string { return "the handler's answer is not final" }

func (m *middleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !m.methods[r.Method] {
		m.next.ServeHTTP(w, r)
		return
	}
	key, keyErr, detail := readKey(r.Header.Values(m.header), m.maxKeyLength)
	switch keyErr {
	case keyMissing:
		if !m.requiresKey(requestTarget(r)) {
			m.next.ServeHTTP(w, r)
			return
		}
		problemKeyMissing.write(w, fmt.Sprintf("%s requests to this path need a %s header", r.Method, strings.ToLower(m.header)), 0, nil)
		return
	case keyRepeated:
		problemKeyRepeated.write(w, fmt.Sprintf("send one %s header, not several", strings.ToLower(m.header)), 0, nil)
		return
	case keyMalformed:
		problemKeyMalformed.write(w, detail, 0, nil)
		return
	}
	var identity []byte
	if m.identityHeader != "" {
		values := r.Header.Values(m.identityHeader)
		if len(values) == 0 {
			problemIdentityMissing.write(w, fmt.Sprintf("requests with a key need a %s header", strings.ToLower(m.identityHeader)), 0, nil)
			return
		}
		identity = []byte(strings.Join(values, "\n"))
	}
	body, tooLarge, err := m.readBody(r)
	switch {
	case tooLarge:
		problemRequestTooLarge.write(w, fmt.Sprintf("the body is larger than %d bytes", m.maxRequest), 0, nil)
		return
	case err != nil:
		problemRequestUnreadable.write(w, "the request body could not be read: "+err.Error(), 0, nil)
		return
	}
	fp := fingerprint(r.Method, requestTarget(r), r.Header.Get("Content-Type"), body)
	stored := scopedKey(identity, m.identityHeader != "", key)

	var state ran
	outcome, err := idempotency.RunOnce(r.Context(), m.client, m.namespace, stored, nil,
		func(ctx context.Context, lease *idempotency.Lease) (record, error) {
			return m.forward(ctx, lease, w, r, body, &state)
		},
		idempotency.WithFingerprint(fp),
		idempotency.WithCodec[record](recordCodec{}),
		idempotency.WithLease(m.lease),
		idempotency.WithRetention(m.retention),
		idempotency.WithWait(m.wait),
	)
	switch {
	case err == nil && outcome.Replayed:
		replay(w, outcome.Value)
	case err == nil, errors.As(err, new(notFinal)):
		state.recorder.send("")
	default:
		m.refused(w, r, err, &state, body)
	}
}

// readBody reads the request's body, refusing one over the limit (tooLarge): before reading it
// when its length is announced, else once the limit is passed.
func (m *middleware) readBody(r *http.Request) (body []byte, tooLarge bool, err error) {
	if r.ContentLength > int64(m.maxRequest) {
		return nil, true, nil
	}
	body, err = io.ReadAll(io.LimitReader(r.Body, int64(m.maxRequest)+1))
	return body, err == nil && len(body) > m.maxRequest, err
}

func (m *middleware) requiresKey(target string) bool {
	path, _, _ := strings.Cut(target, "?")
	for _, prefix := range m.requireKey {
		if strings.HasPrefix(path, prefix) {
			return true
		}
	}
	return false
}

// forward is the work RunOnce runs under the claim: the handler, with the claim's lease token and
// a recorder that keeps its answer.
func (m *middleware) forward(ctx context.Context, lease *idempotency.Lease, w http.ResponseWriter, r *http.Request, body []byte, state *ran) (record, error) {
	state.started = true
	inner := handlerRequest(context.WithValue(ctx, leaseKey{}, lease), r, body)
	inner.Header.Set(LeaseTokenHeader, strconv.FormatUint(lease.Token, 10))
	rec := &recorder{w: w, header: http.Header{}, limit: m.maxStored}
	state.recorder = rec
	m.next.ServeHTTP(rec, inner)
	rec.finish()
	if !isFinal(rec.status) {
		return record{}, notFinal{}
	}
	if rec.streaming {
		return record{status: rec.status, headers: rec.fields, tooLarge: true}, nil
	}
	return record{status: rec.status, headers: rec.fields, body: rec.body.Bytes()}, nil
}

// handlerRequest is r as the handler gets it, under ctx: its body (read already) to read again,
// and without a lease token header of the client's own.
func handlerRequest(ctx context.Context, r *http.Request, body []byte) *http.Request {
	inner := r.Clone(ctx)
	inner.Header.Del(LeaseTokenHeader)
	inner.Body = io.NopCloser(bytes.NewReader(body))
	inner.ContentLength = int64(len(body))
	return inner
}

// refused answers when RunOnce failed on the coordinator's side, as the gateway does.
func (m *middleware) refused(w http.ResponseWriter, r *http.Request, err error, state *ran, body []byte) {
	rec := state.recorder
	if rec != nil && rec.streaming {
		// The answer is on its way already; nothing can be added to it.
		m.log.Warn("idempotencyhttp: a streamed response could not be settled", "error", err)
		return
	}
	var notStored *idempotency.ResultNotStoredError[record]
	switch {
	case errors.Is(err, idempotency.ErrLeaseLost):
		m.log.Warn("idempotencyhttp: the lease was lost while the handler ran", "error", err)
		problemLeaseLost.write(w, "another request took the key over while this one ran; retry to get its result", time.Second, nil)
	case errors.As(err, &notStored):
		// The handler ran and answered, but the answer could not be stored: the caller gets it,
		// told that a retry after the lease may run the request again.
		m.log.Warn("idempotencyhttp: the response could not be stored", "error", err)
		rec.send("not-recorded")
	case state.started:
		problemLeaseLost.write(w, "the request ran, but its claim could not be settled", time.Second, nil)
	case errors.Is(err, idempotency.ErrInProgress):
		var busy *idempotency.InProgressError
		errors.As(err, &busy)
		after := min(busy.RetryAfter, max(m.wait, time.Second))
		problemInProgress.write(w, "another request with this key is still running after "+rustDuration(m.wait), after, nil)
	case errors.Is(err, idempotency.ErrMismatch):
		problemKeyReused.write(w, "this key was used for a request with another method, path, content type or body", 0, nil)
	case errors.Is(err, idempotency.ErrInvalidArgument):
		message := err.Error()
		var e *idempotency.Error
		if errors.As(err, &e) {
			message = e.Message
		}
		problemKeyMalformed.write(w, message, 0, nil)
	case errors.As(err, new(*decodeError)):
		m.log.Error("idempotencyhttp: a stored response cannot be decoded", "error", err)
		problemStoredUnreadable.write(w, "the response stored for this key was not written by the gateway", 0, nil)
	case errors.Is(err, idempotency.ErrUnavailable), errors.Is(err, idempotency.ErrDeadline),
		errors.Is(err, idempotency.ErrRateLimited), errors.Is(err, idempotency.ErrOverloaded):
		if m.failOpen {
			m.log.Warn("idempotencyhttp: coordinator unavailable; running without idempotency", "error", err)
			w.Header().Set(WarningHeader, "not-deduplicated")
			m.next.ServeHTTP(w, handlerRequest(r.Context(), r, body))
			return
		}
		m.log.Warn("idempotencyhttp: coordinator unavailable; refusing", "error", err)
		after := time.Second
		var e *idempotency.Error
		if errors.As(err, &e) && e.RetryDelay > 0 {
			after = e.RetryDelay
		}
		problemUnavailable.write(w, "the gateway cannot reach the idempotency coordinator; retry later", after, nil)
	default:
		m.log.Error("idempotencyhttp: the coordinator refused the middleware", "error", err)
		problemRefused.write(w, err.Error(), 0, nil)
	}
}

// isFinal: the outcome of the request (2xx, and 4xx other than 408, 409, 425 and 429), stored
// and replayed. Anything else may go otherwise on a retry.
func isFinal(status int) bool {
	if status >= 200 && status < 300 {
		return true
	}
	return status >= 400 && status < 500 && status != 408 && status != 409 && status != 425 && status != 429
}

// requestTarget is the path and query as the client sent them (the gateway's path_and_query).
func requestTarget(r *http.Request) string {
	target := r.RequestURI
	if target == "" {
		return r.URL.RequestURI()
	}
	if strings.HasPrefix(target, "/") {
		return target
	}
	// Absolute form (http://host/path?query): the part after the authority.
	if _, rest, ok := strings.Cut(target, "://"); ok {
		if i := strings.IndexAny(rest, "/?"); i >= 0 {
			if rest[i] == '?' {
				return "/" + rest[i:]
			}
			return rest[i:]
		}
	}
	return "/"
}

package idempotencyhttp

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// problem is one of the answers the middleware makes itself: RFC 9457 problem+json documents
// with the gateway's types, titles and statuses (gateway/src/problem.rs, docs/gateway.md).
type problem struct {
	status int
	slug   string
	title  string
}

// ProblemTypePrefix starts every problem's type.
const ProblemTypePrefix = "urn:idempotency-gateway:problem:"

var (
	problemKeyMissing        = problem{400, "key-missing", "An idempotency key is required"}
	problemKeyRepeated       = problem{400, "key-repeated", "The idempotency key header appears more than once"}
	problemKeyMalformed      = problem{400, "key-malformed", "The idempotency key is malformed"}
	problemIdentityMissing   = problem{400, "identity-missing", "The caller's identity header is missing"}
	problemRequestTooLarge   = problem{413, "request-too-large", "The request body is too large"}
	problemRequestUnreadable = problem{400, "request-unreadable", "The request body could not be read"}
	problemKeyReused         = problem{422, "key-reused", "The idempotency key was used for a different request"}
	problemInProgress        = problem{409, "in-progress", "A request with this idempotency key is being processed"}
	problemLeaseLost         = problem{409, "lease-lost", "The request's claim on the key was lost"}
	problemUnavailable       = problem{503, "coordinator-unavailable", "The idempotency coordinator is unavailable"}
	problemRefused           = problem{500, "coordinator-refused", "The idempotency coordinator refused the gateway"}
	problemNotReplayable     = problem{500, "response-not-replayable", "The response to this key cannot be replayed"}
	problemStoredUnreadable  = problem{500, "stored-response-unreadable", "The stored response cannot be read"}
)

// write answers the problem, with Retry-After when retryAfter > 0 and extra members.
func (p problem) write(w http.ResponseWriter, detail string, retryAfter time.Duration, extra map[string]any) {
	members := map[string]any{}
	for k, v := range extra {
		members[k] = v
	}
	members["type"] = ProblemTypePrefix + p.slug
	members["title"] = p.title
	members["status"] = p.status
	members["detail"] = detail
	// encoding/json sorts map keys, as the gateway's serde_json map does; no HTML escaping,
	// which serde_json does not do either.
	var body bytes.Buffer
	enc := json.NewEncoder(&body)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(members) // strings and ints only: it cannot fail
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(body.Len()-1))
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(retryAfterSeconds(retryAfter), 10))
	}
	w.WriteHeader(p.status)
	_, _ = w.Write(bytes.TrimSuffix(body.Bytes(), []byte("\n")))
}

// retryAfterSeconds: whole seconds, rounded up, at least 1 (0 would invite a busy loop).
func retryAfterSeconds(d time.Duration) int64 {
	seconds := int64(d / time.Second)
	if d%time.Second > 0 {
		seconds++
	}
	return max(1, seconds)
}

// rustDuration writes d as Rust's Debug for Duration does ("5s", "1.5s", "250ms"), so that the
// middleware's details read like the gateway's.
func rustDuration(d time.Duration) string {
	format := func(whole int64, frac int64, fracDigits int, unit string) string {
		s := strconv.FormatInt(whole, 10)
		if frac > 0 {
			f := strconv.FormatInt(frac, 10)
			for len(f) < fracDigits {
				f = "0" + f
			}
			for f[len(f)-1] == '0' {
				f = f[:len(f)-1]
			}
			s += "." + f
		}
		return s + unit
	}
	n := d.Nanoseconds()
	switch {
	case n >= 1e9:
		return format(n/1e9, n%1e9, 9, "s")
	case n >= 1e6:
		return format(n/1e6, n%1e6, 6, "ms")
	case n >= 1e3:
		return format(n/1e3, n%1e3, 3, "µs")
	}
	return format(n, 0, 0, "ns")
}

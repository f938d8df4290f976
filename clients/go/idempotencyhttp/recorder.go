package idempotencyhttp

import (
	"bytes"
	"maps"
	"net/http"
)

// recorder is the handler's ResponseWriter: it keeps the answer until the claim is settled
// (stored, or released for an answer that is not final) and then sends it. An answer larger
// than the stored limit is streamed to the caller as it comes instead.
type recorder struct {
	w       http.ResponseWriter
	header  http.Header
	limit   int
	status  int
	fields  []headerField // the headers as stored, fixed when the status is
	sent    http.Header   // the headers as the handler set them, fixed likewise
	body    bytes.Buffer
	size    int // the record's size so far
	sniffed bool
	// streaming: over the limit; what was kept and what follows go straight to the caller.
	streaming bool
	done      bool
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.status != 0 || r.done {
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		// Informational answers (103 Early Hints) pass at once, as net/http sends them.
		maps.Copy(r.w.Header(), r.header)
		r.w.WriteHeader(code)
		return
	}
	r.status = code
	r.sent = r.header.Clone()
	r.fields = headerFields(r.sent)
	r.size = encodedLen(r.fields, 0)
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.done {
		return 0, http.ErrHandlerTimeout
	}
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if r.streaming {
		return r.w.Write(p)
	}
	r.sniff(p)
	if r.size+len(p) > r.limit {
		r.stream()
		return r.w.Write(p)
	}
	r.size += len(p)
	return r.body.Write(p)
}

// Flush sends what was written so far when streaming; while the answer is kept it cannot be
// sent yet, so it is a no-op.
func (r *recorder) Flush() {
	if r.streaming {
		_ = http.NewResponseController(r.w).Flush()
	}
}

// sniff gives a body without a Content-Type the one net/http would have sent for it, so that
// the stored response and its replays carry it too.
func (r *recorder) sniff(p []byte) {
	if r.sniffed || len(p) == 0 {
		return
	}
	r.sniffed = true
	if _, ok := r.sent["Content-Type"]; ok {
		return
	}
	if r.sent.Get("Content-Encoding") != "" {
		return
	}
	sample := append(r.body.Bytes()[:r.body.Len():r.body.Len()], p...)
	if len(sample) > 512 {
		sample = sample[:512]
	}
	contentType := http.DetectContentType(sample)
	r.sent.Set("Content-Type", contentType)
	r.fields = headerFields(r.sent)
	r.size = encodedLen(r.fields, r.body.Len())
}

// stream starts sending the answer, over the storable limit: a final one is marked
// not-replayable (the key is completed with a marker), one that is not final goes as it is.
func (r *recorder) stream() {
	warning := ""
	if isFinal(r.status) {
		warning = "not-replayable"
	}
	r.writeKept(warning)
	r.streaming = true
	r.body = bytes.Buffer{}
}

// finish ends the handler's turn: later writes (from goroutines it left behind) are refused.
func (r *recorder) finish() {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	r.done = true
}

// send writes the kept answer to the caller, with a warning if given.
func (r *recorder) send(warning string) {
	if r == nil || r.streaming {
		return
	}
	r.writeKept(warning)
}

// writeKept writes the headers as the handler set them (and the warning, if given), the status
// and the body kept so far.
func (r *recorder) writeKept(warning string) {
	h := r.w.Header()
	maps.Copy(h, r.sent)
	if warning != "" {
		h.Set(WarningHeader, warning)
	}
	r.w.WriteHeader(r.status)
	_, _ = r.w.Write(r.body.Bytes())
}

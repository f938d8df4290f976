package idempotencyhttp

import (
	"encoding/binary"
	"errors"
	"net/http"
	"slices"
	"strings"
)

// The stored record, byte for byte the gateway's (gateway/src/record.rs), so that a key recorded
// by one is replayed by the other: kind (1 byte: 1 response, 2 too large to keep), status (u16),
// the number of headers (u16), each header's name (u16 length + bytes, lower case) and value
// (u32 length + bytes), then the body (the rest; empty for the marker). Numbers big-endian.
const (
	kindResponse = 1
	kindTooLarge = 2
)

// record is a response as stored and replayed.
type record struct {
	status   int
	headers  []headerField // in order; a name may repeat
	body     []byte
	tooLarge bool
}

type headerField struct{ name, value string }

// replay answers the stored response as it was: status, headers and body, and
// Idempotent-Replayed: true.
func replay(w http.ResponseWriter, rec record) {
	if rec.tooLarge {
		w.Header().Set(ReplayedHeader, "true")
		problemNotReplayable.write(w, "the request ran once; its response was larger than the gateway stores, so it cannot be sent again",
			0, map[string]any{"original_status": rec.status})
		return
	}
	h := w.Header()
	for _, f := range rec.headers {
		h.Del(f.name)
	}
	for _, f := range rec.headers {
		h.Add(f.name, f.value)
	}
	if _, ok := h["Content-Type"]; !ok {
		h["Content-Type"] = nil // as stored: no type, and none sniffed
	}
	h.Set(ReplayedHeader, "true")
	w.WriteHeader(rec.status)
	_, _ = w.Write(rec.body)
}

// headerFields lists h as the gateway stores headers: lower-case names, sorted (Go's headers
// have no order of their own), each name's values in order, hop-by-hop headers left out.
func headerFields(h http.Header) []headerField {
	hop := hopByHop(h)
	names := make([]string, 0, len(h))
	for name := range h {
		if !hop[strings.ToLower(name)] {
			names = append(names, name)
		}
	}
	slices.SortFunc(names, func(a, b string) int { return strings.Compare(strings.ToLower(a), strings.ToLower(b)) })
	var fields []headerField
	for _, name := range names {
		for _, v := range h[name] {
			fields = append(fields, headerField{strings.ToLower(name), v})
		}
	}
	return fields
}

// encodedLen is how many bytes a record with these headers and a body of bodyLen takes.
func encodedLen(fields []headerField, bodyLen int) int {
	n := 1 + 2 + 2 + bodyLen
	for _, f := range fields {
		n += 2 + len(f.name) + 4 + len(f.value)
	}
	return n
}

func (r *record) encode() ([]byte, error) {
	body := r.body
	kind := byte(kindResponse)
	if r.tooLarge {
		body, kind = nil, kindTooLarge
	}
	if len(r.headers) > 0xffff || r.status < 0 || r.status > 0xffff {
		return nil, errors.New("the response has too many headers to store")
	}
	out := make([]byte, 0, encodedLen(r.headers, len(body)))
	out = append(out, kind)
	out = binary.BigEndian.AppendUint16(out, uint16(r.status))
	out = binary.BigEndian.AppendUint16(out, uint16(len(r.headers)))
	for _, f := range r.headers {
		if len(f.name) > 0xffff || uint64(len(f.value)) > 0xffffffff {
			return nil, errors.New("a header is too long to store")
		}
		out = binary.BigEndian.AppendUint16(out, uint16(len(f.name)))
		out = append(out, f.name...)
		out = binary.BigEndian.AppendUint32(out, uint32(len(f.value)))
		out = append(out, f.value...)
	}
	return append(out, body...), nil
}

type recordCodec struct{}

func (recordCodec) Encode(r record) ([]byte, error) { return r.encode() }

func (recordCodec) Decode(data []byte) (record, error) {
	r, err := decodeRecord(data)
	if err != nil {
		return record{}, &decodeError{err}
	}
	return r, nil
}

type decodeError struct{ err error }

func (e *decodeError) Error() string { return "the stored response cannot be read: " + e.err.Error() }
func (e *decodeError) Unwrap() error { return e.err }

var errNotARecord = errors.New("not a response stored by the gateway")

func decodeRecord(data []byte) (record, error) {
	in := reader(data)
	kind, err := in.take(1)
	if err != nil {
		return record{}, errNotARecord
	}
	var r record
	switch kind[0] {
	case kindResponse:
	case kindTooLarge:
		r.tooLarge = true
	default:
		return record{}, errNotARecord
	}
	status, err := in.number(2)
	if err != nil {
		return record{}, err
	}
	if status < 100 || status > 999 {
		return record{}, errors.New("the stored status is not an HTTP status")
	}
	r.status = status
	count, err := in.number(2)
	if err != nil {
		return record{}, err
	}
	for range count {
		name, err := in.prefixed(2)
		if err != nil {
			return record{}, err
		}
		value, err := in.prefixed(4)
		if err != nil {
			return record{}, err
		}
		if !validHeaderName(name) || !validHeaderValue(value) {
			return record{}, errors.New("the stored response has an invalid header")
		}
		r.headers = append(r.headers, headerField{string(name), string(value)})
	}
	r.body = []byte(in)
	return r, nil
}

type reader []byte

var errTruncated = errors.New("the stored response is truncated")

func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || len(*r) < n {
		return nil, errTruncated
	}
	head := (*r)[:n]
	*r = (*r)[n:]
	return head, nil
}

// number reads a big-endian unsigned number of size bytes (2 or 4).
func (r *reader) number(size int) (int, error) {
	b, err := r.take(size)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, c := range b {
		n = n<<8 | int(c)
	}
	return n, nil
}

// prefixed reads bytes preceded by their length, a number of lengthSize bytes.
func (r *reader) prefixed(lengthSize int) ([]byte, error) {
	n, err := r.number(lengthSize)
	if err != nil {
		return nil, err
	}
	return r.take(n)
}

// validHeaderName: RFC 9110 token characters (the gateway stores lower case ones).
func validHeaderName(name []byte) bool {
	if len(name) == 0 {
		return false
	}
	for _, c := range name {
		if !isTchar(c) {
			return false
		}
	}
	return true
}

// validHeaderValue: visible characters, spaces, tabs and obs-text, as hyper's HeaderValue.
func validHeaderValue(value []byte) bool {
	for _, c := range value {
		if c < 0x20 && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// hopByHop names the headers that belong to one connection (RFC 9110, 7.6.1) and those the
// Connection header names; they are never stored nor replayed.
func hopByHop(h http.Header) map[string]bool {
	hop := map[string]bool{
		"connection": true, "keep-alive": true, "proxy-connection": true, "proxy-authenticate": true,
		"proxy-authorization": true, "te": true, "trailer": true, "transfer-encoding": true, "upgrade": true,
	}
	for _, v := range h.Values("Connection") {
		for name := range strings.SplitSeq(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				hop[strings.ToLower(name)] = true
			}
		}
	}
	return hop
}

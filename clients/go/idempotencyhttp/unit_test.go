package idempotencyhttp

import (
	"bytes"
	"encoding/binary"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func read(values ...string) (string, keyError) {
	key, err, _ := readKey(values, 16)
	return key, err
}

// The gateway's own cases (gateway/src/key.rs).
func TestKeysAreReadAsTheGatewayReadsThem(t *testing.T) {
	for raw, want := range map[string]string{
		`"abc"`: "abc", `"a \"b\""`: `a "b"`, `"abc";v=1`: "abc", "abc-1": "abc-1",
		"8e03978e-40d5": "8e03978e-40d5", "123": "123", "  ab+/= ": "ab+/=",
		`"0123456789abcdef"`: "0123456789abcdef", "abc;v=1": "abc", `"x";a=?1;b=:YWJj:;c=1.5;d=@1;e=%"%c3%a9"`: "x",
		"1.5": "1.5", ":YWJj:": ":YWJj:", "*tok/en:x": "*tok/en:x",
	} {
		if got, err := read(raw); err != 0 || got != want {
			t.Errorf("%q: got %q (%d), want %q", raw, got, err, want)
		}
	}
	if _, err := read(); err != keyMissing {
		t.Error("no header: not missing")
	}
	if _, err := read(`"a"`, `"b"`); err != keyRepeated {
		t.Error("two headers: not repeated")
	}
	for _, raw := range []string{`""`, "", `"abc`, `"a", "b"`, "a b", `"0123456789abcdefg"`, "?1", `"a\x"`, `"é"`,
		"123;a=1", `"x";d=@1.5`, `"x";A=1`, "a\x01b"} {
		if got, err := read(raw); err != keyMalformed {
			t.Errorf("%q: got %q (%d), want malformed", raw, got, err)
		}
	}
}

func TestIdentitiesScopeKeysWithoutShowingThem(t *testing.T) {
	alice := scopedKey([]byte("alice"), true, "k")
	if alice == scopedKey([]byte("bob"), true, "k") || strings.Contains(alice, "alice") || len(alice) != 64+1+1 {
		t.Fatalf("scoped %q", alice)
	}
	if scopedKey(nil, false, "k") != "k" {
		t.Fatal("no identity: the key itself")
	}
	if scopedKey([]byte("a"), true, "b:c") == scopedKey([]byte("a:b"), true, "c") {
		t.Fatal("a key imitated another scope")
	}
}

func TestEveryPartOfTheRequestChangesTheFingerprint(t *testing.T) {
	base := fingerprint("POST", "/orders?x=1", "application/json", []byte("{}"))
	if len(base) != 32 || !bytes.Equal(base, fingerprint("POST", "/orders?x=1", "application/json", []byte("{}"))) {
		t.Fatal("not a stable SHA-256")
	}
	for _, other := range [][]byte{
		fingerprint("PATCH", "/orders?x=1", "application/json", []byte("{}")),
		fingerprint("POST", "/orders?x=2", "application/json", []byte("{}")),
		fingerprint("POST", "/orders?x=1", "", []byte("{}")),
		fingerprint("POST", "/orders?x=1", "application/json", []byte("{ }")),
	} {
		if bytes.Equal(base, other) {
			t.Fatal("a part of the request did not count")
		}
	}
	if bytes.Equal(fingerprint("POST", "/ab", "", []byte("c")), fingerprint("POST", "/a", "", []byte("bc"))) {
		t.Fatal("length prefixes missing")
	}
}

func TestARecordIsEncodedByteForByteAsTheGatewayDoes(t *testing.T) {
	h := http.Header{}
	h.Add("Content-Type", "application/json")
	h.Add("Set-Cookie", "a=1")
	h.Add("Set-Cookie", "b=2")
	h.Add("X-Bytes", "\xff\x80")
	h.Add("Connection", "x-private")
	h.Add("X-Private", "dropped")
	h.Add("Transfer-Encoding", "chunked")
	r := record{status: 201, headers: headerFields(h), body: []byte("{\"id\":1}\x00\xff")}
	encoded, err := r.encode()
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	want = append(want, 1, 0, 201, 0, 4)
	for _, f := range [][2]string{{"content-type", "application/json"}, {"set-cookie", "a=1"}, {"set-cookie", "b=2"}, {"x-bytes", "\xff\x80"}} {
		want = binary.BigEndian.AppendUint16(want, uint16(len(f[0])))
		want = append(want, f[0]...)
		want = binary.BigEndian.AppendUint32(want, uint32(len(f[1])))
		want = append(want, f[1]...)
	}
	want = append(want, "{\"id\":1}\x00\xff"...)
	if !bytes.Equal(encoded, want) || len(encoded) != encodedLen(r.headers, len(r.body)) {
		t.Fatalf("encoded\n%q\nwant\n%q", encoded, want)
	}
	back, err := decodeRecord(encoded)
	if err != nil || back.status != 201 || len(back.headers) != 4 || back.headers[2].value != "b=2" || !bytes.Equal(back.body, r.body) {
		t.Fatalf("%+v, %v", back, err)
	}
	r.tooLarge = true
	marker, _ := r.encode()
	back, err = decodeRecord(marker)
	if err != nil || !back.tooLarge || len(back.body) != 0 || back.status != 201 || marker[0] != 2 {
		t.Fatalf("marker %+v, %v", back, err)
	}
	for _, foreign := range [][]byte{nil, []byte(`{"json":1}`), encoded[:10]} {
		if _, err := decodeRecord(foreign); err == nil {
			t.Errorf("%q decoded", foreign)
		}
	}
}

// The problem document is the gateway's, byte for byte (docs/gateway.md shows this one).
func TestProblemsAreTheGatewaysDocuments(t *testing.T) {
	w := httptest.NewRecorder()
	problemKeyReused.write(w, "this key was used for a request with another method, path, content type or body", 0, nil)
	want := `{"detail":"this key was used for a request with another method, path, content type or body","status":422,"title":"The idempotency key was used for a different request","type":"urn:idempotency-gateway:problem:key-reused"}`
	if w.Code != 422 || w.Body.String() != want || w.Header().Get("Content-Type") != "application/problem+json" || w.Header().Get("Content-Length") != "220" {
		t.Fatalf("%d %v %s", w.Code, w.Header(), w.Body)
	}
	w = httptest.NewRecorder()
	problemInProgress.write(w, "x", 1500*time.Millisecond, nil)
	if w.Header().Get("Retry-After") != "2" {
		t.Fatalf("Retry-After %q", w.Header().Get("Retry-After"))
	}
	for d, want := range map[time.Duration]string{0: "1", time.Millisecond: "1", 1001 * time.Millisecond: "2", 3 * time.Second: "3"} {
		if got := retryAfterSeconds(d); got != int64(want[0]-'0') {
			t.Errorf("%v: %d", d, got)
		}
	}
	for d, want := range map[time.Duration]string{5 * time.Second: "5s", 1500 * time.Millisecond: "1.5s", 250 * time.Millisecond: "250ms", 0: "0ns", 90 * time.Second: "90s"} {
		if got := rustDuration(d); got != want {
			t.Errorf("rustDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestFinalStatusesAreStoredAndTheOthersReleased(t *testing.T) {
	for _, s := range []int{200, 201, 204, 400, 404, 410, 422} {
		if !isFinal(s) {
			t.Errorf("%d not final", s)
		}
	}
	for _, s := range []int{100, 302, 408, 409, 425, 429, 500, 502, 503, 504} {
		if isFinal(s) {
			t.Errorf("%d final", s)
		}
	}
}

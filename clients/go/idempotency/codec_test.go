package idempotency

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"testing"
)

func hexFingerprint(t *testing.T, request any) string {
	t.Helper()
	fp, err := Fingerprint(request)
	if err != nil {
		t.Fatalf("Fingerprint(%v): %v", request, err)
	}
	return hex.EncodeToString(fp)
}

// The digests the Rust and Python clients compute for the same values (clients/rust/src/codec.rs
// and Python's rfc8785 + SHA-256): byte-for-byte agreement, so that services in different
// languages share keys.
func TestFingerprintsMatchTheOtherClients(t *testing.T) {
	request := map[string]any{
		"order": "o-42", "amount": 1250, "currency": "EUR",
		"items": []any{map[string]any{"sku": "a", "qty": 2}}, "note": "café €", "ratio": 0.1,
		"big": 1e21, "neg": math.Copysign(0, -1), "t": true, "n": nil,
	}
	vectors := []struct {
		name    string
		request any
		want    string
	}{
		{"rust object", request, "ee063dbd1f6864b287ea99a4ff7c4e649a8cff61b2e001d8b382c6cdff18c337"},
		{"rust string", "hello", "5aa762ae383fbb727af3c7a36d4940a5b8c40a989452d2304fc958ff3f354e7a"},
		{"rust array", []int{3, 1, 2}, "51bda7ab4e44726cde71fcb6e4b515357059bb6b6dd5146d1fc50f73f11678c6"},
		{"python keys", map[string]int{"\u20ac": 1, "\r": 2, "\U0001F600": 3, "\uffff": 4, "a": 5, "B": 6, "": 7},
			"bc390d8553577da72474f35bf6342cf9c576116c560a313e4e812d46f77a07c0"},
		{"python escapes", "q\"b\\s/\b\f\n\r\t\u0001\u001f\u007f\u2028<>&é",
			"ef966c435f2bb776caf13727925a328e7b5e27b3e6c3e8dffbd98aff75bbf812"},
		{"python numbers", []any{0, 1, -1, 0.5, 5e-7, 1e-6, 123.456, 1e300, 9007199254740991, 1e21, 1e20, 4.35, 0.30000000000000004,
			-1.5e-10, 2.2250738585072014e-308, 1.7976931348623157e308},
			"d65b4b5715902712eab342d1364c4d41cb06a90a65f90fa2cb230bf318021a30"},
		{"python nested", map[string]any{"z": []any{map[string]any{"b": nil, "a": []bool{true, false}}}, "a": map[string]string{"y": "x"}},
			"401e5bb044f2f94624d4e7388585777c2a2359c16efac847c68e08758b04435d"},
		// The Node client's test: sorted keys, no spaces, shortest numbers.
		{"node", map[string]any{"currency": "EUR", "amount": 42.0, "items": []any{map[string]any{"sku": "a", "qty": 1e2}}},
			sha256Hex(`{"amount":42,"currency":"EUR","items":[{"qty":100,"sku":"a"}]}`)},
		{"bytes as they are", []byte(`{"b":1, "a":2}`), sha256Hex(`{"b":1, "a":2}`)},
		{"raw JSON is canonicalised", json.RawMessage(`{"b":1, "a":2}`), sha256Hex(`{"a":2,"b":1}`)},
	}
	for _, v := range vectors {
		if got := hexFingerprint(t, v.request); got != v.want {
			t.Errorf("%s: got %s, want %s", v.name, got, v.want)
		}
	}
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func TestStructFieldOrderDoesNotChangeTheFingerprint(t *testing.T) {
	type ab struct {
		A int    `json:"a"`
		B string `json:"b"`
	}
	type ba struct {
		B string `json:"b"`
		A int    `json:"a"`
	}
	if hexFingerprint(t, ab{1, "x"}) != hexFingerprint(t, ba{"x", 1}) {
		t.Fatal("field order changed the fingerprint")
	}
	if fp, _ := Fingerprint(nil); fp != nil {
		t.Fatal("a nil request must have no fingerprint")
	}
}

func TestES6NumberForms(t *testing.T) {
	for f, want := range map[float64]string{
		0: "0", 1: "1", -1: "-1", 0.1: "0.1", 1e21: "1e+21", 1e20: "100000000000000000000",
		1e-6: "0.000001", 1e-7: "1e-7", 123e-20: "1.23e-18", 5e-324: "5e-324", 1.5: "1.5",
		-1234.5678: "-1234.5678", 1e300: "1e+300", 2.5e21: "2.5e+21", 333333333.33333329: "333333333.3333333",
	} {
		got, err := es6Number(f)
		if err != nil || got != want {
			t.Errorf("es6Number(%v) = %q, %v; want %q", f, got, err, want)
		}
	}
	if _, err := es6Number(math.NaN()); err == nil {
		t.Error("NaN has no JSON form")
	}
}

// What the other clients could only round is refused, so that two requests never share a
// fingerprint by accident.
func TestRequestsThatCannotBeCanonicalAreRefused(t *testing.T) {
	for name, request := range map[string]any{
		"integer beyond a double": int64(1<<53 + 1),
		"2^53 itself":             int64(1 << 53),
		"-2^53":                   int64(-1 << 53),
		"2^60, exact as a double": uint64(1 << 60),
		"the largest uint64":      uint64(math.MaxUint64),
		"NaN":                     math.NaN(),
		"invalid UTF-8":           "a\xffb",
		"lone surrogate":          json.RawMessage(`"\ud800"`),
		"duplicate member":        json.RawMessage(`{"a":1,"a":2}`),
		"not JSON":                func() {},
	} {
		if _, err := Fingerprint(request); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	canonical, err := CanonicalJSON(json.RawMessage(`"\ud83d\ude00\u00e9"`))
	if err != nil || string(canonical) != `"😀é"` {
		t.Errorf("surrogate pair: %s, %v", canonical, err)
	}
}

func TestJSONCodecStoresCompactUnescapedJSON(t *testing.T) {
	type charge struct {
		ID   string `json:"id"`
		Note string `json:"note"`
	}
	data, err := JSONCodec[charge]{}.Encode(charge{"ch_1", "<a&b> é"})
	if err != nil || string(data) != `{"id":"ch_1","note":"<a&b> é"}` {
		t.Fatalf("%s, %v", data, err)
	}
	back, err := JSONCodec[charge]{}.Decode(data)
	if err != nil || back.Note != "<a&b> é" {
		t.Fatalf("%v, %v", back, err)
	}
	if _, err := (JSONCodec[charge]{}).Decode([]byte("nope")); err == nil {
		t.Fatal("bad JSON decoded")
	}
	var syntax *json.SyntaxError
	_, err = JSONCodec[charge]{}.Decode([]byte("{"))
	if !errors.As(err, new(*json.SyntaxError)) && !errors.As(err, &syntax) {
		t.Logf("decode error: %v", err)
	}
}

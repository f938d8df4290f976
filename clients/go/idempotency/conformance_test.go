package idempotency

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// readConformance is one of the vector files every client passes, in clients/conformance.
func readConformance(t *testing.T, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "conformance", name))
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// The fingerprint vectors every client passes (clients/conformance/fingerprints.json): each
// JSON text through FingerprintJSON and CanonicalJSONText, and, for the accepted ones, the
// value encoding/json reads from the text (a token-walking decoder with UseNumber, which keeps
// every number's literal and refuses a member twice) through Fingerprint.
func TestFingerprintVectors(t *testing.T) {
	raw := readConformance(t, "fingerprints.json")
	var vectors struct {
		Cases []struct {
			Name      string  `json:"name"`
			Input     string  `json:"input"`
			Canonical *string `json:"canonical"`
			SHA256    string  `json:"sha256"`
			Error     string  `json:"error"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(raw, &vectors); err != nil {
		t.Fatal(err)
	}
	if len(vectors.Cases) == 0 {
		t.Fatal("no vectors")
	}
	for _, v := range vectors.Cases {
		t.Run(v.Name, func(t *testing.T) {
			fp, err := FingerprintJSON([]byte(v.Input))
			if v.Error != "" {
				var refused *CanonicalJSONError
				if !errors.As(err, &refused) || refused.Reason != v.Error {
					t.Fatalf("want %s, got %v (%x)", v.Error, err, fp)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := hex.EncodeToString(fp); got != v.SHA256 {
				t.Errorf("fingerprint %s, want %s", got, v.SHA256)
			}
			canonical, err := CanonicalJSONText([]byte(v.Input))
			if err != nil || v.Canonical == nil || string(canonical) != *v.Canonical {
				t.Errorf("canonical %q, %v; want %q", canonical, err, *v.Canonical)
			}
			value, err := decodeKeepingNumbers(v.Input)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if value == nil {
				return // a nil request is no request: Fingerprint gives it none
			}
			if got := hexFingerprint(t, value); got != v.SHA256 {
				t.Errorf("as a value: %s, want %s", got, v.SHA256)
			}
		})
	}
}

// decodeKeepingNumbers reads a JSON text into maps, slices and json.Numbers, refusing a member
// twice.
func decodeKeepingNumbers(text string) (any, error) {
	dec := json.NewDecoder(bytes.NewReader([]byte(text)))
	dec.UseNumber()
	value, err := decodeValue(dec)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data")
	}
	return value, nil
}

func decodeValue(dec *json.Decoder) (any, error) {
	token, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch token {
	case json.Delim('{'):
		object := map[string]any{}
		for dec.More() {
			key, err := dec.Token()
			if err != nil {
				return nil, err
			}
			name := key.(string)
			if _, twice := object[name]; twice {
				return nil, errors.New("a member twice: " + name)
			}
			if object[name], err = decodeValue(dec); err != nil {
				return nil, err
			}
		}
		_, err := dec.Token()
		return object, err
	case json.Delim('['):
		array := []any{}
		for dec.More() {
			element, err := decodeValue(dec)
			if err != nil {
				return nil, err
			}
			array = append(array, element)
		}
		_, err := dec.Token()
		return array, err
	}
	return token, nil
}

// Values of Go types: integers beyond ±(2^53−1) are refused whatever their type, a float64 is a
// double and written as one.
func TestIntegersOfEveryTypeBeyondTheSafeRangeAreRefused(t *testing.T) {
	for name, value := range map[string]any{
		"int64 2^53": int64(1 << 53), "int64 -2^53": int64(-1 << 53), "uint64 max": uint64(math.MaxUint64),
		"json.Number": json.Number("9007199254740992"), "in a struct": struct{ N uint64 }{1 << 60},
	} {
		_, err := CanonicalJSON(value)
		var refused *CanonicalJSONError
		if !errors.As(err, &refused) || refused.Reason != "unsafe_integer" {
			t.Errorf("%s: %v", name, err)
		}
	}
	for value, want := range map[any]string{
		int64(MaxSafeInteger): "9007199254740991", int64(-MaxSafeInteger): "-9007199254740991",
		float64(1 << 53): "9007199254740992", 1e21: "1e+21", json.Number("1e21"): "1e+21",
	} {
		canonical, err := CanonicalJSON(value)
		if err != nil || string(canonical) != want {
			t.Errorf("%v: %s, %v; want %s", value, canonical, err, want)
		}
	}
	if a, b := hexFingerprint(t, "\u00e9"), hexFingerprint(t, "e\u0301"); a == b {
		t.Error("NFC and NFD share a fingerprint")
	}
}

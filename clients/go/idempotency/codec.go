package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// A Codec turns a work's result into the stored response and back.
type Codec[T any] interface {
	Encode(value T) ([]byte, error)
	Decode(data []byte) (T, error)
}

// JSONCodec stores results as compact UTF-8 JSON (the default): the shape the other clients'
// JSON codecs store, so a result stored by one language is read by another.
type JSONCodec[T any] struct{}

// Encode writes value as compact JSON, without Go's HTML escaping (the other clients do not
// escape <, > and &).
func (JSONCodec[T]) Encode(value T) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(value); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// Decode reads JSON into a T.
func (JSONCodec[T]) Decode(data []byte) (T, error) {
	var value T
	err := json.Unmarshal(data, &value)
	return value, err
}

// BytesCodec stores results that are already bytes, as they are.
type BytesCodec struct{}

// Encode returns value itself.
func (BytesCodec) Encode(value []byte) ([]byte, error) { return value, nil }

// Decode returns data itself.
func (BytesCodec) Decode(data []byte) ([]byte, error) { return data, nil }

// Fingerprint is what RunOnce sends as the request's fingerprint: nil for a nil request (it
// matches only other requests without one), SHA-256 of the bytes for a []byte, and otherwise
// SHA-256 of the value's RFC 8785 canonical JSON (after encoding/json has encoded it, so struct
// tags and MarshalJSON apply). Equal requests hash alike whatever the order of their fields or
// the language of the client that made them.
func Fingerprint(request any) ([]byte, error) {
	switch r := request.(type) {
	case nil:
		return nil, nil
	case []byte:
		sum := sha256.Sum256(r)
		return sum[:], nil
	}
	canonical, err := CanonicalJSON(request)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(canonical)
	return sum[:], nil
}

// MaxSafeInteger is the largest integer every client's JSON reads exactly (JavaScript's
// Number.MAX_SAFE_INTEGER). An integer beyond ±MaxSafeInteger has no canonical JSON form.
const MaxSafeInteger = 1<<53 - 1

// A CanonicalJSONError says why a value or a JSON text has no canonical JSON form, so no
// fingerprint. Reason is one of the names the conformance vectors use (clients/conformance):
// "invalid_json" (a text that is not JSON), "not_json" (a value encoding/json refuses, or a
// string that is not UTF-8), "duplicate_key", "lone_surrogate", "unsafe_integer" (an integer
// beyond ±MaxSafeInteger: send it as a string) or "number_out_of_range" (NaN, an infinity, or
// a literal beyond the largest double).
type CanonicalJSONError struct {
	Reason string
	Detail string
}

func (e *CanonicalJSONError) Error() string {
	return fmt.Sprintf("idempotency: no canonical JSON (%s): %s", e.Reason, e.Detail)
}

func canonErr(reason, format string, args ...any) *CanonicalJSONError {
	return &CanonicalJSONError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// CanonicalJSON is value encoded by encoding/json, then written as RFC 8785 (JCS) prescribes:
// object members sorted by their UTF-16 code units, no insignificant whitespace, strings with
// only the escapes ECMAScript's JSON.stringify makes, and numbers as ECMAScript writes doubles.
//
// Beyond RFC 8785, as I-JSON (RFC 7493) asks: an integer beyond ±MaxSafeInteger, of any Go
// type, is refused rather than rounded, so that two different requests never share a
// fingerprint (send it as a string; a float64 is a double already and is written as one); so is
// a string that is not valid UTF-8, which encoding/json would otherwise turn into U+FFFD, and a
// json.RawMessage with a member twice or a lone surrogate. Errors are *CanonicalJSONError.
func CanonicalJSON(value any) ([]byte, error) {
	encoded, err := json.Marshal(value)
	if err != nil {
		var unsupported *json.UnsupportedValueError
		if errors.As(err, &unsupported) && (unsupported.Value.Kind() == reflect.Float64 || unsupported.Value.Kind() == reflect.Float32) {
			return nil, canonErr("number_out_of_range", "%v", err)
		}
		var syntax *json.SyntaxError
		if errors.As(err, &syntax) {
			return nil, canonErr("invalid_json", "%v", err)
		}
		return nil, canonErr("not_json", "%v", err)
	}
	// encoding/json writes a whole float64 below 1e21 as digits alone, like an integer, so the
	// integers are judged on the value itself.
	if err := checkIntegers(reflect.ValueOf(value), 0); err != nil {
		return nil, err
	}
	return canonicalize(encoded, true)
}

var (
	marshalerType     = reflect.TypeFor[json.Marshaler]()
	textMarshalerType = reflect.TypeFor[encoding.TextMarshaler]()
	numberType        = reflect.TypeFor[json.Number]()
)

// checkIntegers walks v as encoding/json encodes it and refuses an integer beyond
// ±MaxSafeInteger that it writes as a number: a value of an integer kind, a json.Number literal,
// or an integer literal in what a json.Marshaler writes.
func checkIntegers(v reflect.Value, depth int) error {
	if !v.IsValid() || depth > 1000 { // deeper: a cycle, which json.Marshal has refused
		return nil
	}
	t := v.Type()
	if t == numberType {
		if literal := v.String(); !strings.ContainsAny(literal, ".eE") {
			return safeIntegerLiteral(literal)
		}
		return nil
	}
	if v.CanInterface() && t.Implements(marshalerType) {
		if (v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface) && v.IsNil() {
			return nil
		}
		if raw, err := v.Interface().(json.Marshaler).MarshalJSON(); err == nil {
			if _, err := CanonicalJSONText(raw); err != nil {
				var refused *CanonicalJSONError
				if errors.As(err, &refused) && refused.Reason == "unsafe_integer" {
					return err
				}
			}
		}
		return nil
	}
	if t.Implements(textMarshalerType) {
		return nil // written as a string
	}
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		if n := v.Int(); n > MaxSafeInteger || n < -MaxSafeInteger {
			return safeIntegerLiteral(strconv.FormatInt(n, 10))
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		if n := v.Uint(); n > MaxSafeInteger {
			return safeIntegerLiteral(strconv.FormatUint(n, 10))
		}
	case reflect.Pointer, reflect.Interface:
		return checkIntegers(v.Elem(), depth+1)
	case reflect.Slice, reflect.Array:
		if v.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Uint8 {
			return nil // []byte is written as base64
		}
		for i := range v.Len() {
			if err := checkIntegers(v.Index(i), depth+1); err != nil {
				return err
			}
		}
	case reflect.Map:
		for it := v.MapRange(); it.Next(); {
			if err := checkIntegers(it.Value(), depth+1); err != nil {
				return err
			}
		}
	case reflect.Struct:
		for i := range t.NumField() {
			field := t.Field(i)
			tag := field.Tag.Get("json")
			_, options, _ := strings.Cut(tag, ",")
			if (!field.IsExported() && !field.Anonymous) || tag == "-" || slices.Contains(strings.Split(options, ","), "string") {
				continue // not written, or written as a string
			}
			if err := checkIntegers(v.Field(i), depth+1); err != nil {
				return err
			}
		}
	}
	return nil
}

// safeIntegerLiteral refuses an integer literal beyond ±MaxSafeInteger.
func safeIntegerLiteral(literal string) error {
	n, err := strconv.ParseInt(literal, 10, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return canonErr("invalid_json", "invalid number %s", literal)
	}
	if err != nil || n > MaxSafeInteger || n < -MaxSafeInteger {
		return canonErr("unsafe_integer", "the integer %s is beyond ±(2^53−1) and would be rounded: send it as a string", literal)
	}
	return nil
}

// CanonicalJSONText is the RFC 8785 canonical form of a JSON text (a request body as it arrived,
// say): the same bytes as CanonicalJSON of the value it holds. Refused, with a
// *CanonicalJSONError: a text that is not JSON, a member name twice in one object, an integer
// literal (no fraction, no exponent) beyond ±MaxSafeInteger, a number beyond the largest double
// and a lone surrogate. 1e21 and 9007199254740993.0 are numbers like any other, written as
// their nearest double.
func CanonicalJSONText(text []byte) ([]byte, error) {
	if !json.Valid(text) {
		return nil, canonErr("invalid_json", "not a JSON text")
	}
	return canonicalize(text, false)
}

// FingerprintJSON is SHA-256 of CanonicalJSONText(text): the fingerprint Fingerprint gives the
// value the text holds, whatever its spacing and member order.
func FingerprintJSON(text []byte) ([]byte, error) {
	canonical, err := CanonicalJSONText(text)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(canonical)
	return sum[:], nil
}

func canonicalize(text []byte, fromMarshal bool) ([]byte, error) {
	p := jcs{in: text, fromMarshal: fromMarshal}
	p.skipSpace()
	if err := p.value(); err != nil {
		return nil, err
	}
	p.skipSpace()
	if p.pos != len(p.in) {
		return nil, canonErr("invalid_json", "trailing data")
	}
	return p.out, nil
}

// jcs rewrites valid JSON (checked by json.Valid, or made by encoding/json) into its canonical
// form.
type jcs struct {
	in  []byte
	pos int
	out []byte
	// fromMarshal: the text is encoding/json's, which writes a string byte that is not UTF-8 as
	// the escape \ufffd (and a real U+FFFD as itself), so that escape means "not UTF-8".
	fromMarshal bool
}

func (p *jcs) skipSpace() {
	for p.pos < len(p.in) && strings.IndexByte(" \t\r\n", p.in[p.pos]) >= 0 {
		p.pos++
	}
}

func (p *jcs) value() error {
	if p.pos >= len(p.in) {
		return canonErr("invalid_json", "unexpected end")
	}
	switch c := p.in[p.pos]; {
	case c == '{':
		return p.object()
	case c == '[':
		return p.array()
	case c == '"':
		s, err := p.str()
		if err != nil {
			return err
		}
		p.out = appendJCSString(p.out, s)
		return nil
	case c == 't' || c == 'f' || c == 'n':
		for _, lit := range []string{"true", "false", "null"} {
			if bytes.HasPrefix(p.in[p.pos:], []byte(lit)) {
				p.out = append(p.out, lit...)
				p.pos += len(lit)
				return nil
			}
		}
		return canonErr("invalid_json", "invalid literal")
	default:
		return p.number()
	}
}

func (p *jcs) object() error {
	p.pos++ // {
	type member struct {
		key   string
		units []uint16
		value []byte
	}
	var members []member
	seen := map[string]bool{}
	saved := p.out
	for {
		p.skipSpace()
		if p.pos < len(p.in) && p.in[p.pos] == '}' && len(members) == 0 {
			break
		}
		key, err := p.str()
		if err != nil {
			return err
		}
		if seen[key] {
			return canonErr("duplicate_key", "the object has the member %q twice", key)
		}
		seen[key] = true
		p.skipSpace()
		if p.pos >= len(p.in) || p.in[p.pos] != ':' {
			return canonErr("invalid_json", "expected ':'")
		}
		p.pos++
		p.skipSpace()
		p.out = nil
		if err := p.value(); err != nil {
			return err
		}
		members = append(members, member{key: key, units: utf16.Encode([]rune(key)), value: p.out})
		p.skipSpace()
		if p.pos < len(p.in) && p.in[p.pos] == ',' {
			p.pos++
			continue
		}
		break
	}
	if p.pos >= len(p.in) || p.in[p.pos] != '}' {
		return canonErr("invalid_json", "expected '}'")
	}
	p.pos++
	slices.SortFunc(members, func(a, b member) int { return slices.Compare(a.units, b.units) })
	p.out = append(saved, '{')
	for i, m := range members {
		if i > 0 {
			p.out = append(p.out, ',')
		}
		p.out = appendJCSString(p.out, m.key)
		p.out = append(p.out, ':')
		p.out = append(p.out, m.value...)
	}
	p.out = append(p.out, '}')
	return nil
}

func (p *jcs) array() error {
	p.pos++ // [
	p.out = append(p.out, '[')
	p.skipSpace()
	if p.pos < len(p.in) && p.in[p.pos] == ']' {
		p.pos++
		p.out = append(p.out, ']')
		return nil
	}
	for {
		p.skipSpace()
		if err := p.value(); err != nil {
			return err
		}
		p.skipSpace()
		if p.pos < len(p.in) && p.in[p.pos] == ',' {
			p.pos++
			p.out = append(p.out, ',')
			continue
		}
		break
	}
	if p.pos >= len(p.in) || p.in[p.pos] != ']' {
		return canonErr("invalid_json", "expected ']'")
	}
	p.pos++
	p.out = append(p.out, ']')
	return nil
}

// str reads a JSON string and returns its text. encoding/json writes a byte that is not valid
// UTF-8 as the escape \ufffd (a real U+FFFD it writes as itself), so that escape is refused.
func (p *jcs) str() (string, error) {
	if p.pos >= len(p.in) || p.in[p.pos] != '"' {
		return "", canonErr("invalid_json", "expected a string")
	}
	p.pos++
	var b strings.Builder
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			return b.String(), nil
		case c == '\\':
			if p.pos+1 >= len(p.in) {
				return "", canonErr("invalid_json", "unterminated escape")
			}
			e := p.in[p.pos+1]
			p.pos += 2
			switch i := strings.IndexByte(jsonNamed+"/", e); {
			case i >= 0:
				b.WriteByte((jsonRaw + "/")[i])
			case e == 'u':
				r, err := p.hex4()
				if err != nil {
					return "", err
				}
				if r == utf8.RuneError && p.fromMarshal {
					return "", canonErr("not_json", "a string is not valid UTF-8")
				}
				if utf16.IsSurrogate(r) {
					if r >= 0xdc00 || !bytes.HasPrefix(p.in[p.pos:], []byte(`\u`)) {
						return "", canonErr("lone_surrogate", "a string holds a lone surrogate")
					}
					p.pos += 2
					low, err := p.hex4()
					if err != nil {
						return "", err
					}
					r = utf16.DecodeRune(r, low)
					if r == utf8.RuneError {
						return "", canonErr("lone_surrogate", "a string holds a lone surrogate")
					}
				}
				b.WriteRune(r)
			default:
				return "", canonErr("invalid_json", "invalid escape")
			}
		default:
			r, size := utf8.DecodeRune(p.in[p.pos:])
			if r == utf8.RuneError && size == 1 {
				return "", canonErr("invalid_json", "a string is not valid UTF-8")
			}
			b.Write(p.in[p.pos : p.pos+size])
			p.pos += size
		}
	}
	return "", canonErr("invalid_json", "unterminated string")
}

func (p *jcs) hex4() (rune, error) {
	if p.pos+4 > len(p.in) {
		return 0, canonErr("invalid_json", "short \\u escape")
	}
	v, err := strconv.ParseUint(string(p.in[p.pos:p.pos+4]), 16, 16)
	if err != nil {
		return 0, canonErr("invalid_json", "invalid \\u escape")
	}
	p.pos += 4
	return rune(v), nil
}

func (p *jcs) number() error {
	start := p.pos
	for p.pos < len(p.in) && strings.IndexByte("+-0123456789.eE", p.in[p.pos]) >= 0 {
		p.pos++
	}
	literal := string(p.in[start:p.pos])
	if literal == "" {
		return canonErr("invalid_json", "expected a value")
	}
	if !p.fromMarshal && !strings.ContainsAny(literal, ".eE") {
		// An integer literal of a text: beyond ±(2^53−1) a double would round it, and two
		// different requests could share a fingerprint. (encoding/json's own output writes whole
		// floats this way too: CanonicalJSON judges integers on the value, by checkIntegers.)
		if err := safeIntegerLiteral(literal); err != nil {
			return err
		}
	}
	f, err := strconv.ParseFloat(literal, 64)
	if errors.Is(err, strconv.ErrRange) && (math.IsInf(f, 0)) {
		return canonErr("number_out_of_range", "the number %s is beyond the largest double", literal)
	}
	if err != nil {
		return canonErr("invalid_json", "invalid number %s", literal)
	}
	s, err := es6Number(f)
	if err != nil {
		return err
	}
	p.out = append(p.out, s...)
	return nil
}

// es6Number writes a double as ECMAScript's Number.prototype.toString does (RFC 8785, 3.2.2.3):
// the shortest digits that read back as the same double, in plain notation from 1e-6 up to
// 1e21, else in exponent notation; -0 as 0.
func es6Number(f float64) (string, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "", canonErr("number_out_of_range", "NaN and infinities have no JSON form")
	}
	if f == 0 {
		return "0", nil
	}
	sign := ""
	if f < 0 {
		sign, f = "-", -f
	}
	// "d.ddde±x": the shortest digits and the decimal exponent.
	e := strconv.FormatFloat(f, 'e', -1, 64)
	mantissa, expText, _ := strings.Cut(e, "e")
	digits := strings.Replace(mantissa, ".", "", 1)
	exp, _ := strconv.Atoi(expText)
	k, n := len(digits), exp+1 // n: where the decimal point goes, counted from the digits' start
	var out string
	switch {
	case k <= n && n <= 21:
		out = digits + strings.Repeat("0", n-k)
	case 0 < n && n <= 21:
		out = digits[:n] + "." + digits[n:]
	case -6 < n && n <= 0:
		out = "0." + strings.Repeat("0", -n) + digits
	default:
		expSign := "+"
		if n-1 < 0 {
			expSign = "-"
		}
		frac := ""
		if k > 1 {
			frac = "." + digits[1:]
		}
		out = digits[:1] + frac + "e" + expSign + strconv.Itoa(abs(n-1))
	}
	return sign + out, nil
}

func abs(i int) int {
	if i < 0 {
		return -i
	}
	return i
}

// The characters JSON escapes by name, and their names: jsonNamed[i] is jsonRaw[i] escaped.
// Reading JSON also takes \/ for /.
const (
	jsonRaw   = "\"\\\b\t\n\f\r"
	jsonNamed = "\"\\btnfr"
)

// appendJCSString writes s as JSON.stringify does: only ", \ and the control characters below
// U+0020 are escaped (\b \t \n \f \r by name, the rest as \u00xx); everything else is UTF-8.
func appendJCSString(out []byte, s string) []byte {
	out = append(out, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch named := strings.IndexByte(jsonRaw, c); {
		case named >= 0:
			out = append(out, '\\', jsonNamed[named])
		case c < 0x20:
			out = append(out, '\\', 'u', '0', '0', "0123456789abcdef"[c>>4], "0123456789abcdef"[c&0xf])
		default:
			out = append(out, c)
		}
	}
	return append(out, '"')
}

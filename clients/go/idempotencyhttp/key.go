package idempotencyhttp

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"
)

// keyError is why a request's key header cannot be used (each is a 400).
type keyError int

const (
	keyMissing keyError = iota + 1
	keyRepeated
	keyMalformed
)

// readKey reads the key from the header's values, as the gateway does (gateway/src/key.rs): an
// RFC 9651 sf-string ("abc", parameters ignored) or sf-token, or, for the many clients that send
// one unquoted, a bare value of token characters plus ':' '/' '=' (a UUID, base64). At most
// maxLength bytes, never empty.
func readKey(values []string, maxLength int) (string, keyError, string) {
	switch len(values) {
	case 0:
		return "", keyMissing, ""
	case 1:
	default:
		return "", keyRepeated, ""
	}
	raw := values[0]
	key, ok := sfStringOrToken(raw)
	if !ok {
		key, ok = bareKey(raw)
		if !ok {
			return "", keyMalformed, `the key must be a quoted string ("...") or a bare token`
		}
	}
	if key == "" {
		return "", keyMalformed, "the key is empty"
	}
	if len(key) > maxLength {
		return "", keyMalformed, fmt.Sprintf("the key is longer than %d bytes", maxLength)
	}
	return key, 0, ""
}

// bareKey: RFC 9110 token characters plus ':' '/' '=', surrounding spaces and tabs ignored.
func bareKey(raw string) (string, bool) {
	if !utf8.ValidString(raw) {
		return "", false
	}
	text := strings.Trim(raw, " \t")
	if text == "" {
		return "", false
	}
	for i := 0; i < len(text); i++ {
		c := text[i]
		if !isAlnum(c) && !strings.ContainsRune("!#$%&'*+-.^_`|~:/=", rune(c)) {
			return "", false
		}
	}
	return text, true
}

// scopedKey is the key as stored in the coordinator: with an identity, the hex SHA-256 of the
// identity, a colon and the key, so that two callers' keys never meet and the identity is never
// stored in clear; without one, the key itself.
func scopedKey(identity []byte, hasIdentity bool, key string) string {
	if !hasIdentity {
		return key
	}
	sum := sha256.Sum256(identity)
	return hex.EncodeToString(sum[:]) + ":" + key
}

// fingerprint is SHA-256 over the method, the path and query, the Content-Type and the body,
// each prefixed by its length (8 bytes, big-endian), so that no two different requests give the
// same input. Byte for byte the gateway's.
func fingerprint(method, pathAndQuery, contentType string, body []byte) []byte {
	h := sha256.New()
	var length [8]byte
	for _, part := range [][]byte{[]byte(method), []byte(pathAndQuery), []byte(contentType), body} {
		binary.BigEndian.PutUint64(length[:], uint64(len(part)))
		h.Write(length[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// sfStringOrToken parses raw as an RFC 9651 Item (as the gateway's sfv 0.15 does) and answers
// its bare item when it is a String or a Token; any other item, or a parse failure, answers
// false (the caller then tries a bare key).
func sfStringOrToken(raw string) (string, bool) {
	p := sfParser{in: raw}
	p.skipSP()
	item, kind, err := p.bareItem()
	if err != nil {
		return "", false
	}
	if err := p.parameters(); err != nil {
		return "", false
	}
	p.skipSP()
	if p.pos != len(p.in) {
		return "", false
	}
	if kind != sfString && kind != sfToken {
		return "", false
	}
	return item, true
}

type sfKind int

const (
	sfOther sfKind = iota
	sfString
	sfToken
)

type sfParser struct {
	in  string
	pos int
}

type sfErr string

func (e sfErr) Error() string { return string(e) }

func (p *sfParser) peek() (byte, bool) {
	if p.pos < len(p.in) {
		return p.in[p.pos], true
	}
	return 0, false
}

func (p *sfParser) skipSP() {
	for p.pos < len(p.in) && p.in[p.pos] == ' ' {
		p.pos++
	}
}

func (p *sfParser) bareItem() (string, sfKind, error) {
	c, ok := p.peek()
	switch {
	case !ok:
		return "", sfOther, sfErr("empty")
	case c == '?':
		return "", sfOther, p.boolean()
	case c == '"':
		s, err := p.str()
		return s, sfString, err
	case c == ':':
		return "", sfOther, p.byteSequence()
	case c == '@':
		return "", sfOther, p.date()
	case c == '%':
		return "", sfOther, p.displayString()
	case isAlpha(c) || c == '*':
		return p.token(), sfToken, nil
	case c == '-' || isDigit(c):
		_, err := p.number()
		return "", sfOther, err
	}
	return "", sfOther, sfErr("not a bare item")
}

func (p *sfParser) boolean() error {
	p.pos++ // ?
	if c, ok := p.peek(); ok && (c == '0' || c == '1') {
		p.pos++
		return nil
	}
	return sfErr("boolean")
}

func (p *sfParser) str() (string, error) {
	p.pos++ // "
	var b strings.Builder
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			return b.String(), nil
		case c < 0x20 || c >= 0x7f:
			return "", sfErr("string character")
		case c == '\\':
			p.pos++
			n, ok := p.peek()
			if !ok || (n != '\\' && n != '"') {
				return "", sfErr("escape")
			}
			b.WriteByte(n)
			p.pos++
		default:
			b.WriteByte(c)
			p.pos++
		}
	}
	return "", sfErr("unterminated string")
}

func (p *sfParser) token() string {
	start := p.pos
	p.pos++
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		if !isTchar(c) && c != ':' && c != '/' {
			break
		}
		p.pos++
	}
	return p.in[start:p.pos]
}

func (p *sfParser) byteSequence() error {
	p.pos++ // :
	end := strings.IndexByte(p.in[p.pos:], ':')
	if end < 0 {
		return sfErr("unterminated byte sequence")
	}
	content := p.in[p.pos : p.pos+end]
	p.pos += end + 1
	// sfv decodes the standard alphabet with or without padding (correct when present), and
	// allows non-zero trailing bits, as the non-strict decoder does.
	trimmed := strings.TrimRight(content, "=")
	padded := len(content) != len(trimmed)
	if len(content)-len(trimmed) > 2 || (padded && len(content)%4 != 0) {
		return sfErr("byte sequence padding")
	}
	if _, err := base64.RawStdEncoding.DecodeString(trimmed); err != nil {
		return sfErr("byte sequence")
	}
	return nil
}

func (p *sfParser) number() (bool, error) {
	if c, _ := p.peek(); c == '-' {
		p.pos++
	}
	if c, ok := p.peek(); !ok || !isDigit(c) {
		return false, sfErr("digit")
	}
	digits, err := p.digits(15, "too many digits")
	if err != nil {
		return false, err
	}
	if c, ok := p.peek(); !ok || c != '.' {
		return false, nil
	}
	if digits > 12 {
		return false, sfErr("too many digits before the decimal point")
	}
	p.pos++
	fraction, err := p.digits(3, "too many digits after the decimal point")
	if err != nil {
		return false, err
	}
	if fraction == 0 {
		return false, sfErr("trailing decimal point")
	}
	return true, nil
}

// digits skips the digits at the position, at most limit of them (more: the error tooMany), and
// answers how many there were.
func (p *sfParser) digits(limit int, tooMany sfErr) (int, error) {
	n := 0
	for p.pos < len(p.in) && isDigit(p.in[p.pos]) {
		n++
		if n > limit {
			return n, tooMany
		}
		p.pos++
	}
	return n, nil
}

func (p *sfParser) date() error {
	p.pos++ // @
	decimal, err := p.number()
	if err == nil && decimal {
		return sfErr("non-integer date")
	}
	return err
}

func (p *sfParser) displayString() error {
	p.pos++ // %
	if c, ok := p.peek(); !ok || c != '"' {
		return sfErr("display string")
	}
	p.pos++
	var out []byte
	for p.pos < len(p.in) {
		c := p.in[p.pos]
		switch {
		case c == '"':
			p.pos++
			if !utf8.Valid(out) {
				return sfErr("display string utf-8")
			}
			return nil
		case c < 0x20 || c >= 0x7f:
			return sfErr("display string character")
		case c == '%':
			p.pos++
			var octet byte
			for range 2 {
				h, ok := p.peek()
				switch {
				case ok && isDigit(h):
					octet = octet<<4 + (h - '0')
				case ok && h >= 'a' && h <= 'f':
					octet = octet<<4 + (h - 'a' + 10)
				default:
					return sfErr("display string escape")
				}
				p.pos++
			}
			out = append(out, octet)
		default:
			out = append(out, c)
			p.pos++
		}
	}
	return sfErr("unterminated display string")
}

func (p *sfParser) parameters() error {
	for {
		c, ok := p.peek()
		if !ok || c != ';' {
			return nil
		}
		p.pos++
		p.skipSP()
		if c, ok := p.peek(); !ok || !(isLowerAlpha(c) || c == '*') {
			return sfErr("parameter key")
		}
		for p.pos < len(p.in) {
			c := p.in[p.pos]
			if !(isLowerAlpha(c) || isDigit(c) || c == '_' || c == '-' || c == '*' || c == '.') {
				break
			}
			p.pos++
		}
		if c, ok := p.peek(); ok && c == '=' {
			p.pos++
			if _, _, err := p.bareItem(); err != nil {
				return err
			}
		}
	}
}

func isAlpha(c byte) bool      { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
func isLowerAlpha(c byte) bool { return c >= 'a' && c <= 'z' }
func isDigit(c byte) bool      { return c >= '0' && c <= '9' }
func isAlnum(c byte) bool      { return isAlpha(c) || isDigit(c) }
func isTchar(c byte) bool      { return isAlnum(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0 }

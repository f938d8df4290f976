package idempotency

import (
	"fmt"
	"time"
	"unicode/utf8"
)

// The contract's bounds (docs/contract.md, "Names" and "Limits and defaults"). The client checks
// them before it sends anything, so that bad input fails at once with the field named, changes
// nothing, and costs no round trip; the coordinator checks them again.
const (
	MinLease          = 100 * time.Millisecond
	MaxLease          = 24 * time.Hour
	MinRetention      = time.Second
	MaxRetention      = 30 * 24 * time.Hour
	MaxServerWait     = 60 * time.Second
	MaxScopeLength    = 64
	MaxKeyBytes       = 255
	MaxAttemptIDBytes = 128
	MaxFingerprint    = 64
	MaxCheckpoint     = 64 << 10
	MaxEventIDs       = 1000
	maxToken          = 1<<63 - 1
)

func checkLease(d time.Duration) error {
	if d < MinLease || d > MaxLease {
		return fmt.Errorf("the lease must be between %v and %v (got %v)", MinLease, MaxLease, d)
	}
	return nil
}

// checkScope: 1–64 characters of A-Z a-z 0-9 . _ - :
func checkScope(op, field, scope string) error {
	if scope == "" || len(scope) > MaxScopeLength {
		return invalid(op, field, fmt.Sprintf("must be 1-%d characters (got %d)", MaxScopeLength, len(scope)))
	}
	for i := 0; i < len(scope); i++ {
		c := scope[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':'
		if !ok {
			return invalid(op, field, "may hold only A-Z a-z 0-9 . _ - :")
		}
	}
	return nil
}

// checkText: 1–limit bytes of UTF-8 without control characters (Unicode category Cc). Empty is
// allowed only where the field is optional.
func checkText(op, field, text string, limit int, optional bool) error {
	if text == "" {
		if optional {
			return nil
		}
		return invalid(op, field, "must not be empty")
	}
	if len(text) > limit {
		return invalid(op, field, fmt.Sprintf("must be at most %d bytes (got %d)", limit, len(text)))
	}
	if !utf8.ValidString(text) {
		return invalid(op, field, "must be valid UTF-8")
	}
	for _, r := range text {
		if r < 0x20 || r >= 0x7f && r <= 0x9f {
			return invalid(op, field, "must not hold control characters")
		}
	}
	return nil
}

func checkKey(op, scopeField, scope, key string) error {
	if err := checkScope(op, scopeField, scope); err != nil {
		return err
	}
	return checkText(op, "key", key, MaxKeyBytes, false)
}

func checkToken(op string, token uint64) error {
	if token == 0 || token > maxToken {
		return invalid(op, "lease_token", "must be a token from TryStart (1 to 2^63-1)")
	}
	return nil
}

// checkDuration: d within [low, high]; zero means "absent" when optional.
func checkDuration(op, field string, d, low, high time.Duration, optional bool) error {
	if d == 0 && optional {
		return nil
	}
	if d < low || d > high {
		return invalid(op, field, fmt.Sprintf("must be between %v and %v (got %v)", low, high, d))
	}
	return nil
}

func checkBytes(op, field string, b []byte, limit int) error {
	if len(b) > limit {
		return invalid(op, field, fmt.Sprintf("must be at most %d bytes (got %d)", limit, len(b)))
	}
	return nil
}

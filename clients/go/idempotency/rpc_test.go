package idempotency_test

import (
	"context"
	"errors"
	"testing"

	"github.com/idempotency-coordinator/idempotency-coordinator/clients/go/idempotency"
)

// The Client's plain calls (rpc.go: TryStart, ExtendLease, Complete, Release, Lookup) against a
// real coordinator, on each store; RunOnce's own tests are in the runonce*_test.go files.

// The plain RPCs, and the errors of the contract as the real coordinator answers them.
func TestThePlainCallsAndTheirErrors(t *testing.T) {
	withClientOnEachStore(t, func(t *testing.T, c *idempotency.Client) {
		ctx := context.Background()
		ns, key := "orders", "o-1"
		wantStatus(t, c, ns, key, idempotency.KeyAbsent, "before any call")
		claim, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp"), AttemptID: "a-1"})
		if err != nil || claim.Outcome != idempotency.Started || claim.Attempt != 1 || claim.AttemptID != "a-1" {
			t.Fatalf("%+v, %v", claim, err)
		}
		// Re-entry with the same attempt_id: the same claim.
		again, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp"), AttemptID: "a-1"})
		if err != nil || again.Outcome != idempotency.Started || again.Token != claim.Token {
			t.Fatalf("re-entry %+v, %v", again, err)
		}
		busy, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp")})
		if err != nil || busy.Outcome != idempotency.InProgress || busy.LeaseExpiresAt.IsZero() {
			t.Fatalf("%+v, %v", busy, err)
		}
		if state := lookup(t, c, ns, key); state.Status != idempotency.KeyInProgress || string(state.Fingerprint) != "fp" {
			t.Fatalf("%+v", state)
		}
		if _, err := c.ExtendLease(ctx, idempotency.ExtendRequest{Namespace: ns, Key: key, Token: claim.Token + 1000}); !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Fatalf("a stale token: %v", err)
		}
		done, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("ok")})
		if err != nil || done.CompletedAt.IsZero() || !done.ExpiresAt.After(done.CompletedAt) {
			t.Fatalf("%+v, %v", done, err)
		}
		// Complete repeated with the same response: the same answer.
		repeat, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("ok")})
		if err != nil || !repeat.CompletedAt.Equal(done.CompletedAt) {
			t.Fatalf("%+v, %v", repeat, err)
		}
		if _, err := c.Complete(ctx, idempotency.CompleteRequest{Namespace: ns, Key: key, Token: claim.Token, Response: []byte("other")}); !errors.Is(err, idempotency.ErrAlreadyCompleted) {
			t.Fatalf("another response: %v", err)
		}
		replay, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("fp")})
		if err != nil || replay.Outcome != idempotency.Completed || string(replay.Response) != "ok" {
			t.Fatalf("%+v, %v", replay, err)
		}
		mismatch, err := c.TryStart(ctx, idempotency.StartRequest{Namespace: ns, Key: key, Fingerprint: []byte("other")})
		if err != nil || mismatch.Outcome != idempotency.FingerprintMismatch {
			t.Fatalf("%+v, %v", mismatch, err)
		}
		if err := c.Release(ctx, ns, "never-claimed", 5); !errors.Is(err, idempotency.ErrKeyNotFound) {
			t.Fatalf("release of an absent key: %v", err)
		}
		if err := c.Release(ctx, ns, key, claim.Token); !errors.Is(err, idempotency.ErrAlreadyCompleted) {
			t.Fatalf("release of a completed key: %v", err)
		}
	})
}

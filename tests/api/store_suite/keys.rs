//! TryStart's order, on the trait: fresh, mismatch, in progress, re-entry, takeover.

use std::time::Duration;

use idempotency_coordinator::domain::{Checkpoint, TryStartOutcome};
use idempotency_coordinator::store::Store;
use idempotency_testkit::TestDatabase;

use super::*;

async fn a_fresh_key_is_started_and_a_second_caller_finds_it_in_progress<S: Store>(
    store: S,
    _: &TestDatabase,
) {
    let first = claimed(&store, with_attempt(claim("k"), "holder-1")).await;
    assert_eq!(first.attempt, 1);
    assert_eq!(first.checkpoint, None);
    let second = store.try_start(&claim("k")).await.expect("second");
    // The holder's attempt id comes with the answer (for the coalescer, never for callers).
    assert_eq!(
        second,
        TryStartOutcome::InProgress {
            lease_expires_at: first.lease_expires_at,
            attempt: 1,
            holder_attempt_id: Some("holder-1".into()),
        }
    );
}

async fn another_fingerprint_is_a_mismatch_even_with_the_holders_attempt_id<S: Store>(
    store: S,
    _: &TestDatabase,
) {
    claimed(&store, with_attempt(claim("k"), "a-1")).await;
    let other = with_attempt(with_fingerprint(claim("k"), b"f2"), "a-1");
    assert_eq!(
        store.try_start(&other).await.expect("mismatch"),
        TryStartOutcome::FingerprintMismatch
    );
}

async fn the_holders_attempt_id_re_enters_with_the_same_token<S: Store>(
    store: S,
    _: &TestDatabase,
) {
    let first = claimed(&store, with_attempt(claim("k"), "a-1")).await;
    let again = claimed(&store, with_attempt(claim("k"), "a-1")).await;
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.attempt, 1);
    assert!(again.lease_expires_at >= first.lease_expires_at);
}

async fn a_lease_that_ran_out_is_taken_over_with_a_higher_token_and_the_checkpoint<S: Store>(
    store: S,
    database: &TestDatabase,
) {
    let first = claimed(&store, with_lease(claim("k"), Duration::from_millis(300))).await;
    let mut saving = extend("k", first.lease_token, Duration::from_millis(300));
    saving.checkpoint = Some(Checkpoint::parse(b"step-2".to_vec()).expect("checkpoint"));
    let lease_end = extended(&store, saving).await;
    until_database_clock_passes(database, lease_end).await;

    let taken = claimed(&store, claim("k")).await;
    assert!(taken.lease_token.get() > first.lease_token.get());
    assert_eq!(taken.attempt, 2);
    assert_eq!(taken.checkpoint.as_deref(), Some(&b"step-2"[..]));
}

async fn tokens_are_never_reused_across_a_keys_lives<S: Store>(store: S, _: &TestDatabase) {
    let first = claimed(&store, claim("k")).await;
    released(&store, release("k", first.lease_token)).await;
    let second = claimed(&store, claim("k")).await;
    assert!(second.lease_token.get() > first.lease_token.get());
    assert_eq!(second.attempt, 1, "a released key starts fresh");
    assert_eq!(
        complete_answer(&store, "k", first.lease_token, b"late").await,
        Err(idempotency_coordinator::domain::Rejection::LeaseLost),
        "the earlier life's token is refused"
    );
}

store_suite!(
    a_fresh_key_is_started_and_a_second_caller_finds_it_in_progress,
    another_fingerprint_is_a_mismatch_even_with_the_holders_attempt_id,
    the_holders_attempt_id_re_enters_with_the_same_token,
    a_lease_that_ran_out_is_taken_over_with_a_higher_token_and_the_checkpoint,
    tokens_are_never_reused_across_a_keys_lives,
);

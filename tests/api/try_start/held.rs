//! The store below the service, with a key another transaction holds: a statement waits only
//! briefly for a row lock, then fails with `KeyHeld` having written nothing (shared, when it
//! carried other calls), and only a patient store waits for the lock up to the lock budget.
//! What a caller meets (every other call answered at once, the held key's own callers told to
//! retry at their lock budget) is proven through the RPCs in `tests/api/held_keys.rs`.

use std::time::{Duration, Instant};

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{
    CompleteCommand, Key, LeaseToken, ResponseBody, Scope, TryStartOutcome,
};
use idempotency_coordinator::store::Store;

use crate::support::*;

/// Keys of one test, in key order: a prefix each, then `suffix`.
fn keys(prefixes: &[&str], suffix: &str) -> Vec<String> {
    prefixes
        .iter()
        .map(|prefix| format!("{prefix}-{suffix}"))
        .collect()
}

/// How the key is held.
#[derive(Clone, Copy, Debug)]
enum Hold {
    /// Its row is locked (`SELECT … FOR UPDATE`), as a slow statement would.
    RowLock,
    /// Another transaction inserted it and has not committed.
    UncommittedInsert,
}

/// Far less than the lock budget (1 s at the default operation timeout): a statement that met
/// a held key answered after its brief first wait, not after the lock budget.
const BRIEFLY: Duration = Duration::from_millis(500);

async fn a_shared_claim_that_meets_a_held_key_fails_whole_and_briefly(hold: Hold) {
    let (app, mut client) = app_and_client(Backend::Postgres).await;
    let suffix = unique_key("held");
    let keys = keys(&["a", "b", "c", "d", "e"], &suffix);
    let held = keys[1].clone();

    let mut session = raw::session(&app.database.url).await;
    if let Hold::RowLock = hold {
        claim(&mut client, try_start(&held)).await;
    }
    raw::run(&mut session, "BEGIN").await;
    match hold {
        Hold::RowLock => raw::lock_key(&mut session, &held).await,
        Hold::UncommittedInsert => {
            raw::insert_claim(&mut session, &held, false).await;
        }
    }

    let round = Round::new(
        keys.iter()
            .map(|key| store_try_start(key, "batch-attempt"))
            .collect(),
    )
    .expect("distinct keys");
    let began = Instant::now();
    let answers = app.store.try_start_batch(&round).await;
    assert!(began.elapsed() < BRIEFLY, "{hold:?}: {:?}", began.elapsed());
    for answer in answers {
        let error = answer.expect_err("the shared statement failed");
        assert_eq!(error.key_held(), Some(true), "{hold:?}: {error:?}");
        assert!(error.is_transient(), "{hold:?}: retry later: {error:?}");
    }
    // It wrote nothing: the keys not held are absent.
    for key in keys.iter().filter(|key| **key != held) {
        assert!(is_absent(&client, key).await, "{hold:?}: {key} was written");
    }

    // A lone claim of the held key says the key is its own; a patient one waits up to the lock
    // budget, and gets the key once the hold ends within it.
    let lone = app.store.try_start(&store_try_start(&held, "lone")).await;
    assert_eq!(
        lone.expect_err("held").key_held(),
        Some(false),
        "{hold:?}: a lone statement's held key is its own"
    );
    let patient = app.patient_store(Duration::from_secs(4));
    let claimed = tokio::spawn(async move {
        let command = store_try_start(&held, "patient");
        patient.try_start(&command).await
    });
    app.wait_for_blocked(0).await;
    raw::run(&mut session, "ROLLBACK").await;
    let claimed = claimed.await.expect("the patient claim's task");
    // Once the hold ends: the claimed key is still its first caller's; the insert rolled back
    // leaves the key absent, and the patient claim takes it.
    let answered_as_expected = match hold {
        Hold::RowLock => matches!(claimed, Ok(TryStartOutcome::InProgress { .. })),
        Hold::UncommittedInsert => matches!(claimed, Ok(TryStartOutcome::Started(_))),
    };
    assert!(
        answered_as_expected,
        "{hold:?}: answered once the hold ends: {claimed:?}"
    );
}

#[tokio::test]
async fn a_shared_claim_that_meets_a_locked_row_fails_whole_and_briefly() {
    a_shared_claim_that_meets_a_held_key_fails_whole_and_briefly(Hold::RowLock).await;
}

#[tokio::test]
async fn a_shared_claim_that_meets_an_uncommitted_insert_fails_whole_and_briefly() {
    a_shared_claim_that_meets_a_held_key_fails_whole_and_briefly(Hold::UncommittedInsert).await;
}

/// The same for Complete: the statement that met the held key fails whole, at once, and
/// completes nothing.
#[tokio::test]
async fn a_shared_completion_that_meets_a_locked_row_fails_whole_and_briefly() {
    let (app, mut client) = app_and_client(Backend::Postgres).await;
    let suffix = unique_key("held");
    let keys = keys(&["a", "b", "c"], &suffix);
    let mut commands = Vec::new();
    for key in &keys {
        let started = claim(&mut client, try_start(key)).await;
        commands.push(CompleteCommand {
            namespace: Scope::parse(NAMESPACE.into()).expect("namespace"),
            key: Key::parse(key.clone()).expect("key"),
            lease_token: LeaseToken::parse(started.lease_token).expect("token"),
            response: ResponseBody::parse(b"done".to_vec(), 1 << 20).expect("response"),
            retention: None,
        });
    }
    let hold = app.database.hold_key(&keys[0]).await;
    let began = Instant::now();
    let answers = app
        .store
        .complete_batch(&Round::new(commands).expect("distinct keys"))
        .await;
    assert!(began.elapsed() < BRIEFLY, "{:?}", began.elapsed());
    for answer in answers {
        let error = answer.expect_err("the shared statement failed");
        assert_eq!(error.key_held(), Some(true), "{error:?}");
    }
    hold.release().await;
    for key in &keys {
        looked_up_in_progress(&client, key).await;
    }
}

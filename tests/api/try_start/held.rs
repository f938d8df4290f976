//! A key that another transaction holds for longer than the lock budget (a slow statement of
//! another replica, a pooled transaction cut off between its statements, an operator's session)
//! fails only its own callers: the shared statement that met it is run again without it, and
//! every other call of the batch is answered while the key is still held.

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{
    CompleteCommand, Key, LeaseToken, ResponseBody, Scope, TryStartOutcome,
};
use idempotency_coordinator::store::Store;
use tonic::Code;

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

/// The operation timeout of these tests: the lock budget is a fifth of it.
const OPERATION_TIMEOUT: &str = "1s";

async fn a_held_key_fails_only_its_own_callers_in_a_shared_claim(hold: Hold) {
    let (app, mut client) = app_and_client_with(
        Backend::Postgres,
        &["--operation-timeout", OPERATION_TIMEOUT],
    )
    .await;
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

    // Every call of the batch is answered while the key is still held.
    let round = Round::new(
        keys.iter()
            .map(|key| store_try_start(key, "batch-attempt"))
            .collect(),
    )
    .expect("distinct keys");
    let answers = app.store.try_start_batch(round).await;
    for (key, answer) in keys.iter().zip(answers) {
        if *key == held {
            let error = answer.expect_err("the held key's caller is not answered started");
            assert!(error.is_transient(), "{hold:?}: retry later: {error:?}");
        } else {
            match answer {
                Ok(TryStartOutcome::Started(_)) => {}
                other => panic!("{hold:?}: {key} is not held, yet: {other:?}"),
            }
        }
    }

    // The key is still held past the operation timeout: its own caller is told to retry.
    let status = client
        .try_start(try_start(&held))
        .await
        .expect_err("the key is still held");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");

    raw::run(&mut session, "ROLLBACK").await;
    let answer = try_start_response(&client, try_start(&held)).await;
    assert!(
        answer.outcome.is_some(),
        "{hold:?}: answered once the hold ends: {answer:?}"
    );
}

#[tokio::test]
async fn a_row_locked_past_the_operation_timeout_fails_only_its_own_claims() {
    a_held_key_fails_only_its_own_callers_in_a_shared_claim(Hold::RowLock).await;
}

#[tokio::test]
async fn an_insert_uncommitted_past_the_operation_timeout_fails_only_its_own_claims() {
    a_held_key_fails_only_its_own_callers_in_a_shared_claim(Hold::UncommittedInsert).await;
}

/// The same for Complete: the held key's Complete is told to retry, the others complete.
#[tokio::test]
async fn a_row_locked_past_the_operation_timeout_fails_only_its_own_completion() {
    let (app, mut client) = app_and_client_with(
        Backend::Postgres,
        &["--operation-timeout", OPERATION_TIMEOUT],
    )
    .await;
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
    let answers = app
        .store
        .complete_batch(Round::new(commands).expect("distinct keys"))
        .await;
    let mut answers = answers.into_iter();
    let held = answers.next().expect("an answer per call");
    assert!(
        held.as_ref().is_err_and(|error| error.is_transient()),
        "the held key's Complete is told to retry: {held:?}"
    );
    for answer in answers {
        assert!(
            matches!(answer, Ok(Ok(_))),
            "a key not held completes: {answer:?}"
        );
    }
    hold.release().await;
}

//! A key that another transaction holds for longer than the lock budget (a slow statement of
//! another replica, a pooled transaction cut off between its statements, an operator's session)
//! fails only its own callers: the shared statement that met it is run again without it, and
//! every other call of the batch is answered while the key is still held.

use std::time::Duration;

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{
    AttemptId, CompleteCommand, Fingerprint, Key, KeyRetention, LeaseToken, LeaseTtl, ResponseBody,
    Scope, TryStartCommand, TryStartOutcome,
};
use idempotency_coordinator::store::Store;
use sqlx::{Connection, PgConnection};
use tonic::Code;

use crate::support::*;

fn claim_command(key: &str) -> TryStartCommand {
    TryStartCommand {
        namespace: Scope::parse(NAMESPACE.into()).expect("namespace"),
        key: Key::parse(key.into()).expect("key"),
        fingerprint: Fingerprint::parse(FINGERPRINT.to_vec()).expect("fingerprint"),
        lease_ttl: LeaseTtl::parse(Duration::from_secs(30)).expect("lease"),
        retention: KeyRetention::parse(Duration::from_secs(3600)).expect("retention"),
        attempt_id: AttemptId::parse("batch-attempt".into()).expect("attempt id"),
    }
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
    let app = TestApp::spawn_with(
        Backend::Postgres,
        &["--operation-timeout", OPERATION_TIMEOUT],
    )
    .await;
    let mut client = app.client().await;
    let suffix = unique_key("held");
    let keys: Vec<String> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|prefix| format!("{prefix}-{suffix}"))
        .collect();
    let held = keys[1].clone();

    let mut session = PgConnection::connect(&app.database.url)
        .await
        .expect("a raw session");
    if let Hold::RowLock = hold {
        claim(&mut client, try_start(&held)).await;
    }
    sqlx::query("BEGIN")
        .execute(&mut session)
        .await
        .expect("begin");
    match hold {
        Hold::RowLock => {
            sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
                .bind(&held)
                .execute(&mut session)
                .await
                .expect("lock the row");
        }
        Hold::UncommittedInsert => {
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (namespace, key, fingerprint, lease_token, attempt, lease_expires_at,
                      retention_us, expires_at)
                 VALUES ($1, $2, $3, nextval('lease_token_seq'), 1, now() + interval '30 s',
                         3600000000, now() + interval '1 hour')",
            )
            .bind(NAMESPACE)
            .bind(&held)
            .bind(FINGERPRINT)
            .execute(&mut session)
            .await
            .expect("insert the key");
        }
    }

    // Every call of the batch is answered while the key is still held.
    let round =
        Round::new(keys.iter().map(|key| claim_command(key)).collect()).expect("distinct keys");
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

    sqlx::query("ROLLBACK")
        .execute(&mut session)
        .await
        .expect("let the key go");
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
    let app = TestApp::spawn_with(
        Backend::Postgres,
        &["--operation-timeout", OPERATION_TIMEOUT],
    )
    .await;
    let mut client = app.client().await;
    let suffix = unique_key("held");
    let keys: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|prefix| format!("{prefix}-{suffix}"))
        .collect();
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

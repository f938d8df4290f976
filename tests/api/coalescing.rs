//! Concurrent calls share statements (coalescing is on by default); each caller must still get
//! exactly its own answer, with duplicates of a key resolved as if they came one after another.

use std::collections::HashMap;

use idempotency_coordinator::domain::TryStartOutcome;
use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::proto::idempotency::v1::{
    TryStartRequest, lookup_response::State, try_start_response::Outcome,
};
use idempotency_coordinator::store::{Store, StoreError};
use tonic::Code;

use crate::support::*;

async fn concurrent_calls_each_get_their_own_answer(backend: Backend) {
    const KEYS: usize = 100;
    let (app, client) = app_and_client_with(backend, &["--metrics-listen", "127.0.0.1:0"]).await;
    let batched = || async {
        let samples = crate::metrics::samples(&crate::metrics::scrape(&app).await);
        (
            crate::metrics::batches_of_several(&samples, "TryStart"),
            crate::metrics::batches_of_several(&samples, "Complete"),
        )
    };
    let before = batched().await;

    // Two callers per key, with different requests: one claim, one mismatch, per key.
    let claims = (0..2 * KEYS).map(|call| {
        let mut client = client.clone();
        let key = format!("shared-{}", call % KEYS);
        let fingerprint = format!("request-{}", call / KEYS).into_bytes();
        tokio::spawn(async move {
            let request = TryStartRequest {
                fingerprint: fingerprint.clone(),
                attempt_id: format!("attempt-{call}"),
                ..try_start(&key)
            };
            let answer = client.try_start(request).await.expect("TryStart");
            (key, fingerprint, outcome(answer.into_inner()))
        })
    });
    let mut winners: HashMap<String, (Vec<u8>, u64)> = HashMap::new();
    let mut mismatches = 0;
    for claim in futures::future::join_all(claims).await {
        let (key, fingerprint, outcome) = claim.expect("task");
        match outcome {
            Outcome::Started(started) => {
                assert_eq!(started.attempt, 1);
                let previous = winners.insert(key.clone(), (fingerprint, started.lease_token));
                assert!(previous.is_none(), "{key} has two winners");
            }
            Outcome::FingerprintMismatch(_) => mismatches += 1,
            other => panic!("{key}: unexpected {other:?}"),
        }
    }
    assert_eq!((winners.len(), mismatches), (KEYS, KEYS));

    // Every winner completes with its own token, all at once, among callers with a wrong one.
    let completions = winners.iter().flat_map(|(key, (fingerprint, token))| {
        let right = {
            let mut client = client.clone();
            let (key, fingerprint, token) = (key.clone(), fingerprint.clone(), *token);
            tokio::spawn(async move {
                let answer = client.complete(complete(&key, token, &fingerprint)).await;
                (key, true, answer.map(drop))
            })
        };
        let wrong = {
            let mut client = client.clone();
            let (key, token) = (key.clone(), *token);
            tokio::spawn(async move {
                let answer = client
                    .complete(complete(&key, token + 1_000_000, b"x"))
                    .await;
                (key, false, answer.map(drop))
            })
        };
        [right, wrong]
    });
    for completion in futures::future::join_all(completions).await {
        let (key, right, answer) = completion.expect("task");
        if right {
            answer.unwrap_or_else(|status| panic!("{key}: its holder's Complete: {status:?}"));
        } else {
            let status = answer.expect_err("a token that is not the holder's");
            assert_error(&status, Code::Aborted, "LEASE_LOST");
        }
    }

    // Each key holds its own winner's response: no answer went to another caller.
    for (key, (fingerprint, _)) in &winners {
        match key_state(&client, key).await {
            State::Completed(done) => {
                assert_eq!(&done.response, fingerprint, "{key}");
                assert_eq!(&done.fingerprint, fingerprint, "{key}");
            }
            other => panic!("{key}: {other:?}"),
        }
    }

    // And the calls did share statements, as the service itself reports: batches of several
    // TryStarts and of several Completes went to the store (with coalescing off, none would).
    let after = batched().await;
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "batches of several calls (TryStart, Complete): before {before:?}, after {after:?}"
    );
}

async fn duplicates_of_a_key_in_one_burst_behave_as_if_one_after_another(backend: Backend) {
    // The 50 calls of one key run in 50 rounds, one after another, each within its queue
    // budget (a tenth of the operation timeout): a longer timeout keeps a loaded machine from
    // answering the last ones "timed out", which the contract allows but this test is not about.
    let app = TestApp::spawn_with(backend, &["--operation-timeout", "60s"]).await;
    let client = app.client().await;
    let key = unique_key("burst");
    // Fifty claims of one key with the same attempt_id: one claim, and 49 re-entries that get
    // the very same token (never a takeover, never in_progress).
    let calls = (0..50).map(|_| {
        let client = client.clone();
        let request = TryStartRequest {
            attempt_id: "same-attempt".into(),
            ..try_start(&key)
        };
        tokio::spawn(async move { expect_started(try_start_response(&client, request).await) })
    });
    let claims: Vec<_> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(|claim| claim.expect("task"))
        .collect();
    assert!(
        claims
            .iter()
            .all(|c| c.lease_token == claims[0].lease_token && c.attempt == 1)
    );
}

/// A claim that waited for a key's row must draw its token once it holds the row: had it drawn
/// it when it began, a claim committed meanwhile (here, by "another replica") would hold a newer
/// token than the one handed out after it, and fencing downstream would fail both ways.
#[tokio::test]
async fn a_claim_that_waited_for_the_row_gets_a_token_above_the_one_claimed_meanwhile() {
    let (app, mut client) = app_and_client(Backend::Postgres).await;
    let key = unique_key("waited");
    let first = claim(&mut client, try_start(&key)).await;

    let hold = app.database.hold_key(&key).await;
    let waiting = spawn_try_start(&client, try_start(&key).with_attempt("waiting-attempt"));
    app.wait_for_blocked(1).await;
    let meanwhile = hold.claim_with_expired_lease_and_commit(&key).await;
    assert!(meanwhile > first.lease_token);

    let taken_over = expect_started(waiting.await.expect("task").expect("TryStart").into_inner());
    assert_eq!(
        taken_over.attempt, 3,
        "a takeover of the claim made meanwhile"
    );
    assert!(
        taken_over.lease_token > meanwhile,
        "token {} was handed out after {meanwhile}",
        taken_over.lease_token
    );
}

/// A PostgreSQL server whose calls may take 30 s, with `held` claimed and its row then held
/// from outside; and a client of the server.
async fn patient_server_with_a_held_key(held: &str) -> (TestApp, Client, database::KeyHold) {
    let (app, mut client) =
        app_and_client_with(Backend::Postgres, &["--operation-timeout", "30s"]).await;
    claim(&mut client, try_start(held)).await;
    let hold = app.database.hold_key(held).await;
    (app, client, hold)
}

/// One shared claim statement of `keys` by `attempt`, run patiently (as a call whose key is
/// held runs) in a task of its own.
fn patient_shared_claim(
    app: &TestApp,
    keys: [&str; 2],
    attempt: &str,
) -> tokio::task::JoinHandle<Vec<Result<TryStartOutcome, StoreError>>> {
    let store = app.patient_store(std::time::Duration::from_secs(25));
    let commands = keys.map(|key| store_try_start(key, attempt)).to_vec();
    let round = Round::new(commands).expect("distinct keys");
    tokio::spawn(async move { store.try_start_batch(&round).await })
}

/// The same for a shared statement, which takes its keys in order: a claim of a key that
/// comes after a held one draws its token, and starts its lease, only once the held row is the
/// statement's, and the held key's takeover draws a token above the one claimed meanwhile.
#[tokio::test]
async fn a_shared_claim_statement_draws_tokens_and_starts_leases_in_key_order() {
    let suffix = unique_key("order");
    let (held, fresh) = (format!("a-held-{suffix}"), format!("b-fresh-{suffix}"));
    let (app, _client, hold) = patient_server_with_a_held_key(&held).await;
    let batch = patient_shared_claim(&app, [&held, &fresh], "batch-attempt");
    eventually(
        std::time::Duration::from_secs(10),
        "the shared statement waits for the held row",
        || async { app.database.blocked_postgres_statements().await >= 1 },
    )
    .await;
    let before_release = app.db_now().await;
    let meanwhile = hold.claim_with_expired_lease_and_commit(&held).await;

    let mut outcomes = batch.await.expect("task").into_iter();
    let (Some(Ok(held_outcome)), Some(Ok(fresh_outcome))) = (outcomes.next(), outcomes.next())
    else {
        panic!("two answers expected");
    };
    for (name, outcome) in [("held", held_outcome), ("fresh", fresh_outcome)] {
        let TryStartOutcome::Started(started) = outcome else {
            panic!("{name}: {outcome:?}");
        };
        assert!(
            started.lease_token.get() > meanwhile as i64,
            "{name}: token {} was handed out after {meanwhile}",
            started.lease_token.get()
        );
        let lease_began = started.lease_expires_at - chrono::Duration::seconds(30);
        assert!(
            lease_began > before_release,
            "{name}: its lease began at {lease_began}, while the row was still held at \
             {before_release}"
        );
    }
}

/// Shared claim statements lock keys in one order even when a key appears while they run:
/// one statement waits on a held key while another call claims a key it has yet to reach, and a
/// second statement needs both. Locking the rows a statement could see first, then inserting
/// the rest, would deadlock here (and PostgreSQL would abort one of them).
#[tokio::test]
async fn shared_claims_do_not_deadlock_when_a_key_appears_while_they_wait() {
    let suffix = unique_key("order");
    let (first, second) = (format!("a-{suffix}"), format!("b-{suffix}"));
    let (app, client, hold) = patient_server_with_a_held_key(&second).await;

    let batch = |attempt| patient_shared_claim(&app, [&first, &second], attempt);
    let blocked = |count: i64| {
        let database = &app.database;
        eventually(
            std::time::Duration::from_secs(10),
            "statements wait for locks",
            move || async move { database.blocked_postgres_statements().await >= count },
        )
    };
    let earlier = batch("earlier");
    blocked(1).await;
    let single = spawn_try_start(&client, try_start(&first).with_attempt("single"));
    eventually(
        std::time::Duration::from_secs(10),
        "the single claim finished or waits",
        || async { single.is_finished() || app.database.blocked_postgres_statements().await >= 2 },
    )
    .await;
    let later = batch("later");
    blocked(if single.is_finished() { 2 } else { 3 }).await;
    hold.release().await;

    let earlier: Vec<_> = earlier.await.expect("task");
    let later: Vec<_> = later.await.expect("task");
    for outcome in earlier.iter().chain(&later) {
        assert!(outcome.is_ok(), "no statement was aborted: {outcome:?}");
    }
    assert!(
        matches!(earlier[0], Ok(TryStartOutcome::Started(_))),
        "the earlier statement claimed the first key before it waited: {:?}",
        earlier[0]
    );
    let single = single.await.expect("task").expect("TryStart").into_inner();
    assert!(
        matches!(single.outcome, Some(Outcome::InProgress(_))),
        "{single:?}"
    );
}

for_each_backend!(
    concurrent_calls_each_get_their_own_answer,
    duplicates_of_a_key_in_one_burst_behave_as_if_one_after_another,
);

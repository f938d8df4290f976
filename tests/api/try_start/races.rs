//! Claims at the same time: exactly one winner among concurrent claims and among concurrent
//! takeovers, and a claim that waited for the row acts on the key as it is once it has it.

use idempotency_coordinator::proto::idempotency::v1::TryStartRequest;
use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;

use crate::support::*;

async fn two_hundred_concurrent_claims_of_one_key_have_exactly_one_winner(backend: Backend) {
    // No statement carries a key twice: calls of one key that queue together go in successive
    // rounds, but a call that the answer before it decides (the key is held, or completed) is
    // answered from that answer without a statement of its own. The test is about who wins, not
    // about the machine's speed: a generous timeout keeps a loaded machine's stalls out of it.
    // The replay cache is off, so that a call answered without a statement was answered from
    // the answer before it, not from memory.
    let (app, client) = crate::metrics::metered(
        backend,
        &["--operation-timeout", "30s", "--replay-cache-bytes", "0"],
    )
    .await;
    let key = unique_key("race");

    // Each call its own attempt, as the clients send them: only a holder's own attempt would
    // re-enter, so every call behind the claim may be answered from the answer before it.
    let calls = (0..200).map(|call| {
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let request = TryStartRequest {
                attempt_id: format!("attempt-{call}"),
                ..try_start(&key)
            };
            let outcome = outcome(
                client
                    .try_start(request)
                    .await
                    .expect("TryStart")
                    .into_inner(),
            );
            // The winner completes at once, so that later callers may see `completed`.
            if let Outcome::Started(started) = &outcome {
                complete_key(&client, &key, started.lease_token, b"the one result").await;
            }
            outcome
        })
    });
    let outcomes = futures::future::join_all(calls).await;

    let (mut started, mut in_progress, mut completed) = (0, 0, 0);
    for outcome in outcomes {
        match outcome.expect("task") {
            Outcome::Started(_) => started += 1,
            Outcome::InProgress(_) => in_progress += 1,
            Outcome::Completed(done) => {
                assert_eq!(done.response, b"the one result");
                completed += 1;
            }
            Outcome::FingerprintMismatch(_) => panic!("same fingerprint cannot mismatch"),
        }
    }
    assert_eq!(started, 1, "exactly one claim wins");
    assert_eq!(started + in_progress + completed, 200);
    assert_eq!(app.count_rows("idempotency_keys").await, 1);
    let samples = crate::metrics::samples(&crate::metrics::scrape(&app).await);
    let count = |series: &str| samples.get(series).copied().unwrap_or_default();
    let statements = count("idempotency_store_seconds_count{operation=\"TryStart\"}");
    let followers = count("idempotency_coalesced_followers_total{coalescer=\"TryStart\"}");
    assert!(
        followers > 0.0 && statements + followers == 200.0,
        "calls that followed an earlier answer of their key ran no statement: {statements} \
         TryStart statements and {followers} followers for 200 calls"
    );
}

async fn concurrent_takeovers_of_an_expired_lease_have_exactly_one_winner(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("takeover-race");
    let first = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;

    let calls: Vec<_> = (0..50)
        .map(|_| spawn_try_start(&client, try_start(&key)))
        .collect();
    let mut winners = Vec::new();
    for call in calls {
        match outcome(answer_of(call).await) {
            Outcome::Started(started) => winners.push(started),
            Outcome::InProgress(in_progress) => assert_eq!(in_progress.attempt, 2),
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one takeover");
    assert_eq!(winners[0].attempt, 2, "the attempt count went up once");
    assert!(winners[0].lease_token > first.lease_token);
}

async fn a_claim_that_waited_while_the_key_expired_claims_it_afresh(backend: Backend) {
    // The row stays locked for the key's whole retention (2 s): the claim must be let wait for
    // it (a fifth of the operation timeout) rather than be told to retry.
    let (app, mut client) = app_and_client_with(backend, &["--operation-timeout", "20s"]).await;
    let key = unique_key("expired-while-waiting");
    let request = try_start(&key)
        .with_attempt("holder")
        .with_retention(secs(2))
        .with_lease(millis(200));
    let held = claim(&mut client, request.clone()).await;
    let lock = app.database.hold_key(&key).await;
    // The holder's retry starts while the key is live, then waits for the row...
    let retry = spawn_try_start(&client, request);
    app.wait_for_blocked(1).await;
    // ...during which the key's retention ends, so that the key is absent for everyone. (Were
    // the setup slower than the retention, the retry would not have waited while the key was
    // live, and this test would prove nothing: so that is checked first.)
    let expires_at = app.database.key_expires_at(&key).await;
    let blocked_at = app.db_now().await;
    assert!(
        blocked_at < expires_at,
        "the retry was seen waiting at {blocked_at}, after the key expired at {expires_at}"
    );
    wait_for_db_clock_past(&app, expires_at, "the key expired").await;
    assert!(is_absent(&client, &key).await);
    lock.release().await;

    // The waiting claim must act on the key as it is now (absent), not as it was when the call
    // began: a fresh claim, not a re-entry that would revive the expired one.
    let fresh = expect_started(answer_of(retry).await);
    assert_eq!(fresh.attempt, 1);
    assert!(
        fresh.lease_token > held.lease_token,
        "a new claim, not the expired one"
    );
}

async fn a_claim_racing_the_reaper_for_an_expired_key_starts_fresh(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("reaped");
    claim_and_let_expire(&mut client, &key).await;
    // A reaper's transaction holds the expired row; the claim waits for it; the reaper deletes
    // the row and commits.
    let reaper = app.database.hold_key(&key).await;
    let claiming = spawn_try_start(&client, try_start(&key));
    app.wait_for_blocked(1).await;
    reaper.delete_and_commit(&key).await;

    let started = expect_started(answer_of(claiming).await);
    assert_eq!(started.attempt, 1);
    assert_eq!(app.count_rows("idempotency_keys").await, 1);
}

for_each_backend!(
    two_hundred_concurrent_claims_of_one_key_have_exactly_one_winner,
    concurrent_takeovers_of_an_expired_lease_have_exactly_one_winner,
    a_claim_that_waited_while_the_key_expired_claims_it_afresh,
    a_claim_racing_the_reaper_for_an_expired_key_starts_fresh,
);

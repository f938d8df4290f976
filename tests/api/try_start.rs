use std::collections::HashSet;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;
use idempotency_coordinator::proto::idempotency::v1::{
    ExtendLeaseRequest, TryStartRequest, lookup_response::State,
};
use tonic::Code;

use crate::support::*;

async fn a_fresh_claim_starts_attempt_one_with_a_lease_from_the_database_clock(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("fresh");

    let before = app.db_now().await;
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(10),
            ..try_start(&key)
        },
    )
    .await;
    let after = app.db_now().await;

    assert!(started.lease_token > 0);
    assert_eq!(started.attempt, 1);
    assert_eq!(started.checkpoint, None, "a fresh claim has no checkpoint");
    let lease_start = instant(&started.lease_expires_at) - chrono::Duration::seconds(10);
    assert!(
        before <= lease_start && lease_start <= after,
        "lease must be the database's now + lease_ttl"
    );
}

async fn a_running_lease_answers_in_progress_with_the_holders_expiry(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("busy");
    let started = claim(&mut client, try_start(&key)).await;

    let second = client.try_start(try_start(&key)).await.expect("TryStart");
    let in_progress = expect_in_progress(second.into_inner());
    assert_eq!(in_progress.lease_expires_at, started.lease_expires_at);
    assert_eq!(in_progress.attempt, 1);
}

async fn the_default_lease_is_thirty_seconds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let before = app.db_now().await;
    let started = claim(&mut client, try_start(&unique_key("default"))).await;
    let after = app.db_now().await;
    let lease_start = instant(&started.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(before <= lease_start && lease_start <= after);
}

async fn another_fingerprint_is_a_mismatch_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("mismatch");
    let started = claim(&mut client, try_start(&key)).await;

    let other = TryStartRequest {
        fingerprint: b"another request".to_vec(),
        attempt_id: "attempt-a".into(),
        ..try_start(&key)
    };
    expect_mismatch(try_start_response(&client, other.clone()).await);
    match key_state(&client, &key).await {
        State::InProgress(held) => {
            assert_eq!(held.fingerprint, FINGERPRINT);
            assert_eq!(held.lease_expires_at, started.lease_expires_at);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }

    client
        .complete(complete(&key, started.lease_token, b"done"))
        .await
        .expect("Complete");
    expect_mismatch(try_start_response(&client, other).await);
}

async fn an_empty_fingerprint_matches_only_an_empty_fingerprint(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("empty-fp");
    let empty = TryStartRequest {
        fingerprint: Vec::new(),
        ..try_start(&key)
    };
    claim(&mut client, empty.clone()).await;
    expect_in_progress(try_start_response(&client, empty).await);
    expect_mismatch(try_start_response(&client, try_start(&key)).await);
}

async fn a_completed_key_replays_the_stored_response(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("replay");
    let request = TryStartRequest {
        attempt_id: "holder".into(),
        ..try_start(&key)
    };
    let started = claim(&mut client, request.clone()).await;
    let completion = client
        .complete(complete(
            &key,
            started.lease_token,
            b"{\"charge\":\"ch_1\"}",
        ))
        .await
        .expect("Complete")
        .into_inner();

    // Everybody gets the replay, the holder's own attempt_id included: completed comes before
    // attempt_id in TryStart's order.
    for replay_request in [request, try_start(&key)] {
        let replay = expect_completed(try_start_response(&client, replay_request).await);
        assert_eq!(replay.response, b"{\"charge\":\"ch_1\"}");
        assert_eq!(replay.completed_at, completion.completed_at);
        assert_eq!(replay.expires_at, completion.expires_at);
    }
}

async fn two_hundred_concurrent_claims_of_one_key_have_exactly_one_winner(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = app.client().await;
    let key = unique_key("race");

    let calls = (0..200).map(|_| {
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let outcome = outcome(
                client
                    .try_start(try_start(&key))
                    .await
                    .expect("TryStart")
                    .into_inner(),
            );
            // The winner completes at once, so that later callers may see `completed`.
            if let Outcome::Started(started) = &outcome {
                client
                    .complete(complete(&key, started.lease_token, b"the one result"))
                    .await
                    .expect("Complete");
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
}

async fn an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("takeover");
    let first = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(300),
            ..try_start(&key)
        },
    )
    .await;
    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(200),
            checkpoint: Some(b"step 3 of 5".to_vec()),
            ..extend(&key, first.lease_token)
        })
        .await
        .expect("ExtendLease");
    wait_for_lease_expiry(&app, &client, &key).await;

    let second = claim(&mut client, try_start(&key)).await;
    assert!(
        second.lease_token > first.lease_token,
        "tokens strictly increase"
    );
    assert_eq!(second.attempt, 2);
    assert_eq!(second.checkpoint.as_deref(), Some(&b"step 3 of 5"[..]));

    // The replaced holder is fenced off everywhere.
    let old = first.lease_token;
    let status = client
        .complete(complete(&key, old, b"late"))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    let status = client
        .extend_lease(extend(&key, old))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    let status = client
        .release(release(&key, old))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");

    // The new holder is unaffected by the refusals and completes.
    client
        .complete(complete(&key, second.lease_token, b"ok"))
        .await
        .expect("the new holder completes");
    // A stale token on a completed key is still LEASE_LOST: the token is checked first.
    let status = client
        .complete(complete(&key, old, b"ok"))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
}

async fn a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("attempts");
    let short = TryStartRequest {
        lease_ttl: millis(100),
        ..try_start(&key)
    };
    let mut token = 0;
    for expected_attempt in 1..=3 {
        let started = claim(&mut client, short.clone()).await;
        assert_eq!(started.attempt, expected_attempt);
        assert!(started.lease_token > token);
        token = started.lease_token;
        wait_for_lease_expiry(&app, &client, &key).await;
    }
    let restarted = claim(&mut client, short.clone()).await;
    client
        .release(release(&key, restarted.lease_token))
        .await
        .expect("Release");
    let fresh = claim(&mut client, short).await;
    assert_eq!(fresh.attempt, 1, "a released key starts over");
    assert!(
        fresh.lease_token > restarted.lease_token,
        "tokens are never reused"
    );
}

async fn the_same_attempt_id_gets_the_same_claim_back(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("reentry");
    let request = TryStartRequest {
        attempt_id: "request-7f3a".into(),
        lease_ttl: secs(5),
        ..try_start(&key)
    };
    let first = claim(&mut client, request.clone()).await;
    let again = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(20),
            ..request.clone()
        },
    )
    .await;
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.attempt, first.attempt);
    assert!(
        instant(&again.lease_expires_at) > instant(&first.lease_expires_at),
        "re-entry renews the lease to now + lease_ttl when that is later"
    );

    // A shorter lease on re-entry keeps the later expiry.
    let shorter = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..request.clone()
        },
    )
    .await;
    assert_eq!(shorter.lease_expires_at, again.lease_expires_at);

    // Another attempt_id, or none, is somebody else.
    let other = TryStartRequest {
        attempt_id: "request-other".into(),
        ..request
    };
    expect_in_progress(try_start_response(&client, other).await);
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
}

async fn re_entry_keeps_the_checkpoint_and_works_after_the_lease_ran_out(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("reentry-late");
    let request = TryStartRequest {
        attempt_id: "attempt-1".into(),
        lease_ttl: millis(200),
        ..try_start(&key)
    };
    let first = claim(&mut client, request.clone()).await;
    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(150),
            checkpoint: Some(b"halfway".to_vec()),
            ..extend(&key, first.lease_token)
        })
        .await
        .expect("ExtendLease");
    wait_for_lease_expiry(&app, &client, &key).await;

    // Nobody took over, so the holder's own retry still gets its claim, not a takeover.
    let before = app.db_now().await;
    let again = claim(&mut client, request).await;
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.attempt, 1);
    assert_eq!(again.checkpoint.as_deref(), Some(&b"halfway"[..]));
    assert!(instant(&again.lease_expires_at) >= before + chrono::Duration::milliseconds(200));
}

async fn an_empty_attempt_id_never_matches(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("no-attempt");
    claim(&mut client, try_start(&key)).await;
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
}

async fn an_abandoned_claim_stays_in_progress_and_keeps_refusing_other_fingerprints(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("abandoned");
    claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;

    let now = app.db_now().await;
    match key_state(&client, &key).await {
        State::InProgress(held) => assert!(instant(&held.lease_expires_at) < now),
        other => panic!("expected in_progress with a past lease, got {other:?}"),
    }
    let other = TryStartRequest {
        fingerprint: b"different".to_vec(),
        ..try_start(&key)
    };
    expect_mismatch(try_start_response(&client, other).await);
}

async fn tokens_come_from_one_sequence_across_keys(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let mut seen = HashSet::new();
    let mut last = 0;
    for index in 0..20 {
        let started = claim(&mut client, try_start(&format!("key-{index}"))).await;
        assert!(started.lease_token > last);
        assert!(seen.insert(started.lease_token));
        last = started.lease_token;
    }
}

async fn namespaces_are_separate(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("shared-name");
    claim(&mut client, try_start(&key)).await;
    let elsewhere = TryStartRequest {
        namespace: "other-service".into(),
        fingerprint: b"unrelated".to_vec(),
        ..try_start(&key)
    };
    let started = claim(&mut client, elsewhere).await;
    assert_eq!(started.attempt, 1);
}

async fn the_holders_own_attempt_id_with_another_fingerprint_is_a_mismatch(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("attempt-mismatch");
    let request = TryStartRequest {
        attempt_id: "same-attempt".into(),
        ..try_start(&key)
    };
    claim(&mut client, request.clone()).await;
    let other = TryStartRequest {
        fingerprint: b"another body".to_vec(),
        ..request
    };
    expect_mismatch(try_start_response(&client, other).await);
}

async fn after_a_takeover_the_old_attempt_id_is_somebody_else(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("attempt-takeover");
    let old = TryStartRequest {
        attempt_id: "old-attempt".into(),
        lease_ttl: millis(100),
        ..try_start(&key)
    };
    claim(&mut client, old.clone()).await;
    wait_for_lease_expiry(&app, &client, &key).await;
    let new = TryStartRequest {
        attempt_id: "new-attempt".into(),
        lease_ttl: secs(30),
        ..try_start(&key)
    };
    let taken = claim(&mut client, new.clone()).await;
    assert_eq!(taken.attempt, 2);

    let old_retry = client.try_start(old).await.expect("TryStart").into_inner();
    assert_eq!(expect_in_progress(old_retry).attempt, 2);
    let new_retry = claim(&mut client, new).await;
    assert_eq!(new_retry.lease_token, taken.lease_token);
}

async fn re_entry_stretches_retention_to_cover_the_renewed_lease(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("reentry-retention");
    let request = TryStartRequest {
        attempt_id: "a".into(),
        retention: secs(1),
        lease_ttl: millis(500),
        ..try_start(&key)
    };
    claim(&mut client, request.clone()).await;
    let again = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(3600),
            ..request
        },
    )
    .await;
    let expires_at = app.database.key_expires_at(&key).await;
    assert!(expires_at >= instant(&again.lease_expires_at));
}

async fn concurrent_takeovers_of_an_expired_lease_have_exactly_one_winner(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("takeover-race");
    let first = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;

    let calls = (0..50).map(|_| {
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            outcome(
                client
                    .try_start(try_start(&key))
                    .await
                    .expect("TryStart")
                    .into_inner(),
            )
        })
    });
    let mut winners = Vec::new();
    for answer in futures::future::join_all(calls).await {
        match answer.expect("task") {
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
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("expired-while-waiting");
    let request = TryStartRequest {
        attempt_id: "holder".into(),
        retention: secs(1),
        lease_ttl: millis(200),
        ..try_start(&key)
    };
    let held = claim(&mut client, request.clone()).await;
    let lock = app.database.hold_key(&key).await;
    // The holder's retry starts while the key is live, then waits for the row...
    let retry = tokio::spawn({
        let mut client = client.clone();
        let request = request.clone();
        async move { client.try_start(request).await }
    });
    app.wait_for_blocked(1).await;
    // ...during which the key's retention ends, so that the key is absent for everyone.
    let expires_at = app.database.key_expires_at(&key).await;
    eventually(
        std::time::Duration::from_secs(5),
        "the key expired",
        || async { app.db_now().await > expires_at },
    )
    .await;
    assert!(matches!(key_state(&client, &key).await, State::Absent(_)));
    lock.release().await;

    // The waiting claim must act on the key as it is now (absent), not as it was when the call
    // began: a fresh claim, not a re-entry that would revive the expired one.
    let fresh = expect_started(retry.await.expect("task").expect("TryStart").into_inner());
    assert_eq!(fresh.attempt, 1);
    assert!(
        fresh.lease_token > held.lease_token,
        "a new claim, not the expired one"
    );
}

async fn a_claim_racing_the_reaper_for_an_expired_key_starts_fresh(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("reaped");
    claim(
        &mut client,
        TryStartRequest {
            retention: secs(1),
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    eventually(
        std::time::Duration::from_secs(5),
        "the key expired",
        || async { matches!(key_state(&client, &key).await, State::Absent(_)) },
    )
    .await;
    // A reaper's transaction holds the expired row; the claim waits for it; the reaper deletes
    // the row and commits.
    let reaper = app.database.hold_key(&key).await;
    let claiming = tokio::spawn({
        let mut client = client.clone();
        let key = key.clone();
        async move { client.try_start(try_start(&key)).await }
    });
    app.wait_for_blocked(1).await;
    reaper.delete_and_commit(&key).await;

    let started = expect_started(
        claiming
            .await
            .expect("task")
            .expect("TryStart")
            .into_inner(),
    );
    assert_eq!(started.attempt, 1);
    assert_eq!(app.count_rows("idempotency_keys").await, 1);
}

for_each_backend!(
    a_fresh_claim_starts_attempt_one_with_a_lease_from_the_database_clock,
    a_running_lease_answers_in_progress_with_the_holders_expiry,
    the_default_lease_is_thirty_seconds,
    another_fingerprint_is_a_mismatch_and_changes_nothing,
    an_empty_fingerprint_matches_only_an_empty_fingerprint,
    a_completed_key_replays_the_stored_response,
    two_hundred_concurrent_claims_of_one_key_have_exactly_one_winner,
    an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint,
    a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them,
    the_same_attempt_id_gets_the_same_claim_back,
    re_entry_keeps_the_checkpoint_and_works_after_the_lease_ran_out,
    an_empty_attempt_id_never_matches,
    an_abandoned_claim_stays_in_progress_and_keeps_refusing_other_fingerprints,
    tokens_come_from_one_sequence_across_keys,
    namespaces_are_separate,
    the_holders_own_attempt_id_with_another_fingerprint_is_a_mismatch,
    after_a_takeover_the_old_attempt_id_is_somebody_else,
    re_entry_stretches_retention_to_cover_the_renewed_lease,
    concurrent_takeovers_of_an_expired_lease_have_exactly_one_winner,
    a_claim_that_waited_while_the_key_expired_claims_it_afresh,
    a_claim_racing_the_reaper_for_an_expired_key_starts_fresh,
);

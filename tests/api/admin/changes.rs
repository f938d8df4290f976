//! The recorded changes: ForceRelease (the holder's lease is lost, the next claim gets a greater
//! token), EraseKey and EraseNamespace (the replay cache forgets at once, on every replica), and
//! the audit trail that records each with who, why and the record before.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;
use tonic::Code;

use super::*;

async fn a_forced_release_takes_the_key_from_its_holder_and_is_recorded(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    // A running lease: released whatever its token, not only once it ran out.
    let holder = claim(
        &mut client,
        try_start("payment-1")
            .with_lease(secs(600))
            .with_attempt("the crashed worker"),
    )
    .await;

    let released = released(&admin, "payment-1", "worker crashed at 3 a.m.").await;
    let before = released.released.expect("the record before");
    assert_eq!(before.lease_token, holder.lease_token);
    assert_eq!(before.state(), pb::AdminKeyState::InProgress);

    // The holder's later writes are refused as lease lost, and write nothing.
    for (rpc, outcome) in guarded_writes(&client, "payment-1", holder.lease_token).await {
        let status = outcome.expect_err(rpc);
        assert_error(&status, Code::Aborted, "LEASE_LOST");
    }
    // Nor may the holder re-enter with its attempt_id: the next claim takes the key over at
    // once, with a greater token.
    let next = claim(
        &mut client,
        try_start("payment-1").with_attempt("the crashed worker"),
    )
    .await;
    assert!(next.lease_token > holder.lease_token);
    assert_eq!(next.attempt, 2);

    let events = audit_events(&admin).await;
    let event = events.first().expect("the release is recorded");
    assert_eq!(event.id, released.audit_event_id);
    assert_eq!(event.action, "force_release");
    assert_eq!(event.actor, "loopback");
    assert_eq!(event.key, "payment-1");
    assert_eq!(event.reason, "worker crashed at 3 a.m.");
    let record: serde_json::Value =
        serde_json::from_str(&event.record_before_json).expect("the record before, as JSON");
    assert_eq!(record["lease_token"], holder.lease_token);
    assert_eq!(record["state"], "in_progress");
    assert!(event.at.is_some());
}

async fn only_an_in_progress_key_is_released_and_a_refusal_records_nothing(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    claim_and_complete(&mut client, "done", b"r").await;
    for (key, what, code) in [
        ("done", "a completed key", Code::FailedPrecondition),
        ("never", "an absent key", Code::NotFound),
    ] {
        let refused = admin
            .clone()
            .force_release(force_release(key, "mistake"))
            .await
            .expect_err(&format!("{what} is not released"));
        assert_eq!(refused.code(), code, "{what}");
    }
    expect_replay(&client, "done", b"r").await;

    let held = claim(&mut client, try_start("held")).await;
    // No reason, and one too long.
    for reason in [" ".to_owned(), "x".repeat(1025)] {
        let refused = admin
            .clone()
            .force_release(force_release("held", &reason))
            .await;
        assert_bad_fields(refused, &["reason"]);
    }
    let bad = admin
        .clone()
        .force_release(pb::ForceReleaseRequest {
            namespace: "bad namespace".into(),
            key: String::new(),
            reason: String::new(),
        })
        .await;
    assert_bad_fields(bad, &["namespace", "key", "reason"]);
    assert_eq!(
        looked_up_in_progress(&client, "held").await.attempt,
        held.attempt,
        "still held"
    );
    assert!(audit_events(&admin).await.is_empty(), "nothing recorded");
    // A reason of the longest length is accepted.
    released(&admin, "held", &"x".repeat(1024)).await;
}

async fn an_erased_key_is_forgotten_by_the_replay_cache_at_once(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    claim_and_complete(&mut client, "personal", b"someone's data").await;
    // Replayed, so the replay cache holds it now.
    expect_replay(&client, "personal", b"someone's data").await;
    expect_replay(&client, "personal", b"someone's data").await;

    let answer = erased(&admin, "personal", "data-protection request 42").await;
    let before = answer.erased.expect("the record before");
    assert_eq!(before.state(), pb::AdminKeyState::Completed);
    assert_eq!(before.response_bytes, b"someone's data".len() as u64);
    // Not replayed from memory: the key is new again.
    let again = claim(&mut client, try_start("personal")).await;
    assert_eq!(again.attempt, 1);

    // An absent key: nothing erased, still recorded.
    let nothing = erased(&admin, "never", "belt and braces").await;
    assert!(nothing.erased.is_none());
    let events = audit_events(&admin).await;
    let actions: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e.action.as_str(), e.key.as_str()))
        .collect();
    assert_eq!(
        actions,
        [("erase_key", "never"), ("erase_key", "personal")],
        "newest first"
    );
    assert!(events[0].record_before_json.is_empty());
    assert!(
        !events[1].record_before_json.contains("someone"),
        "the record before carries sizes, never the response itself"
    );
    assert!(events[1].record_before_json.contains("\"completed\""));
}

async fn a_namespace_is_erased_in_batches_with_its_events_and_others_are_untouched(
    backend: Backend,
) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    for index in 0..25 {
        claim_and_complete(&mut client, &format!("k{index:02}"), b"r").await;
    }
    expect_replay(&client, "k00", b"r").await;
    mark_results(&client, mark(NAMESPACE, &["e1", "e2", "e3"])).await;
    claim_and_complete(&mut client, "kept", b"r").await;
    claim(&mut client, try_start("kept").in_namespace("other".into())).await;

    let messages = erase_namespace(&admin, NAMESPACE, 10).await;
    let last = messages.last().expect("a last message");
    assert!(last.done);
    assert_eq!((last.keys_erased, last.events_erased), (26, 3));
    assert!(
        messages
            .windows(2)
            .all(|pair| pair[0].keys_erased <= pair[1].keys_erased),
        "progress only grows: {messages:?}"
    );
    assert!(
        messages
            .iter()
            .all(|m| m.audit_event_id == last.audit_event_id)
    );

    assert!(
        listed(&admin, list(pb::AdminKeyState::Unspecified))
            .await
            .is_empty()
    );
    assert_eq!(
        claim(&mut client, try_start("k00")).await.attempt,
        1,
        "not replayed"
    );
    let marks = mark_results(&client, mark(NAMESPACE, &["e1"])).await;
    assert!(!marks[0].already_processed, "the events were erased too");
    let other_key = answered(
        client
            .clone()
            .lookup(pb::LookupRequest {
                namespace: "other".into(),
                key: "kept".into(),
            })
            .await,
        "Lookup",
    );
    assert!(
        matches!(
            other_key.state,
            Some(pb::lookup_response::State::InProgress(_))
        ),
        "another namespace's key stays: {other_key:?}"
    );

    let events = audit_events(&admin).await;
    let actions: Vec<&str> = events.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["erase_namespace_done", "erase_namespace"]);
    assert_eq!(events[1].id, last.audit_event_id);
    let outcome: serde_json::Value =
        serde_json::from_str(&events[0].outcome_json).expect("the outcome, as JSON");
    assert_eq!(outcome["keys_erased"], 26);
    assert_eq!(outcome["events_erased"], 3);
    assert_eq!(outcome["complete"], true);

    let bad = admin
        .clone()
        .erase_namespace(pb::EraseNamespaceRequest {
            namespace: NAMESPACE.into(),
            reason: String::new(),
            batch_size: 10_001,
        })
        .await;
    assert_bad_fields(bad.map(drop), &["reason", "batch_size"]);
}

async fn the_audit_trail_pages_newest_first(backend: Backend) {
    let (app, _client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    for index in 0..5 {
        erased(&admin, &format!("k{index}"), "cleanup").await;
    }
    let mut keys = Vec::new();
    let mut token = String::new();
    loop {
        let page = answered(
            admin
                .clone()
                .list_audit_events(pb::ListAuditEventsRequest {
                    namespace: NAMESPACE.into(),
                    page_size: 2,
                    page_token: token.clone(),
                    ..Default::default()
                })
                .await,
            "ListAuditEvents",
        );
        keys.extend(page.events.iter().map(|e| e.key.clone()));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(keys, ["k4", "k3", "k2", "k1", "k0"]);
}

/// Two replicas on one database: an erasure through one empties the other's replay cache too,
/// long before the key's retention ends (PostgreSQL only: the embedded store serves one
/// process).
async fn every_replica_forgets_an_erased_namespace(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let replica = app.replica(&[]).await;
    let replica_client = replica.client().await;
    claim_and_complete(&mut client, "cached", b"old answer").await;
    // The replica replays it from its own cache from now on.
    expect_replay(&replica_client, "cached", b"old answer").await;
    expect_replay(&replica_client, "cached", b"old answer").await;

    let admin = admin_client(&app).await;
    let last = erase_namespace(&admin, NAMESPACE, 0).await;
    assert!(last.last().expect("done").done);
    // The key's row is gone: only a stale cache could still replay it.
    eventually(Duration::from_secs(5), "the replica forgot the key", || {
        let replica_client = replica_client.clone();
        async move {
            matches!(
                outcome(try_start_response(&replica_client, try_start("cached")).await),
                pb::try_start_response::Outcome::Started(_)
            )
        }
    })
    .await;
}

#[tokio::test]
async fn postgres_every_replica_forgets_an_erased_namespace() {
    every_replica_forgets_an_erased_namespace(Backend::Postgres).await;
}

for_each_backend!(
    a_forced_release_takes_the_key_from_its_holder_and_is_recorded,
    only_an_in_progress_key_is_released_and_a_refusal_records_nothing,
    an_erased_key_is_forgotten_by_the_replay_cache_at_once,
    a_namespace_is_erased_in_batches_with_its_events_and_others_are_untouched,
    the_audit_trail_pages_newest_first,
    the_reaper_deletes_audit_events_past_their_retention,
);

/// The audit trail is kept for `--audit-retention` and then reaped like the rest: an event whose
/// time is over (moved there from outside: the retention's least is an hour) is deleted by the
/// reaper, and a live one stays.
async fn the_reaper_deletes_audit_events_past_their_retention(backend: Backend) {
    let (app, _client) = app_and_client_with(backend, &["--reaper-interval", "100ms"]).await;
    let admin = admin_client(&app).await;
    for key in ["old", "new"] {
        erased(&admin, key, "cleanup").await;
    }
    let past = match backend {
        Backend::Postgres => {
            "UPDATE admin_audit_events SET expires_at = now() - interval '1 second' \
             WHERE key = 'old'"
        }
        Backend::Sqlite => "UPDATE admin_audit_events SET expires_at = 0 WHERE key = 'old'",
    };
    app.database.execute(past).await;
    // The old event was reaped.
    rows_become(&app.database, "admin_audit_events", 1).await;
    let events = audit_events(&admin).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].key, "new");
}

/// A PostgreSQL server with five completed keys (`key-0` … `key-4`), a client and an admin
/// client of it.
async fn five_completed_keys() -> (TestApp, Client, AdminClient) {
    let (app, mut client) = app_and_client(Backend::Postgres).await;
    let admin = admin_client(&app).await;
    for index in 0..5 {
        claim_and_complete(&mut client, &format!("key-{index}"), b"r").await;
    }
    (app, client, admin)
}

/// An erasure that cannot empty its namespace (here a row another transaction holds for longer
/// than the erasure waits for it) does not end its stream with `done`, which promises that
/// nothing is left: the stream ends `UNAVAILABLE`, saying what was erased, and the audit trail
/// records the erasure as incomplete. Once the row is free, erasing again empties the namespace.
/// PostgreSQL: the held row comes from a raw session of the test's own.
#[tokio::test]
async fn postgres_an_erasure_that_leaves_rows_does_not_report_done() {
    let (app, _client, admin) = five_completed_keys().await;
    let mut holder = crate::support::raw::transaction(&app.database.url).await;
    crate::support::raw::lock_key(&mut holder, "key-3").await;

    let mut stream = erase_stream(&admin, NAMESPACE, 2).await;
    let ended = loop {
        match stream.message().await {
            Ok(Some(message)) => assert!(!message.done, "done with a row left: {message:?}"),
            Ok(None) => panic!("the stream ended without saying the erasure stopped short"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(
        ended.message().contains("4 keys") && ended.message().contains("erase the namespace again"),
        "{ended:?}"
    );
    let events = audit_events(&admin).await;
    assert_eq!(events[0].action, "erase_namespace_done");
    let outcome: serde_json::Value =
        serde_json::from_str(&events[0].outcome_json).expect("the outcome, as JSON");
    assert_eq!(outcome["complete"], false, "{outcome}");

    crate::support::raw::run(&mut holder, "ROLLBACK").await;
    let again = erase_namespace(&admin, NAMESPACE, 2).await;
    let last = again.last().expect("a last message");
    assert!(last.done);
    assert_eq!(last.keys_erased, 1);
}

/// A pass of an erasure goes through its namespace once, each batch after the last key the one
/// before it erased; a row it skipped because another transaction held it lies behind it. When
/// that row is free again, the erasure's next pass, from the beginning, takes it: the stream
/// ends `done` with every key and event erased. PostgreSQL: the held rows come from a raw
/// session of the test's own (SQLite has one writer: nothing holds a row from it).
#[tokio::test]
async fn postgres_a_row_held_while_a_pass_went_by_is_erased_by_the_next_pass() {
    let (app, client, admin) = five_completed_keys().await;
    mark_results(
        &client,
        mark(NAMESPACE, &["e-0", "e-1", "e-2", "e-3", "e-4"]),
    )
    .await;
    let mut holder = crate::support::raw::transaction(&app.database.url).await;
    // Second in order: the first batch (of two) erases key-0 and key-2 and goes on after key-2.
    crate::support::raw::lock_key(&mut holder, "key-1").await;
    crate::support::raw::lock_event(&mut holder, NAMESPACE, "e-1").await;

    let mut stream = erase_stream(&admin, NAMESPACE, 2).await;
    let mut released = false;
    let last = loop {
        let message = stream
            .message()
            .await
            .unwrap_or_else(|status| panic!("the erasure stopped: {status:?}"))
            .expect("the stream ends with done");
        if message.done {
            break message;
        }
        assert!(message.keys_erased <= 5 && message.events_erased <= 5);
        if !released && (message.keys_erased, message.events_erased) == (4, 4) {
            // The first pass is over, with the held rows behind it.
            crate::support::raw::run(&mut holder, "ROLLBACK").await;
            released = true;
        }
    };
    assert!(released, "the first pass reported 4 keys and 4 events");
    assert_eq!((last.keys_erased, last.events_erased), (5, 5));
    assert!(
        listed(&admin, list(pb::AdminKeyState::Unspecified))
            .await
            .is_empty()
    );
    let marks = mark_results(&client, mark(NAMESPACE, &["e-1"])).await;
    assert!(!marks[0].already_processed, "the held event was erased too");
    let events = audit_events(&admin).await;
    let outcome: serde_json::Value =
        serde_json::from_str(&events[0].outcome_json).expect("the outcome, as JSON");
    assert_eq!(outcome["complete"], true, "{outcome}");
}

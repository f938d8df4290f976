//! Finding keys: each state filter, the key prefix, completion times, their orders and pages,
//! one key's record, and a namespace's numbers; bad requests are refused with every bad field.

use idempotency_coordinator::proto::idempotency::v1 as pb;
use tonic::Code;

use super::*;

/// A namespace with two stuck keys (lapsed one after the other), one running claim, one
/// completed key, and a stuck key in another namespace. Answers the claims in that order.
async fn a_namespace_of_every_state(
    app: &TestApp,
    client: &mut Client,
) -> (pb::ClaimStarted, pb::ClaimStarted, pb::ClaimStarted) {
    let first = claim_and_let_lapse(app, client, try_start("stuck-a")).await;
    let second = claim_and_let_lapse(app, client, try_start("stuck-b")).await;
    let running = claim(client, try_start("running").with_lease(secs(600))).await;
    claim_and_complete(client, "done", b"the answer").await;
    // Lookup reads the test namespace only: the other key's lapse is awaited by the clock.
    let elsewhere = claim(
        client,
        try_start("elsewhere")
            .in_namespace("other".into())
            .with_lease(millis(SHORT_LEASE_MS)),
    )
    .await;
    wait_for_db_clock_past(
        app,
        instant(&elsewhere.lease_expires_at),
        "the lease lapsed",
    )
    .await;
    (first, second, running)
}

async fn each_state_lists_its_own_keys_in_its_order(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let (first, second, running) = a_namespace_of_every_state(&app, &mut client).await;

    // Stuck keys, the longest stuck first: what an operator looks for at 3 a.m.
    let stuck = listed(&admin, list(pb::AdminKeyState::Stuck)).await;
    assert_eq!(names(&stuck), ["stuck-a", "stuck-b"]);
    assert_eq!(stuck[0].lease_token, first.lease_token);
    assert_eq!(stuck[1].lease_token, second.lease_token);
    assert!(
        stuck
            .iter()
            .all(|k| k.state() == pb::AdminKeyState::Stuck && k.completed_at.is_none())
    );
    assert_eq!(stuck[0].fingerprint_hex, hex::encode(FINGERPRINT));
    assert_eq!(stuck[0].attempt, 1);
    assert_eq!(stuck[0].checkpoint_bytes, None);

    let running_keys = listed(&admin, list(pb::AdminKeyState::InProgress)).await;
    assert_eq!(names(&running_keys), ["running"]);
    assert_eq!(running_keys[0].lease_token, running.lease_token);

    let completed = listed(&admin, list(pb::AdminKeyState::Completed)).await;
    assert_eq!(names(&completed), ["done"]);
    assert_eq!(completed[0].response_bytes, b"the answer".len() as u64);
    assert!(completed[0].completed_at.is_some());

    // Every state, by key; never another namespace's.
    let all = listed(&admin, list(pb::AdminKeyState::Unspecified)).await;
    assert_eq!(names(&all), ["done", "running", "stuck-a", "stuck-b"]);
    let prefixed = |state| pb::ListKeysRequest {
        key_prefix: "stuck-".into(),
        ..list(state)
    };
    let any_state = listed(&admin, prefixed(pb::AdminKeyState::Unspecified)).await;
    assert_eq!(names(&any_state), ["stuck-a", "stuck-b"]);
    let running = listed(&admin, prefixed(pb::AdminKeyState::InProgress)).await;
    assert!(running.is_empty(), "{running:?}");
}

async fn pages_cover_every_key_once_and_a_token_belongs_to_its_filter(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let mut expected = Vec::new();
    for index in 0..7 {
        let key = format!("key-{index}");
        claim_and_complete(&mut client, &key, b"r").await;
        expected.push(key);
    }
    for state in [pb::AdminKeyState::Unspecified, pb::AdminKeyState::Completed] {
        let threes = pb::ListKeysRequest {
            page_size: 3,
            ..list(state)
        };
        let pages = pages_of(&admin, threes).await;
        assert!(pages.iter().all(|page| page.len() <= 3));
        assert_eq!(pages.len(), 3, "{state:?}");
        let mut seen = names(&pages.concat());
        seen.sort();
        assert_eq!(seen, expected, "{state:?}: every key once");
    }

    // A token of the key order is refused under the completion order.
    let first = answered(
        admin
            .clone()
            .list_keys(pb::ListKeysRequest {
                page_size: 3,
                ..list(pb::AdminKeyState::Unspecified)
            })
            .await,
        "ListKeys",
    );
    let other_order = pb::ListKeysRequest {
        page_token: first.next_page_token,
        ..list(pb::AdminKeyState::Completed)
    };
    assert_bad_fields(admin.clone().list_keys(other_order).await, &["page_token"]);
}

async fn completion_times_bound_a_listing(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let (_, early) = claim_and_complete(&mut client, "early", b"r").await;
    wait_for_db_clock_past(&app, instant(&early.completed_at), "after early").await;
    let (_, late) = claim_and_complete(&mut client, "late", b"r").await;
    let after_early = pb::ListKeysRequest {
        completed_after: late.completed_at,
        ..list(pb::AdminKeyState::Completed)
    };
    assert_eq!(names(&listed(&admin, after_early).await), ["late"]);
    let before_late = pb::ListKeysRequest {
        completed_before: late.completed_at,
        ..list(pb::AdminKeyState::Unspecified)
    };
    assert_eq!(names(&listed(&admin, before_late).await), ["early"]);
    // Completion times select completed keys only.
    let contradiction = pb::ListKeysRequest {
        completed_before: late.completed_at,
        ..list(pb::AdminKeyState::Stuck)
    };
    assert_bad_fields(admin.clone().list_keys(contradiction).await, &["state"]);
}

async fn bad_listings_are_refused_with_every_bad_field(backend: Backend) {
    let (app, _client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let refused = admin
        .clone()
        .list_keys(pb::ListKeysRequest {
            namespace: String::new(),
            state: 7,
            key_prefix: "x".repeat(256),
            page_size: 1001,
            completed_after: Some(prost_types::Timestamp {
                seconds: 0,
                nanos: -1,
            }),
            ..Default::default()
        })
        .await;
    assert_bad_fields(
        refused,
        &[
            "namespace",
            "state",
            "key_prefix",
            "completed_after",
            "page_size",
        ],
    );
    // The bounds themselves are accepted.
    for page_size in [1, 1000] {
        answered(
            admin
                .clone()
                .list_keys(pb::ListKeysRequest {
                    page_size,
                    key_prefix: "x".repeat(255),
                    ..list(pb::AdminKeyState::Unspecified)
                })
                .await,
            "ListKeys at a bound",
        );
    }
    let audit = admin
        .clone()
        .list_audit_events(pb::ListAuditEventsRequest {
            namespace: NAMESPACE.into(),
            page_size: 1001,
            page_token: "nonsense".into(),
            ..Default::default()
        })
        .await;
    assert_bad_fields(audit, &["page_size", "page_token"]);
}

async fn a_keys_record_comes_whole_and_an_absent_key_is_not_found(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let started = claim(&mut client, try_start("held").with_attempt("attempt-7")).await;
    extend_response(
        &client,
        extend("held", started.lease_token).with_checkpoint(Some(b"page 3")),
    )
    .await;
    let held = answered(admin.clone().get_key(get_key("held")).await, "GetKey");
    let entry = held.key.expect("the entry");
    assert_eq!(entry.state(), pb::AdminKeyState::InProgress);
    assert_eq!(entry.attempt_id, "attempt-7");
    assert_eq!(entry.checkpoint_bytes, Some(6));
    assert_eq!(held.checkpoint.as_deref(), Some(&b"page 3"[..]));
    assert!(held.response.is_empty());

    claim_and_complete(&mut client, "done", b"stored bytes").await;
    let done = answered(admin.clone().get_key(get_key("done")).await, "GetKey");
    assert_eq!(done.response, b"stored bytes");
    assert_eq!(
        done.key.expect("entry").state(),
        pb::AdminKeyState::Completed
    );

    let absent = admin
        .clone()
        .get_key(get_key("never"))
        .await
        .expect_err("absent");
    assert_eq!(absent.code(), Code::NotFound);
}

async fn namespace_stats_count_each_state_and_name_the_oldest_stuck_key(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let stats = |namespace: &str| {
        let admin = admin.clone();
        let namespace = namespace.to_owned();
        async move {
            answered(
                admin
                    .clone()
                    .namespace_stats(pb::NamespaceStatsRequest { namespace })
                    .await,
                "NamespaceStats",
            )
        }
    };
    let empty = stats(NAMESPACE).await;
    assert_eq!(
        (
            empty.in_progress_keys,
            empty.stuck_keys,
            empty.completed_keys
        ),
        (0, 0, 0)
    );
    assert!(empty.oldest_stuck_key.is_empty());
    assert!(empty.read_at.is_some());

    let (first, _, _) = a_namespace_of_every_state(&app, &mut client).await;
    mark_results(&client, mark(NAMESPACE, &["e1", "e2"])).await;
    let full = stats(NAMESPACE).await;
    assert_eq!(full.in_progress_keys, 1);
    assert_eq!(full.stuck_keys, 2);
    assert_eq!(full.completed_keys, 1);
    assert_eq!(full.processed_events, 2);
    assert_eq!(full.oldest_stuck_key, "stuck-a");
    assert_eq!(
        instant(&full.oldest_stuck_lease_expired_at),
        instant(&Some(first.lease_expires_at.expect("lease")))
    );
    // The keys' names, fingerprints and the one response.
    let names_bytes = ["stuck-a", "stuck-b", "running", "done"]
        .iter()
        .map(|k| k.len())
        .sum::<usize>();
    let expected = names_bytes + 4 * FINGERPRINT.len() + b"the answer".len();
    assert_eq!(full.stored_bytes, expected as u64);
    assert_eq!(stats("other").await.stuck_keys, 1);
    // A namespace with processed events and no key: its events still count.
    mark_results(&client, mark("events-only", &["e1", "e2", "e3"])).await;
    let events_only = stats("events-only").await;
    assert_eq!(
        (events_only.completed_keys, events_only.processed_events),
        (0, 3)
    );
    assert!(events_only.read_at.is_some());
}

for_each_backend!(
    each_state_lists_its_own_keys_in_its_order,
    pages_cover_every_key_once_and_a_token_belongs_to_its_filter,
    completion_times_bound_a_listing,
    bad_listings_are_refused_with_every_bad_field,
    a_keys_record_comes_whole_and_an_absent_key_is_not_found,
    namespace_stats_count_each_state_and_name_the_oldest_stuck_key,
);

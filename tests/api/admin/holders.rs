//! Who holds a key, and since when: each claim records its caller (the token's name, or the
//! client certificate's subject under mutual TLS) and its time; a takeover records the new
//! holder, a ForceRelease leaves the key held by nobody; ListKeys finds keys in progress by
//! claim time. The audit trail names a certificate's subject as the actor.

use chrono::{DateTime, Utc};
use idempotency_coordinator::auth::AdminRight;
use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, admin_service_client::AdminServiceClient,
    idempotency_service_client::IdempotencyServiceClient,
};

use super::*;
use crate::support::security::*;

async fn claimed_by(client: &AuthedClient, request: pb::TryStartRequest) -> pb::ClaimStarted {
    let answer = client
        .clone()
        .try_start(request)
        .await
        .expect("TryStart answers")
        .into_inner();
    expect_started(answer)
}

fn timestamp(at: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: i32::try_from(at.timestamp_subsec_nanos()).expect("nanos"),
    }
}

/// The instant a claim's first lease was counted from: its lease's end less the lease.
fn claim_instant(started: &pb::ClaimStarted, lease_ms: u64) -> DateTime<Utc> {
    let lease = i64::try_from(lease_ms).expect("a lease");
    instant(&started.lease_expires_at) - chrono::Duration::milliseconds(lease)
}

const LONG_LEASE_MS: u64 = 600_000;

async fn entry(admin: &AuthedAdmin, key: &str) -> pb::AdminKeyEntry {
    admin
        .clone()
        .get_key(get_key(key))
        .await
        .expect("GetKey answers")
        .into_inner()
        .key
        .expect("an entry")
}

async fn a_claim_names_its_holder_and_time_and_a_takeover_renames_them(backend: Backend) {
    let (payments, payments_line) = token("payments", "*");
    let (refunds, refunds_line) = token("refunds", "*");
    let (operator, operator_line) = admin_token("oncall", "*", AdminRight::Write);
    let tokens = TokensFile::new(&[&payments_line, &refunds_line, &operator_line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let payments = authed_client(app.endpoint(), Bearer::token(&payments)).await;
    let refunds = authed_client(app.endpoint(), Bearer::token(&refunds)).await;
    let admin = authed_admin(app.endpoint(), Bearer::token(&operator)).await;

    let short = millis(SHORT_LEASE_MS);
    let long = millis(LONG_LEASE_MS);
    let first = claimed_by(&payments, try_start("charge-1").with_lease(short)).await;
    let held = entry(&admin, "charge-1").await;
    assert_eq!(held.holder, "token:payments");
    assert_eq!(
        instant(&held.claimed_at),
        claim_instant(&first, SHORT_LEASE_MS)
    );

    // The holder went quiet; another caller takes the key over: it is the holder now, since
    // its own claim.
    wait_for_db_clock_past(&app, instant(&first.lease_expires_at), "the lease lapsed").await;
    let second = claimed_by(&refunds, try_start("charge-1").with_lease(long)).await;
    assert_eq!(second.attempt, 2);
    let taken = entry(&admin, "charge-1").await;
    assert_eq!(taken.holder, "token:refunds");
    assert_eq!(
        instant(&taken.claimed_at),
        claim_instant(&second, LONG_LEASE_MS)
    );
    assert!(instant(&taken.claimed_at) > instant(&held.claimed_at));

    // Completed, the key still tells who ran it and since when.
    refunds
        .clone()
        .complete(complete("charge-1", second.lease_token, b"paid"))
        .await
        .expect("completed");
    let done = entry(&admin, "charge-1").await;
    assert_eq!(done.state(), pb::AdminKeyState::Completed);
    assert_eq!(
        (done.holder.as_str(), done.claimed_at),
        ("token:refunds", taken.claimed_at)
    );

    // A forced release leaves the key held by nobody; the audit trail keeps who held it.
    let stuck = claimed_by(&payments, try_start("charge-2").with_lease(long)).await;
    admin
        .clone()
        .force_release(force_release("charge-2", "the worker pod was deleted"))
        .await
        .expect("released");
    let released = entry(&admin, "charge-2").await;
    assert_eq!(released.holder, "");
    assert_eq!(
        instant(&released.claimed_at),
        claim_instant(&stuck, LONG_LEASE_MS)
    );
    let events = admin
        .clone()
        .list_audit_events(audit_of(NAMESPACE))
        .await
        .expect("the trail")
        .into_inner()
        .events;
    let event = &events[0];
    assert_eq!(event.actor, "token:oncall");
    let before: serde_json::Value =
        serde_json::from_str(&event.record_before_json).expect("the record before, as JSON");
    assert_eq!(before["holder"], "token:payments");
    assert!(before["claimed_at"].is_string(), "{before}");
}

async fn an_anonymous_caller_holds_keys_as_nobody(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let started = claim(
        &mut client,
        try_start("anonymous").with_lease(millis(LONG_LEASE_MS)),
    )
    .await;
    let listed = listed(&admin, list(pb::AdminKeyState::InProgress)).await;
    assert_eq!(names(&listed), ["anonymous"]);
    assert_eq!(listed[0].holder, "");
    assert_eq!(
        instant(&listed[0].claimed_at),
        claim_instant(&started, LONG_LEASE_MS)
    );
}

async fn claim_times_bound_a_listing_of_keys_in_progress(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let admin = admin_client(&app).await;
    let lease = millis(LONG_LEASE_MS);
    let early = claim(&mut client, try_start("early").with_lease(lease)).await;
    let early_at = claim_instant(&early, LONG_LEASE_MS);
    wait_for_db_clock_past(&app, early_at, "after the early claim").await;
    let stuck = claim_and_let_lapse(&app, &mut client, try_start("lapsed")).await;
    let lapsed_at = claim_instant(&stuck, SHORT_LEASE_MS);
    let late = claim(&mut client, try_start("late").with_lease(lease)).await;
    let late_at = claim_instant(&late, LONG_LEASE_MS);
    // A completed key claimed between them: claim times find keys in progress only.
    claim_and_complete(&mut client, "done", b"r").await;
    let between = |after: DateTime<Utc>, before: Option<DateTime<Utc>>| pb::ListKeysRequest {
        claimed_after: Some(timestamp(after)),
        claimed_before: before.map(timestamp),
        ..list(pb::AdminKeyState::Unspecified)
    };

    // Held since before the late claim: by lease expiry, the longest stuck first.
    let held_long = listed(
        &admin,
        pb::ListKeysRequest {
            claimed_before: Some(timestamp(late_at)),
            ..list(pb::AdminKeyState::Unspecified)
        },
    )
    .await;
    assert_eq!(names(&held_long), ["lapsed", "early"]);
    assert_eq!(
        names(&listed(&admin, between(late_at, None)).await),
        ["late"]
    );
    assert_eq!(
        names(&listed(&admin, between(early_at, Some(late_at))).await),
        ["lapsed", "early"]
    );
    // With a state, and with a prefix (key order).
    let stuck_since = pb::ListKeysRequest {
        claimed_after: Some(timestamp(lapsed_at)),
        ..list(pb::AdminKeyState::Stuck)
    };
    assert_eq!(names(&listed(&admin, stuck_since).await), ["lapsed"]);
    let running_before = pb::ListKeysRequest {
        claimed_before: Some(timestamp(late_at)),
        ..list(pb::AdminKeyState::InProgress)
    };
    assert_eq!(names(&listed(&admin, running_before).await), ["early"]);
    let prefixed = pb::ListKeysRequest {
        key_prefix: "la".into(),
        ..between(early_at, None)
    };
    assert_eq!(names(&listed(&admin, prefixed).await), ["lapsed", "late"]);

    // Pages of one key each cover the filter's keys once, in order.
    let single = pb::ListKeysRequest {
        page_size: 1,
        ..between(early_at, None)
    };
    let seen = names(&pages_of(&admin, single).await.concat());
    assert_eq!(seen, ["lapsed", "early", "late"]);

    // A claim time with a completed state or a completion time is a contradiction.
    for contradiction in [
        pb::ListKeysRequest {
            state: pb::AdminKeyState::Completed.into(),
            ..between(early_at, None)
        },
        pb::ListKeysRequest {
            completed_after: Some(timestamp(early_at)),
            ..between(early_at, None)
        },
    ] {
        assert_bad_fields(
            admin.clone().list_keys(contradiction).await,
            &["claimed_after"],
        );
    }
    let bad_instant = pb::ListKeysRequest {
        claimed_before: Some(prost_types::Timestamp {
            seconds: 0,
            nanos: 1_000_000_000,
        }),
        ..list(pb::AdminKeyState::Unspecified)
    };
    assert_bad_fields(
        admin.clone().list_keys(bad_instant).await,
        &["claimed_before"],
    );
}

/// Under mutual TLS without tokens, the client certificate's subject names the holder of the
/// keys a caller claims, and the actor of its admin changes (on loopback, where the admin API
/// answers without tokens).
async fn a_client_certificate_names_the_holder_and_the_actor(backend: Backend) {
    let mtls = MutualTls::start(backend, "payments-worker").await;
    let mut client = IdempotencyServiceClient::new(mtls.channel.clone());
    let admin = AdminServiceClient::new(mtls.channel.clone());
    claim(&mut client, try_start("held").with_lease(secs(600))).await;
    let held = answered(admin.clone().get_key(get_key("held")).await, "GetKey")
        .key
        .expect("an entry");
    assert_eq!(held.holder, "cert:CN=payments-worker");

    answered(
        admin
            .clone()
            .force_release(force_release("held", "rotating the worker"))
            .await,
        "ForceRelease",
    );
    let events = audit_events(&admin).await;
    assert_eq!(events[0].actor, "cert:CN=payments-worker");
}

for_each_backend!(
    a_claim_names_its_holder_and_time_and_a_takeover_renames_them,
    an_anonymous_caller_holds_keys_as_nobody,
    claim_times_bound_a_listing_of_keys_in_progress,
    a_client_certificate_names_the_holder_and_the_actor,
);

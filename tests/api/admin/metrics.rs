//! The admin API's metrics: every call counted by action and outcome, and the stuck-keys gauges
//! the reaper samples after each sweep (all namespaces, no namespace label).

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use super::*;
use crate::metrics::{assert_values, metered, samples, scrape, series_reaches, value};

async fn admin_calls_and_stuck_keys_show_in_the_metrics(backend: Backend) {
    let (app, mut client) = metered(backend, &["--reaper-interval", "100ms"]).await;
    let admin = admin_client(&app).await;
    series_reaches(&app, "idempotency_stuck_keys", 0.0).await;
    series_reaches(&app, "idempotency_oldest_stuck_key_seconds", 0.0).await;

    claim_and_let_lapse(&app, &mut client, try_start("stuck")).await;
    let elsewhere = claim(
        &mut client,
        try_start("stuck")
            .in_namespace("elsewhere".into())
            .with_lease(millis(SHORT_LEASE_MS)),
    )
    .await;
    wait_for_db_clock_past(
        &app,
        instant(&elsewhere.lease_expires_at),
        "the lease lapsed",
    )
    .await;
    claim(&mut client, try_start("running").with_lease(secs(600))).await;
    claim_and_complete(&mut client, "done", b"r").await;
    // Both namespaces' stuck keys, neither the running nor the completed one.
    series_reaches(&app, "idempotency_stuck_keys", 2.0).await;
    eventually(
        Duration::from_secs(10),
        "the oldest stuck key ages",
        || async {
            value(
                &samples(&scrape(&app).await),
                "idempotency_oldest_stuck_key_seconds",
            ) > 0.0
        },
    )
    .await;
    // A takeover unsticks a key.
    claim(&mut client, try_start("stuck")).await;
    series_reaches(&app, "idempotency_stuck_keys", 1.0).await;

    answered(
        admin
            .clone()
            .list_keys(list(pb::AdminKeyState::Stuck))
            .await,
        "ListKeys",
    );
    admin
        .clone()
        .get_key(get_key("never"))
        .await
        .expect_err("absent");
    answered(
        admin
            .clone()
            .force_release(force_release("running", "hung"))
            .await,
        "ForceRelease",
    );
    answered(
        admin
            .clone()
            .force_release(pb::ForceReleaseRequest {
                namespace: "elsewhere".into(),
                ..force_release("stuck", "crashed")
            })
            .await,
        "ForceRelease",
    );
    admin
        .clone()
        .force_release(force_release("", ""))
        .await
        .expect_err("invalid");
    assert_values(
        &samples(&scrape(&app).await),
        &[
            (
                "idempotency_admin_actions_total{action=\"list_keys\",outcome=\"ok\"}",
                1.0,
            ),
            (
                "idempotency_admin_actions_total{action=\"get_key\",outcome=\"not_found\"}",
                1.0,
            ),
            (
                "idempotency_admin_actions_total{action=\"force_release\",outcome=\"ok\"}",
                2.0,
            ),
            (
                "idempotency_admin_actions_total{action=\"force_release\",outcome=\"invalid_argument\"}",
                1.0,
            ),
        ],
    );
    // A released key is not stuck, whether its lease had run out (elsewhere's) or was running:
    // none is left.
    series_reaches(&app, "idempotency_stuck_keys", 0.0).await;
}

for_each_backend!(admin_calls_and_stuck_keys_show_in_the_metrics,);

//! Calls on a move's target during its cut-over. A call of another namespace that shares a
//! statement with a call of the moving one is refused with it by the target's gate (which says
//! `arriving`), and then runs on its own as any call does: its key held by another
//! transaction, it waits for the key in the held-key lane, and is answered once the hold ends.
//!
//! The moving namespace goes back to its rules' cluster, b, and its calls come to a replica
//! that started during the cut-over: knowing no route yet, it sends them to b first, into the
//! statements b's other calls share.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;
use sqlx::Connection;
use tokio::task::JoinSet;

use super::*;

/// Keys of `orders-eu` (on b, the move's target) held by another transaction, each called
/// among calls of `orders-back`, which is in its cut-over to b.
const HELD: usize = 4;

/// Calls of `orders-back` sent with them.
const MOVING: usize = 12;

/// The service's defaults (an operation timeout of 5 s: a held key's callers wait up to 1 s
/// for it, a cut-over's up to 2.5 s), so that the hold, ended after 300 ms, ends within both.
#[tokio::test]
async fn held_keys_sharing_a_statement_with_a_call_in_cut_over_wait_for_their_keys() {
    let clusters = three_clusters().await;
    let (a, b) = (&clusters.nodes[0], &clusters.nodes[1]);
    let first = serve_on(&clusters, &[]).await;
    let client = first.client().await;
    let admin = admin_of(first.endpoint()).await;
    let held: Vec<String> = (0..HELD)
        .map(|n| unique_key(&format!("held-{n}")))
        .collect();
    for key in &held {
        claim(&mut client.clone(), try_start_in("orders-eu", key)).await;
    }
    // orders-back (placed on b by its rule) moved to a, then on its way home, fenced (the drain
    // waits for a transaction on a).
    lifecycle(&client, "orders-back", &unique_key("before"), b"before").await;
    moved(&admin, move_request("orders-back", "a")).await;
    let old = old_transaction(a).await;
    let moving = fenced_move(&admin, a, "orders-back", "b").await;
    let second = serve_on(&clusters, &[]).await;
    let client = second.client().await;

    // The held keys' rows locked on b.
    let mut hold = b.connect(DATABASE).await;
    sqlx::raw_sql("BEGIN")
        .execute(&mut hold)
        .await
        .expect("begin");
    for key in &held {
        sqlx::query(
            "SELECT 1 FROM idempotency_keys WHERE namespace = 'orders-eu' AND key = $1 \
             FOR UPDATE",
        )
        .bind(key)
        .execute(&mut hold)
        .await
        .expect("hold the key");
    }

    // The calls, all at once, to the replica that knows no route: the moving namespace's go
    // to b by its rule, and share b's statements with the held keys' calls.
    let mut calls = JoinSet::new();
    for n in 0..MOVING {
        let (mut client, request) = (
            client.clone(),
            try_start_in("orders-back", &unique_key(&format!("moving-{n}"))),
        );
        calls.spawn(async move { (None, client.try_start(request).await) });
    }
    for key in &held {
        let (mut client, request) = (client.clone(), try_start_in("orders-eu", key));
        let key = key.clone();
        calls.spawn(async move { (Some(key), client.try_start(request).await) });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut hold)
        .await
        .expect("end the hold");

    while let Some(call) = calls.join_next().await {
        let (key, answer) = call.expect("a call");
        let Some(key) = key else { continue };
        let answer = answer
            .unwrap_or_else(|status| {
                panic!("{key}, held, is answered once its hold ends: {status:?}")
            })
            .into_inner();
        assert!(
            matches!(answer.outcome, Some(Outcome::InProgress(_))),
            "{key}: {answer:?}"
        );
    }
    old.close().await.expect("the old transaction ends");
    let report = answered(moving.await.expect("the move's call"), "MovePlacement");
    assert_eq!(report.outcome, "moved");
}

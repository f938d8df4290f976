//! Keys held by another transaction on one cluster take the places of that cluster's held-key
//! lane only: a key held on another cluster waits for its lock in a lane of its own.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;
use tokio::task::JoinSet;

use super::*;

/// Calls of the test's namespace on b whose keys another transaction holds, more than b's lane
/// has places (a quarter of the tests' pool of 8: two).
const HELD_ON_B: usize = 6;

/// How long a statement has waited for a row lock once it is surely in the held-key lane (a
/// statement elsewhere gives up after its brief wait of 20 ms).
const IN_THE_LANE: Duration = Duration::from_millis(200);

/// A session on `node` that holds the rows of `keys` of `namespace` (`SELECT … FOR UPDATE` in a
/// transaction it leaves open), as an operator's or another service's would.
async fn hold(node: &Node, namespace: &str, keys: &[String]) -> sqlx::PgConnection {
    let mut session = node.connect(DATABASE).await;
    sqlx::query("BEGIN")
        .execute(&mut session)
        .await
        .expect("begin");
    for key in keys {
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE namespace = $1 AND key = $2 FOR UPDATE")
            .bind(namespace)
            .bind(key)
            .execute(&mut session)
            .await
            .expect("lock the key's row");
    }
    session
}

/// Keys held on b fill b's lane, with more calls queued for it; a key held on a then waits for
/// its lock at once, in a's own lane, and is answered when its hold ends, while b's calls still
/// wait. The operation timeout is 30 s (a lock budget of 6 s), so that b's calls keep their
/// places for the whole test.
#[tokio::test]
async fn keys_held_on_one_cluster_take_no_place_of_anothers() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, &["--operation-timeout", "30s"]).await;
    let client = app.client().await;
    let (a, b) = (&clusters.nodes[0], &clusters.nodes[1]);
    let on_b: Vec<String> = (0..HELD_ON_B)
        .map(|n| unique_key(&format!("b{n}")))
        .collect();
    let on_a = unique_key("a");
    for key in &on_b {
        claim(&mut client.clone(), try_start_in("orders-eu", key)).await;
    }
    claim(&mut client.clone(), try_start_in("misc", &on_a)).await;

    let _b_hold = hold(b, "orders-eu", &on_b).await;
    let mut b_calls = JoinSet::new();
    for key in &on_b {
        let (mut client, request) = (client.clone(), try_start_in("orders-eu", key));
        b_calls.spawn(async move { client.try_start(request).await });
    }
    eventually(Duration::from_secs(10), "b's lane full", || async {
        waiting_for_locks(b, IN_THE_LANE).await == 2
    })
    .await;

    let mut a_hold = hold(a, "misc", std::slice::from_ref(&on_a)).await;
    let a_call = {
        let (mut client, request) = (client.clone(), try_start_in("misc", &on_a));
        tokio::spawn(async move { client.try_start(request).await })
    };
    eventually(
        Duration::from_secs(10),
        "a's held key waits for its lock in a lane of its own while b's lane is full",
        || async {
            waiting_for_locks(a, IN_THE_LANE).await == 1
                && waiting_for_locks(b, IN_THE_LANE).await == 2
        },
    )
    .await;
    sqlx::query("ROLLBACK")
        .execute(&mut a_hold)
        .await
        .expect("end a's hold");
    let answer = a_call
        .await
        .expect("a's call")
        .expect("a's call answered once its hold ended")
        .into_inner();
    assert!(
        matches!(answer.outcome, Some(Outcome::InProgress(_))),
        "a's key is in progress: {answer:?}"
    );
    assert!(
        b_calls.try_join_next().is_none(),
        "b's calls still wait for their keys"
    );
}

//! Scenario 1: two replicas on one database race for the same keys; exactly one winner per key,
//! and every caller replays the winner's response through the other replica.

use std::collections::HashMap;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;

use crate::support::process::ServerProcess;
use crate::support::*;

/// Scenario 1. PostgreSQL only: replicas share a database; the embedded store is for one
/// instance.
#[tokio::test]
async fn two_replicas_racing_elect_exactly_one_winner_per_key() {
    const KEYS: usize = 50;
    const CALLS: usize = 500;
    let database = TestDatabase::create(Backend::Postgres).await;
    // 500 calls at once on two replicas: on a loaded machine their queue can outlast the
    // default queue budget (a tenth of the operation timeout). This test is about who wins,
    // not about speed: a generous timeout keeps the machine's load out of it.
    let generous = ["--operation-timeout", "30s"];
    let replicas = [
        ServerProcess::start(&database.url, &generous).await,
        ServerProcess::start(&database.url, &generous).await,
    ];
    let clients = [
        replicas[0].client_when_serving().await,
        replicas[1].client_when_serving().await,
    ];

    let claims = (0..CALLS).map(|call| {
        let mut client = clients[call % 2].clone();
        let key = format!("race-{}", call % KEYS);
        tokio::spawn(async move {
            let answer = client.try_start(try_start(&key)).await.expect("TryStart");
            match outcome(answer.into_inner()) {
                Outcome::Started(started) => {
                    let response = format!("{key} won by call {call}");
                    client
                        .complete(complete(&key, started.lease_token, response.as_bytes()))
                        .await
                        .expect("the winner completes");
                    (key, Some(response))
                }
                Outcome::InProgress(_) | Outcome::Completed(_) => (key, None),
                Outcome::FingerprintMismatch(_) => panic!("one fingerprint cannot mismatch"),
            }
        })
    });
    let mut winners: HashMap<String, Vec<String>> = HashMap::new();
    for claim in futures::future::join_all(claims).await {
        let (key, won) = claim.expect("task");
        let entry = winners.entry(key).or_default();
        entry.extend(won);
    }
    assert_eq!(winners.len(), KEYS);
    let duplicated = winners.values().filter(|w| w.len() > 1).count();
    let unclaimed = winners.values().filter(|w| w.is_empty()).count();
    assert_eq!(
        (duplicated, unclaimed),
        (0, 0),
        "exactly one winner per key"
    );

    // Once the winners completed, every caller sees the same stored response, through the
    // other replica than the one it claimed on.
    let replays = (0..CALLS).map(|call| {
        let mut client = clients[(call + 1) % 2].clone();
        let key = format!("race-{}", call % KEYS);
        tokio::spawn(async move {
            let answer = client.try_start(try_start(&key)).await.expect("TryStart");
            (key, expect_completed(answer.into_inner()).response)
        })
    });
    let mut matched = 0;
    for replay in futures::future::join_all(replays).await {
        let (key, response) = replay.expect("task");
        assert_eq!(response, winners[&key][0].as_bytes(), "replay of {key}");
        matched += 1;
    }
    println!(
        "replicas racing: {CALLS} concurrent claims over {KEYS} keys on 2 replicas; \
         {KEYS} winners, duplicated 0; {matched} replays matched the stored response, lost 0"
    );
}

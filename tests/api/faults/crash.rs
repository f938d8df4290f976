//! Scenario 2: `kill -9` with calls in flight, then a restart; every key is completed or
//! claimable, no acknowledged completion is lost, and the crashed holders are fenced off.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::{
    TryStartRequest, try_start_response::Outcome,
};
use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

/// What a caller that was cut off by a crash knows about its key.
#[derive(Debug, Default)]
struct Acknowledged {
    /// The token of an acknowledged claim.
    token: Option<u64>,
    /// The response of an acknowledged Complete.
    response: Option<Vec<u8>>,
}

/// Scenario 2, on both stores: `kill -9` while calls are in flight, then restart.
async fn a_crashed_server_leaves_every_key_completed_or_claimable(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let mut first = ServerProcess::start(&database.url, &[]).await;
    let mut client = first.client_when_serving().await;
    let short_lease = |key: &str| TryStartRequest {
        lease_ttl: millis(1000),
        ..try_start(key)
    };
    let keys: Arc<Mutex<BTreeMap<String, Acknowledged>>> = Arc::default();

    // Twenty held claims, half of them completed before the crash.
    for index in 0..20 {
        let key = format!("held-{index}");
        let started = claim(&mut client, short_lease(&key)).await;
        let mut known = Acknowledged {
            token: Some(started.lease_token),
            response: None,
        };
        if index % 2 == 0 {
            let response = format!("result of {key}").into_bytes();
            complete_key(&client, &key, started.lease_token, &response).await;
            known.response = Some(response);
        }
        keys.lock().expect("keys").insert(key, known);
    }

    // Eight callers claim and complete fresh keys until the server dies under them.
    let completions = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..8)
        .map(|caller| {
            let mut client = client.clone();
            let keys = keys.clone();
            let completions = completions.clone();
            tokio::spawn(async move {
                for sequence in 0.. {
                    let key = format!("flight-{caller}-{sequence}");
                    keys.lock()
                        .expect("keys")
                        .insert(key.clone(), Acknowledged::default());
                    let Ok(answer) = client.try_start(short_lease(&key)).await else {
                        return;
                    };
                    let Some(Outcome::Started(started)) = answer.into_inner().outcome else {
                        panic!("a fresh key is started");
                    };
                    keys.lock()
                        .expect("keys")
                        .get_mut(&key)
                        .expect("known")
                        .token = Some(started.lease_token);
                    let response = format!("result of {key}").into_bytes();
                    if client
                        .complete(complete(&key, started.lease_token, &response))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    keys.lock()
                        .expect("keys")
                        .get_mut(&key)
                        .expect("known")
                        .response = Some(response);
                    completions.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    eventually(Duration::from_secs(20), "calls are flowing", || async {
        completions.load(Ordering::Relaxed) >= 40
    })
    .await;
    first.signal("KILL");
    assert_eq!(
        first.wait(Duration::from_secs(10)).await,
        None,
        "killed by a signal"
    );
    for caller in callers {
        caller.await.expect("caller");
    }

    let second = ServerProcess::start(&database.url, &[]).await;
    let mut client = second.client_when_serving().await;
    let keys = std::mem::take(&mut *keys.lock().expect("keys"));
    let (mut completed, mut taken_over, mut never_claimed) = (0, 0, 0);
    // Wait out every lease, so that every key is either completed or claimable.
    let latest_lease = database.latest_lease_expiry().await;
    eventually(Duration::from_secs(10), "every lease ran out", || async {
        database.now().await > latest_lease
    })
    .await;
    for (key, known) in &keys {
        let answer = client.try_start(short_lease(key)).await.expect("TryStart");
        match outcome(answer.into_inner()) {
            Outcome::Completed(done) => {
                // Completed: by an acknowledged Complete, or by one whose answer the crash ate.
                let expected = format!("result of {key}").into_bytes();
                assert_eq!(done.response, expected, "{key} holds its own response");
                completed += 1;
            }
            Outcome::Started(started) => {
                assert!(
                    known.response.is_none(),
                    "{key}: an acknowledged completion was lost"
                );
                match known.token {
                    Some(old_token) => {
                        // Claimed before the crash: taken over, with a higher token, and the
                        // crashed holder is fenced off.
                        assert!(started.lease_token > old_token);
                        assert_eq!(started.attempt, 2, "{key} is taken over");
                        let status = client
                            .complete(complete(key, old_token, b"from the dead"))
                            .await
                            .expect_err("the crashed holder's token");
                        assert_error(&status, Code::Aborted, "LEASE_LOST");
                        taken_over += 1;
                    }
                    None => never_claimed += 1,
                }
            }
            other => panic!("{key}: neither completed nor claimable: {other:?}"),
        }
    }
    let acknowledged = keys.values().filter(|k| k.response.is_some()).count();
    assert!(
        completed >= acknowledged,
        "no acknowledged completion is lost"
    );
    println!(
        "crash ({backend:?}): kill -9 with 8 callers in flight; {} keys checked: {completed} \
         completed ({acknowledged} acknowledged), {taken_over} taken over with a higher token \
         and the old one refused, {never_claimed} unclaimed; lost 0, duplicated 0",
        keys.len()
    );
}

for_each_backend!(a_crashed_server_leaves_every_key_completed_or_claimable,);

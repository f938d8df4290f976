//! Scenario 4: SIGTERM under 64 callers; every accepted call is answered within the grace
//! period, the process exits 0, and the store holds exactly the completions that were
//! acknowledged.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;

use crate::support::process::ServerProcess;
use crate::support::*;

/// Scenario 4, on both stores: SIGTERM under 64 callers.
async fn sigterm_under_load_answers_every_accepted_call_and_loses_nothing(backend: Backend) {
    const CALLERS: usize = 64;
    let database = TestDatabase::create(backend).await;
    let mut server = ServerProcess::start(&database.url, &["--shutdown-grace", "10s"]).await;
    let client = server.client_when_serving().await;
    let acknowledged: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let (calls, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let mut client = client.clone();
            let (acknowledged, calls, refused) =
                (acknowledged.clone(), calls.clone(), refused.clone());
            tokio::spawn(async move {
                for sequence in 0.. {
                    let key = format!("drain-{caller}-{sequence}");
                    // No call may hang: each must be answered well within the grace period.
                    let answer = tokio::time::timeout(
                        Duration::from_secs(12),
                        client.try_start(try_start(&key)),
                    )
                    .await
                    .expect("TryStart answered within the grace period");
                    calls.fetch_add(1, Ordering::Relaxed);
                    let started = match answer.map(|a| a.into_inner().outcome) {
                        Ok(Some(Outcome::Started(started))) => started,
                        Ok(other) => panic!("a fresh key is started: {other:?}"),
                        Err(_) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    let completed = tokio::time::timeout(
                        Duration::from_secs(12),
                        client.complete(complete(&key, started.lease_token, b"done")),
                    )
                    .await
                    .expect("Complete answered within the grace period");
                    calls.fetch_add(1, Ordering::Relaxed);
                    match completed {
                        Ok(_) => {
                            acknowledged.lock().expect("acknowledged").insert(key);
                        }
                        Err(_) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    eventually(Duration::from_secs(20), "calls are flowing", || async {
        acknowledged.lock().expect("acknowledged").len() >= 200
    })
    .await;
    server.signal("TERM");
    for caller in callers {
        caller.await.expect("caller");
    }
    assert_eq!(server.wait(Duration::from_secs(15)).await, Some(0));

    let acknowledged = std::mem::take(&mut *acknowledged.lock().expect("acknowledged"));
    let stored = database.completed_keys(NAMESPACE).await;
    let lost: Vec<_> = acknowledged.difference(&stored).collect();
    let unacknowledged: Vec<_> = stored.difference(&acknowledged).collect();
    assert!(lost.is_empty(), "acknowledged but not stored: {lost:?}");
    assert!(
        unacknowledged.is_empty(),
        "stored without an answer to its caller: {unacknowledged:?}"
    );
    println!(
        "shutdown under load ({backend:?}): {CALLERS} callers, {} calls, {} refused after \
         SIGTERM, exit 0; completed in the store = answered OK = {} keys; lost 0, duplicated 0",
        calls.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        stored.len()
    );
}

for_each_backend!(sigterm_under_load_answers_every_accepted_call_and_loses_nothing,);

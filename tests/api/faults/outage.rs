//! Scenario 3: the network between the service and PostgreSQL is cut, then black-holed, under
//! load; calls fail UNAVAILABLE within the operation timeout, health notices, and every key is
//! left as its caller was told.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::{
    lookup_response::State, try_start_response::Outcome,
};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use idempotency_testkit::load::Callers;

use crate::support::proxy::TcpProxy;
use crate::support::*;

/// The outcome of one key's lifecycle during an outage.
#[derive(Debug, Default, Clone)]
struct Lifecycle {
    claimed: bool,
    completed: bool,
}

/// Callers doing TryStart + Complete on fresh keys (the test kit's load driver), recording what
/// each call was told, every failure's code and reason, and the slowest single RPC.
struct Load {
    callers: Callers<(Code, String)>,
    keys: Arc<Mutex<BTreeMap<String, Lifecycle>>>,
    slowest_micros: Arc<AtomicU64>,
}

impl Load {
    fn start(client: &Client, callers: usize, label: &'static str) -> Self {
        let keys: Arc<Mutex<BTreeMap<String, Lifecycle>>> = Arc::default();
        let slowest_micros = Arc::new(AtomicU64::new(0));
        let (client, recorded, slowest) = (client.clone(), keys.clone(), slowest_micros.clone());
        let callers = Callers::start(callers, move |caller, sequence| {
            let (mut client, keys, slowest) = (client.clone(), recorded.clone(), slowest.clone());
            async move {
                let key = format!("{label}-{caller}-{sequence}");
                keys.lock()
                    .expect("keys")
                    .insert(key.clone(), Lifecycle::default());
                let failure = |status: tonic::Status| {
                    let reason = tonic_types::StatusExt::get_error_details(&status)
                        .error_info()
                        .map(|info| info.reason.clone())
                        .unwrap_or_default();
                    (status.code(), reason)
                };
                let timed = |began: tokio::time::Instant| {
                    let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
                    slowest.fetch_max(micros, Ordering::Relaxed);
                };
                let began = tokio::time::Instant::now();
                let answer = client.try_start(try_start(&key)).await;
                timed(began);
                let started = match answer.map(|a| a.into_inner().outcome) {
                    Ok(Some(Outcome::Started(started))) => started,
                    Ok(other) => panic!("a fresh key is started: {other:?}"),
                    Err(status) => return Err(failure(status)),
                };
                keys.lock()
                    .expect("keys")
                    .get_mut(&key)
                    .expect("known")
                    .claimed = true;
                let began = tokio::time::Instant::now();
                let completed = client
                    .complete(complete(&key, started.lease_token, key.as_bytes()))
                    .await;
                timed(began);
                completed.map_err(failure)?;
                keys.lock()
                    .expect("keys")
                    .get_mut(&key)
                    .expect("known")
                    .completed = true;
                Ok(())
            }
        });
        Self {
            callers,
            keys,
            slowest_micros,
        }
    }

    fn successes(&self) -> u64 {
        self.callers.successes_so_far()
    }

    async fn finish(self) -> (BTreeMap<String, Lifecycle>, Vec<(Code, String)>, Duration) {
        let tally = self.callers.finish().await.expect("the callers finish");
        let keys = std::mem::take(&mut *self.keys.lock().expect("keys"));
        let slowest = Duration::from_micros(self.slowest_micros.load(Ordering::Relaxed));
        (keys, tally.failures, slowest)
    }
}

/// Checks every key against what its caller was told. An acknowledged completion must be
/// there; a call that failed may or may not have taken effect (the connection broke under it),
/// but only in a state the contract allows, with this caller's own data.
async fn check_states(client: &Client, keys: &BTreeMap<String, Lifecycle>) -> (usize, usize) {
    let (mut completed, mut other) = (0, 0);
    for (key, told) in keys {
        let state = key_state(client, key).await;
        match state {
            State::Completed(done) => {
                assert_eq!(
                    done.response,
                    key.as_bytes(),
                    "{key} holds its own response"
                );
                completed += 1;
            }
            State::InProgress(held) => {
                assert!(
                    !told.completed,
                    "{key}: an acknowledged completion was lost"
                );
                assert_eq!(held.fingerprint, FINGERPRINT);
                other += 1;
            }
            State::Absent(_) => {
                assert!(!told.claimed, "{key}: an acknowledged claim was lost");
                other += 1;
            }
        }
    }
    (completed, other)
}

/// Scenario 3. PostgreSQL only: the outage is a network one, between the service and its
/// database, which the embedded store does not have.
#[tokio::test]
async fn a_database_outage_fails_calls_in_time_and_leaves_every_key_valid() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let url = proxy.database_url(database.postgres_name());
    let operation_timeout = Duration::from_secs(1);
    let app = TestApp::start_on(database, Some(&url), &["--operation-timeout", "1s"]).await;
    app.wait_for_status(ServingStatus::Serving).await;
    let client = app.client().await;

    for (fault, label) in [("cut", "cut"), ("blackhole", "blackhole")] {
        let load = Load::start(&client, 8, label);
        eventually(Duration::from_secs(10), "calls flow", || async {
            load.successes() >= 50
        })
        .await;
        match fault {
            "cut" => proxy.cut(),
            _ => proxy.blackhole(),
        }
        let faulted = tokio::time::Instant::now();
        app.wait_for_status(ServingStatus::NotServing).await;
        let noticed = faulted.elapsed();
        // Keep calling into the outage for a while.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        proxy.restore();
        app.wait_for_status(ServingStatus::Serving).await;
        let during = load.successes();
        eventually(Duration::from_secs(10), "calls flow again", || async {
            load.successes() >= during + 50
        })
        .await;
        let (keys, failures, slowest) = load.finish().await;

        assert!(!failures.is_empty(), "the {fault} made calls fail");
        for (code, reason) in &failures {
            assert_eq!(
                (*code, reason.as_str()),
                (Code::Unavailable, "STORE_UNAVAILABLE")
            );
        }
        // The server answers every call within the operation timeout; measured from this
        // side on a loaded machine, the bound is generous (three times it), yet far below what
        // a call left to the network's own timeouts would take in a black hole (minutes).
        assert!(
            slowest <= 3 * operation_timeout,
            "every call answered within the operation timeout: slowest {slowest:?}"
        );
        // Health probes every 100 ms, each bounded by the operation timeout: the outage is
        // noticed within a few probes; the bound is again generous.
        assert!(
            noticed < 5 * operation_timeout,
            "health noticed in {noticed:?}"
        );
        let (completed, other) = check_states(&client, &keys).await;
        println!(
            "database outage ({fault}): {} lifecycles, {} calls failed UNAVAILABLE, slowest \
             call {slowest:?}, NOT_SERVING after {noticed:?}; {} keys checked: {completed} \
             completed, {other} in progress or absent as their callers were told; lost 0, \
             duplicated 0",
            keys.len(),
            failures.len(),
            keys.len()
        );
    }
}

//! Proof under faults: replicas racing, a crash, a database outage, shutdown under load, and
//! callers that give up. Every scenario counts exactly what was acknowledged and checks it
//! against the store afterwards: nothing lost, nothing duplicated. Each prints its figures
//! (`cargo nextest run faults --no-capture`), which docs/reliability.md records.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::{
    TryStartRequest, lookup_response::State, try_start_response::Outcome,
};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use idempotency_testkit::load::Callers;

use crate::support::process::ServerProcess;
use crate::support::proxy::TcpProxy;
use crate::support::*;

/// Scenario 1. PostgreSQL only: replicas share a database; the embedded store is for one
/// instance.
#[tokio::test]
async fn two_replicas_racing_elect_exactly_one_winner_per_key() {
    const KEYS: usize = 50;
    const CALLS: usize = 500;
    let database = TestDatabase::create(Backend::Postgres).await;
    let replicas = [
        ServerProcess::start(&database.url, &[]).await,
        ServerProcess::start(&database.url, &[]).await,
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
            client
                .complete(complete(&key, started.lease_token, &response))
                .await
                .expect("Complete");
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
        assert!(
            slowest <= operation_timeout + Duration::from_millis(500),
            "every call answered within the operation timeout: slowest {slowest:?}"
        );
        assert!(
            noticed < Duration::from_secs(5),
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

/// Scenario 5, on both stores: a client deadline in the middle of Complete and of TryStart.
async fn a_caller_deadline_mid_call_leaves_a_consistent_store_and_a_recoverable_claim(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;

    let done = unique_key("deadline-complete");
    let held = claim(&mut client, try_start(&done)).await;
    let abandoned = unique_key("deadline-claim");
    claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&abandoned)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &abandoned).await;
    let retry = TryStartRequest {
        attempt_id: "give-up-then-retry".into(),
        ..try_start(&abandoned)
    };

    let hold = app.database.hold_keys(&[&done, &abandoned]).await;
    let mut complete_request =
        tonic::Request::new(complete(&done, held.lease_token, b"finished anyway"));
    complete_request.set_timeout(Duration::from_millis(300));
    let mut claim_request = tonic::Request::new(retry.clone());
    claim_request.set_timeout(Duration::from_millis(300));
    let (mut a, mut b) = (client.clone(), client.clone());
    let (completed, claimed) =
        tokio::join!(a.complete(complete_request), b.try_start(claim_request));
    for status in [
        completed.expect_err("deadline"),
        claimed.expect_err("deadline"),
    ] {
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "the caller's deadline ended the call: {status:?}"
        );
    }
    app.wait_for_blocked(2).await;
    hold.release().await;

    // The work the callers gave up on ran to its end: the key is completed...
    eventually(
        Duration::from_secs(10),
        "the Complete committed",
        || async { matches!(key_state(&client, &done).await, State::Completed(_)) },
    )
    .await;
    // ...and the claim was taken; the retry with the same attempt_id gets it back.
    let token = || app.database.key_lease_token(&abandoned);
    eventually(Duration::from_secs(10), "the claim committed", || async {
        token().await != 0 && {
            let mut client = client.clone();
            let answer = client.lookup(lookup(&abandoned)).await.expect("Lookup");
            matches!(state(answer.into_inner()), State::InProgress(held) if held.attempt == 2)
        }
    })
    .await;
    let recovered = claim(&mut client, retry).await;
    assert_eq!(recovered.lease_token, token().await);
    assert_eq!(recovered.attempt, 2);
}

for_each_backend!(
    a_crashed_server_leaves_every_key_completed_or_claimable,
    sigterm_under_load_answers_every_accepted_call_and_loses_nothing,
    a_caller_deadline_mid_call_leaves_a_consistent_store_and_a_recoverable_claim,
);

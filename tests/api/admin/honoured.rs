//! An erasure returns only once no replica can replay what it erased (docs/contract.md, "The
//! admin API"): three replicas on one PostgreSQL database, each holding the erased record in its
//! replay cache, replays running through all of them while the erasure runs, and calls on
//! another replica the moment the RPC returns. Then the same with one replica that cannot hear
//! the erasure: its listening connection cut, or the whole process paused.
//!
//! Where a round deletes the record's row by hand first, every replay after that can only come
//! from a replica's memory: each replica is first seen replaying it that way (its cache holds it
//! and serves), so that "no replay after the erasure" says the erasure reached that memory.
//! PostgreSQL only: the embedded store serves one process.

use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use tokio_util::sync::CancellationToken;

use idempotency_coordinator::service::erasures::CONFIRMED_FOR;

use super::*;
use crate::support::process::ServerProcess;

/// How many EraseKey rounds run through three replicas.
const KEY_ROUNDS: usize = 200;
/// How many EraseNamespace rounds, of [`KEYS_PER_NAMESPACE`] keys each.
const NAMESPACE_ROUNDS: usize = 40;
const KEYS_PER_NAMESPACE: usize = 3;

/// A request of `namespace` (the helpers' requests are of [`NAMESPACE`]).
fn try_start_in(namespace: &str, key: &str) -> pb::TryStartRequest {
    pb::TryStartRequest {
        namespace: namespace.into(),
        ..try_start(key)
    }
}

fn lookup_in(namespace: &str, key: &str) -> pb::LookupRequest {
    pb::LookupRequest {
        namespace: namespace.into(),
        key: key.into(),
    }
}

/// Deletes a key's row behind the replicas' backs: from then on only a replay cache can answer
/// it completed.
async fn delete_the_row_by_hand(database: &TestDatabase, namespace: &str, key: &str) {
    sqlx::query("DELETE FROM idempotency_keys WHERE namespace = $1 AND key = $2")
        .bind(namespace)
        .bind(key)
        .execute(database.postgres_pool())
        .await
        .expect("delete the row by hand");
}

/// Waits until `client`'s replica replays `key` from memory (its row deleted by hand): its cache
/// holds the record and is confirmed.
async fn replays_from_memory(client: &Client, namespace: &str, key: &str) {
    eventually(
        Duration::from_secs(10),
        &format!("{key} is replayed from memory"),
        || async {
            let answer = answered(
                client.clone().lookup(lookup_in(namespace, key)).await,
                "Lookup",
            );
            matches!(answer.state, Some(State::Completed(_)))
        },
    )
    .await;
}

/// Lookups of each key through every client, over and over until stopped: the replays that
/// run while an erasure does. Answers each Lookup's send time and whether it answered the
/// completed record.
fn replaying(
    clients: &[Client],
    namespace: &str,
    keys: &[String],
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Vec<(Instant, bool)>> {
    let (clients, namespace, keys, stop) = (
        clients.to_vec(),
        namespace.to_owned(),
        keys.to_vec(),
        stop.clone(),
    );
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while !stop.is_cancelled() {
            for client in &clients {
                for key in &keys {
                    let sent = Instant::now();
                    let answer = answered(
                        client.clone().lookup(lookup_in(&namespace, key)).await,
                        "Lookup",
                    );
                    seen.push((sent, matches!(answer.state, Some(State::Completed(_)))));
                }
            }
        }
        seen
    })
}

/// Stops the replays and asserts that none sent after `returned` answered the erased record.
async fn no_replay_after(
    replays: tokio::task::JoinHandle<Vec<(Instant, bool)>>,
    stop: &CancellationToken,
    returned: Instant,
    round: usize,
) {
    stop.cancel();
    let seen = replays.await.expect("the replays");
    let late = seen
        .iter()
        .filter(|(sent, completed)| *sent >= returned && *completed)
        .count();
    assert_eq!(late, 0, "round {round}: replays of an erased record");
}

/// The calls the moment an erasure returned: a TryStart with another fingerprint on one replica
/// (which must claim afresh: the erased record would answer `fingerprint_mismatch`) and a
/// Lookup on another (which must not answer the record).
async fn forgotten_at_once(
    claimer: &Client,
    looker: &Client,
    namespace: &str,
    key: &str,
    round: usize,
) {
    let claim = try_start_in(namespace, key).with_fingerprint(b"another request");
    let (mut claimer, mut looker) = (claimer.clone(), looker.clone());
    let (claimed, looked) = tokio::join!(
        claimer.try_start(claim),
        looker.lookup(lookup_in(namespace, key)),
    );
    let claimed = outcome(answered(claimed, "TryStart"));
    assert!(
        matches!(claimed, Outcome::Started(_) | Outcome::InProgress(_)),
        "round {round}: {key} answered {claimed:?} after its erasure returned"
    );
    let looked = answered(looked, "Lookup").state;
    assert!(
        !matches!(looked, Some(State::Completed(_))),
        "round {round}: {key} looked up as {looked:?} after its erasure returned"
    );
}

/// Three replicas: the test's server and two more on its database.
struct Three {
    app: TestApp,
    _others: [crate::support::app::Replica; 2],
    clients: Vec<Client>,
    admins: Vec<AdminClient>,
}

async fn three_replicas() -> Three {
    let app = TestApp::spawn_with(Backend::Postgres, &[]).await;
    let others = [app.replica(&[]).await, app.replica(&[]).await];
    let endpoints = [
        app.endpoint(),
        format!("http://{}", others[0].addr),
        format!("http://{}", others[1].addr),
    ];
    let mut clients = Vec::new();
    let mut admins = Vec::new();
    for endpoint in endpoints {
        clients.push(Client::connect(endpoint.clone()).await.expect("connect"));
        admins.push(AdminClient::connect(endpoint).await.expect("connect"));
    }
    Three {
        app,
        _others: others,
        clients,
        admins,
    }
}

/// Completes `key` through one replica and replays it through all three, so that each holds it;
/// with `by_hand`, deletes its row by hand and waits until each replays it from memory.
async fn held_by_every_cache(
    three: &Three,
    namespace: &str,
    key: &str,
    round: usize,
    by_hand: bool,
) {
    let mut completer = three.clients[round % 3].clone();
    let started =
        expect_started(try_start_response(&completer, try_start_in(namespace, key)).await);
    let mut complete = complete(key, started.lease_token, b"the erased answer");
    complete.namespace = namespace.into();
    answered(completer.complete(complete).await, "Complete");
    for client in &three.clients {
        expect_completed(try_start_response(client, try_start_in(namespace, key)).await);
    }
    if by_hand {
        delete_the_row_by_hand(&three.app.database, namespace, key).await;
        for client in &three.clients {
            replays_from_memory(client, namespace, key).await;
        }
    }
}

/// EraseKey through each replica in turn, hundreds of times, with replays running through all
/// three: nothing replays the key once the erasure has returned. Every replica being up, each
/// erasure returns on their acknowledgements, not at the end of the bound.
#[tokio::test]
async fn postgres_an_erased_key_is_replayed_by_no_replica_once_erasekey_returns() {
    let three = three_replicas().await;
    let mut took = Vec::new();
    for round in 0..KEY_ROUNDS {
        let key = unique_key("erased");
        held_by_every_cache(&three, NAMESPACE, &key, round, round.is_multiple_of(2)).await;
        let stop = CancellationToken::new();
        let replays = replaying(&three.clients, NAMESPACE, std::slice::from_ref(&key), &stop);
        let began = Instant::now();
        erased(&three.admins[round % 3], &key, "data protection").await;
        let returned = Instant::now();
        took.push(returned - began);
        forgotten_at_once(
            &three.clients[(round + 1) % 3],
            &three.clients[(round + 2) % 3],
            NAMESPACE,
            &key,
            round,
        )
        .await;
        no_replay_after(replays, &stop, returned, round).await;
    }
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < CONFIRMED_FOR,
        "the median EraseKey took {median:?}: the replicas' acknowledgements were not heard"
    );
}

/// EraseNamespace through each replica in turn, with replays of its keys running through all
/// three: once its stream's last message (`done`) has arrived, no replica replays any of them.
#[tokio::test]
async fn postgres_an_erased_namespace_is_replayed_by_no_replica_once_its_erasure_is_done() {
    let three = three_replicas().await;
    for round in 0..NAMESPACE_ROUNDS {
        let namespace = format!("tenant-{round}-{}", uuid::Uuid::new_v4().simple());
        let keys: Vec<String> = (0..KEYS_PER_NAMESPACE)
            .map(|index| format!("key-{index}"))
            .collect();
        // On even rounds every row but the last is deleted by hand: the erasure erases that one,
        // and its announcement must clear the others from every replica's memory too.
        for (index, key) in keys.iter().enumerate() {
            let by_hand = round.is_multiple_of(2) && index + 1 < keys.len();
            held_by_every_cache(&three, &namespace, key, round, by_hand).await;
        }
        let stop = CancellationToken::new();
        let replays = replaying(&three.clients, &namespace, &keys, &stop);
        let messages = erase_namespace(&three.admins[round % 3], &namespace, 2).await;
        let returned = Instant::now();
        assert!(
            messages.last().is_some_and(|last| last.done),
            "round {round}: {messages:?}"
        );
        for key in &keys {
            forgotten_at_once(
                &three.clients[(round + 1) % 3],
                &three.clients[(round + 2) % 3],
                &namespace,
                key,
                round,
            )
            .await;
        }
        no_replay_after(replays, &stop, returned, round).await;
    }
}

/// How a replica is kept from hearing an erasure.
enum Deafness<'a> {
    /// Its listening connection (and its heartbeat's, which goes the same way) goes through
    /// this proxy, cut while the erasure runs and until the calls after it were answered.
    ListenerCut(&'a proxy::TcpProxy),
    /// The whole process is paused while the erasure runs, and resumed the moment it returned.
    Paused(&'a ServerProcess),
}

impl Deafness<'_> {
    fn begin(&self) {
        match self {
            Self::ListenerCut(proxy) => proxy.cut(),
            Self::Paused(process) => process.signal("STOP"),
        }
    }

    /// The erasure returned: a paused replica resumes (to answer the calls after it).
    fn erasure_returned(&self) {
        if let Self::Paused(process) = self {
            process.signal("CONT");
        }
    }

    /// The calls after the erasure were answered: a cut listener connects again.
    fn checked(&self) {
        if let Self::ListenerCut(proxy) = self {
            proxy.restore();
        }
    }
}

/// A key completed through `client` that `deaf` holds in memory: replayed through it once,
/// then its row deleted by hand, and replayed again from memory. Tried again with another key
/// while `deaf` is not confirmed yet, or forgets what it held when its listener connects again
/// after the last round's trouble.
async fn a_key_held_in_memory(app: &TestApp, client: &Client, deaf: &Client) -> String {
    eventually_some(
        Duration::from_secs(30),
        "a key replayed from the replica's memory",
        || async {
            let key = unique_key("unheard");
            claim_and_complete(&mut client.clone(), &key, b"the erased answer").await;
            expect_replay(deaf, &key, b"the erased answer").await;
            delete_the_row_by_hand(&app.database, NAMESPACE, &key).await;
            for _ in 0..10 {
                if matches!(key_state(deaf, &key).await, State::Completed(_)) {
                    return Some(key);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None
        },
    )
    .await
}

/// A replica that cannot hear the erasure holds the record in memory; the erasure returns
/// anyway (at the end of its bound), and from the moment it has, that replica replays nothing:
/// it is no longer confirmed. A few rounds, each waiting for the replica to be confirmed again.
async fn a_replica_that_cannot_hear_replays_nothing_after_the_erasure(
    app: &TestApp,
    deaf: &Client,
    deafness: Deafness<'_>,
) {
    let client = app.client().await;
    let admin = admin_client(app).await;
    for round in 0..3 {
        let key = a_key_held_in_memory(app, &client, deaf).await;

        deafness.begin();
        let began = Instant::now();
        erased(&admin, &key, "data protection").await;
        let took = began.elapsed();
        deafness.erasure_returned();
        forgotten_at_once(deaf, deaf, NAMESPACE, &key, round).await;
        deafness.checked();
        // It waited for the replica that could not acknowledge: that one was live, and silent.
        assert!(
            took >= CONFIRMED_FOR,
            "round {round}: the erasure returned after {took:?}, without waiting for the \
             replica that could not hear it"
        );
    }
}

/// One replica's listening connection is cut while the erasure runs: it never hears the
/// erasure, yet replays nothing once it returned.
#[tokio::test]
async fn postgres_a_replica_whose_listener_is_cut_replays_nothing_after_the_erasure() {
    let app = TestApp::spawn_with(Backend::Postgres, &[]).await;
    let proxy = proxy::TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let notify_url = proxy.database_url(app.database.postgres_name());
    let deaf = app.replica(&["--notify-database-url", &notify_url]).await;
    a_replica_that_cannot_hear_replays_nothing_after_the_erasure(
        &app,
        &deaf.client().await,
        Deafness::ListenerCut(&proxy),
    )
    .await;
}

/// One replica is paused (SIGSTOP) while the erasure runs and resumed the moment it returns:
/// the first call it answers does not replay the record.
#[tokio::test]
async fn postgres_a_replica_paused_through_the_erasure_replays_nothing_after_it() {
    let app = TestApp::spawn_with(Backend::Postgres, &[]).await;
    let paused = ServerProcess::start(&app.database.url, &[]).await;
    let paused_client = paused.client_when_serving().await;
    a_replica_that_cannot_hear_replays_nothing_after_the_erasure(
        &app,
        &paused_client,
        Deafness::Paused(&paused),
    )
    .await;
}

/// A replica that shuts down stops serving from memory and deletes its row at once: erasures
/// stop waiting for it then, not seconds later when its heartbeat would have grown old.
#[tokio::test]
async fn postgres_a_replica_that_shuts_down_is_not_waited_for() {
    let app = TestApp::spawn_with(Backend::Postgres, &[]).await;
    let replica = app.replica(&[]).await;
    rows_become(&app.database, "idempotency_replicas", 2).await;
    drop(replica);
    // The stopped replica left.
    rows_become(&app.database, "idempotency_replicas", 1).await;
    let admin = admin_client(&app).await;
    let began = Instant::now();
    erased(&admin, "any", "data protection").await;
    assert!(
        began.elapsed() < CONFIRMED_FOR,
        "the erasure waited {:?} for a replica that had left",
        began.elapsed()
    );
}

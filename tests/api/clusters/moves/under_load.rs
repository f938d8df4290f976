//! A move under load, on two replicas, every promise of the contract kept across it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::*;

/// Callers per replica on the moving namespace, and per other namespace.
const CALLERS: usize = 4;

/// What the callers on one namespace saw: each acknowledged completion's key and response, and
/// every failure.
#[derive(Default)]
struct Seen {
    acknowledged: Vec<(String, Vec<u8>)>,
    failures: Vec<String>,
}

/// Lifecycles of fresh keys of `namespace` by [`CALLERS`] callers on each of `clients` until
/// `stop`.
fn load(
    clients: &[Client],
    namespace: &'static str,
    stop: &CancellationToken,
) -> (Arc<Mutex<Seen>>, Vec<tokio::task::JoinHandle<()>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = Vec::new();
    for client in clients {
        for _ in 0..CALLERS {
            let (client, stop, seen) = (client.clone(), stop.clone(), seen.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let key = unique_key(namespace);
                    let outcome = async {
                        let started = client
                            .clone()
                            .try_start(try_start_in(namespace, &key))
                            .await?
                            .into_inner();
                        let Some(pb::try_start_response::Outcome::Started(claim)) = started.outcome
                        else {
                            return Err(tonic::Status::internal(format!("{started:?}")));
                        };
                        let request = complete(&key, claim.lease_token, key.as_bytes())
                            .in_namespace(namespace.into());
                        client.clone().complete(request).await?;
                        Ok(())
                    }
                    .await;
                    let mut seen = seen.lock().expect("seen");
                    match outcome {
                        Ok(()) => seen.acknowledged.push((key.clone(), key.into_bytes())),
                        Err(status) => seen.failures.push(format!("{namespace}/{key}: {status:?}")),
                    }
                }
            }));
        }
    }
    (seen, tasks)
}

/// Callers on both replicas racing for the same `keys` of `namespace`: each claim granted is
/// counted per key (its work "runs"), then completed.
async fn race(
    clients: &[Client],
    namespace: &'static str,
    keys: &[String],
) -> HashMap<String, usize> {
    let granted: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let mut tasks = Vec::new();
    for client in clients {
        for racer in 0..3 {
            let (client, keys, granted) = (client.clone(), keys.to_vec(), granted.clone());
            tasks.push(tokio::spawn(async move {
                for key in keys {
                    let request = try_start_in(namespace, &key)
                        .with_attempt(&format!("racer-{racer}-{}", unique_key("attempt")));
                    let Ok(answer) = client.clone().try_start(request).await else {
                        continue;
                    };
                    if let Some(pb::try_start_response::Outcome::Started(claim)) =
                        answer.into_inner().outcome
                    {
                        *granted
                            .lock()
                            .expect("granted")
                            .entry(key.clone())
                            .or_default() += 1;
                        let done = complete(&key, claim.lease_token, b"raced")
                            .in_namespace(namespace.into());
                        let _ = client.clone().complete(done).await;
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a racer");
    }
    Arc::try_unwrap(granted)
        .expect("every racer ended")
        .into_inner()
        .expect("granted")
}

#[tokio::test]
async fn a_namespace_moves_under_load_on_two_replicas_with_every_promise_kept() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, FLAGS).await;
    let flags = cluster_flags(&clusters, FLAGS);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let other = app.replica(&flags).await;
    let clients = [app.client().await, other.client().await];
    let admin = admin_of(app.endpoint()).await;
    let (a, b) = (&clusters.nodes[0], &clusters.nodes[1]);

    // Before the move, on a: completed records, processed events, a holder whose lease spans the
    // move, a key another replica's caller waits for, a lease about to run out.
    let mut completed = Vec::new();
    for n in 0..20 {
        let key = format!("done-{n}-{}", unique_key("misc"));
        lifecycle(&clients[n % 2], "misc", &key, key.as_bytes()).await;
        completed.push(key);
    }
    let events: Vec<String> = (0..10).map(|n| format!("event-{n}")).collect();
    let ids: Vec<&str> = events.iter().map(String::as_str).collect();
    answered(
        clients[0].clone().mark_processed(mark("misc", &ids)).await,
        "MarkProcessed",
    );
    let held_key = unique_key("held");
    let held = claim(
        &mut clients[0].clone(),
        try_start_in("misc", &held_key).with_lease(millis(60_000)),
    )
    .await;
    let awaited_key = unique_key("awaited");
    let awaited = claim(&mut clients[1].clone(), try_start_in("misc", &awaited_key)).await;
    let waiter = {
        let client = clients[0].clone();
        let request = try_start_in("misc", &awaited_key).with_wait(Duration::from_secs(30));
        tokio::spawn(async move { client.clone().try_start(request).await })
    };
    app.wait_for_waiters(1).await;
    let expiring_key = unique_key("expiring");
    let expiring = claim(
        &mut clients[1].clone(),
        try_start_in("misc", &expiring_key).with_lease(millis(300)),
    )
    .await;

    // The load: lifecycles on the moving namespace and on one of each other cluster, and racers
    // for the same keys on the moving one.
    let stop = CancellationToken::new();
    let (moving, mut tasks) = load(&clients, "misc", &stop);
    let mut others = Vec::new();
    for namespace in ["orders-eu", "billing"] {
        let (seen, more) = load(&clients, namespace, &stop);
        others.push(seen);
        tasks.extend(more);
    }
    let raced: Vec<String> = (0..40)
        .map(|n| format!("raced-{n}-{}", unique_key("r")))
        .collect();
    let racing = {
        let (clients, raced) = (clients.clone(), raced.clone());
        tokio::spawn(async move { race(&clients, "misc", &raced).await })
    };
    eventually(Duration::from_secs(20), "the load is under way", || async {
        moving.lock().expect("seen").acknowledged.len() >= 20
    })
    .await;

    let report = moved(&admin, move_request("misc", "b")).await;
    assert_eq!((report.from.as_str(), report.to.as_str()), ("a", "b"));
    assert_eq!(report.outcome, "moved");
    assert_eq!(report.events_copied, 10);
    assert!(report.keys_copied >= 20 + 3, "{report:?}");
    let before_count = moving.lock().expect("seen").acknowledged.len();
    eventually(
        Duration::from_secs(20),
        "the load goes on after the move",
        || async { moving.lock().expect("seen").acknowledged.len() >= before_count + 20 },
    )
    .await;
    // Every token handed out for misc before the move was drawn on a, whose sequence no other
    // namespace draws from: the tokens after the move are above all of them.
    let highest_before = last_token_on(a).await;
    stop.cancel();
    for task in tasks {
        task.await.expect("a caller");
    }
    let granted = racing.await.expect("the racers");

    // Nothing failed, on the moving namespace or on the others.
    for seen in others.iter().chain([&moving]) {
        let seen = seen.lock().expect("seen");
        assert!(seen.failures.is_empty(), "{:#?}", seen.failures);
    }
    // No raced key's work ran twice (and every one ran).
    for key in &raced {
        assert_eq!(
            granted.get(key).copied().unwrap_or(0),
            1,
            "{key}: {granted:?}"
        );
    }
    // Every acknowledged completion replays, on either replica, from b.
    let acknowledged = std::mem::take(&mut moving.lock().expect("seen").acknowledged);
    for (n, (key, response)) in acknowledged.iter().enumerate() {
        let replay =
            expect_completed(try_start_response(&clients[n % 2], try_start_in("misc", key)).await);
        assert_eq!(&replay.response, response, "{key}");
    }
    for key in &completed {
        let replay =
            expect_completed(try_start_response(&clients[1], try_start_in("misc", key)).await);
        assert_eq!(replay.response, key.as_bytes());
    }
    // The processed events came along.
    let again = answered(
        clients[1].clone().mark_processed(mark("misc", &ids)).await,
        "MarkProcessed",
    );
    assert!(
        again.results.iter().all(|event| event.already_processed),
        "{again:?}"
    );
    // The holder completes with the token it got on a; the waiter is answered with it.
    answered(
        clients[0]
            .clone()
            .complete(complete(&held_key, held.lease_token, b"held").in_namespace("misc".into()))
            .await,
        "Complete",
    );
    answered(
        clients[1]
            .clone()
            .complete(
                complete(&awaited_key, awaited.lease_token, b"awaited").in_namespace("misc".into()),
            )
            .await,
        "Complete",
    );
    let waited = expect_completed(answered(waiter.await.expect("the waiter"), "TryStart"));
    assert_eq!(waited.response, b"awaited");
    // A lease that ran out is taken over on b with a greater token than any before the move.
    let taken_over = eventually_some(Duration::from_secs(10), "the takeover", || {
        let client = clients[0].clone();
        let key = expiring_key.clone();
        async move {
            match try_start_response(&client, try_start_in("misc", &key))
                .await
                .outcome
            {
                Some(pb::try_start_response::Outcome::Started(claim)) => Some(claim),
                _ => None,
            }
        }
    })
    .await;
    assert!(taken_over.lease_token > expiring.lease_token);
    assert!(
        i64::try_from(taken_over.lease_token).expect("a token") > highest_before,
        "{} after the move, {highest_before} before",
        taken_over.lease_token
    );
    let fresh = claim(
        &mut clients[1].clone(),
        try_start_in("misc", &unique_key("fresh")),
    )
    .await;
    assert!(i64::try_from(fresh.lease_token).expect("a token") > highest_before);

    // The rows live on b alone; a's gate points there; the move is in misc's audit trail.
    assert_eq!(keys_on(a, "misc").await, 0);
    assert_eq!(events_on(a, "misc").await, 0);
    assert!(keys_on(b, "misc").await >= 20);
    assert_eq!(events_on(b, "misc").await, 10);
    assert_eq!(gate_on(a, "misc").await, Some(("left".into(), "b".into())));
    assert_eq!(gate_on(b, "misc").await, None);
    assert_eq!(
        audit_actions(&admin, "misc")
            .await
            .first()
            .map(String::as_str),
        Some("move_placement")
    );
    // Moving it there again does nothing.
    let again = moved(&admin, move_request("misc", "b")).await;
    assert_eq!(again.outcome, "already_there");
}

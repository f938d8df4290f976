//! Each namespace on its cluster, and what spans clusters working as on one.

use std::time::Duration;

use idempotency_coordinator::domain;
use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::proto::idempotency::v1::admin_service_client::AdminServiceClient;
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use idempotency_coordinator::store::Store;

use super::*;

/// Every RPC of a namespace writes to its cluster only: keys (claimed, completed, replayed)
/// and the processed events of the consumer of the same name; a namespace no rule names goes
/// to the first cluster.
#[tokio::test]
async fn each_namespace_is_served_by_its_cluster_and_nowhere_else() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, &[]).await;
    let client = app.client().await;
    for namespace in NAMESPACES {
        lifecycle(
            &client,
            namespace,
            &unique_key(namespace),
            namespace.as_bytes(),
        )
        .await;
        let marked = mark_results(&client, mark(namespace, &["e1", "e2"])).await;
        assert!(marked.iter().all(|event| !event.already_processed));
        let again = mark_results(&client, mark(namespace, &["e1"])).await;
        assert!(again[0].already_processed, "e1 of {namespace} marked again");
    }
    for (at, node) in clusters.nodes.iter().enumerate() {
        for (placed, namespace) in NAMESPACES.iter().enumerate() {
            let (keys, events) = if placed == at { (1, 2) } else { (0, 0) };
            assert_eq!(
                keys_on(node, namespace).await,
                keys,
                "keys of {namespace} on {}",
                node.name
            );
            assert_eq!(
                events_on(node, namespace).await,
                events,
                "events of {namespace} on {}",
                node.name
            );
        }
    }
}

/// Calls of all three clusters at once, many of them coalesced: each answered as alone, each
/// key's row on its namespace's cluster; and a round that spans the clusters, sent to the
/// store as one, is split and answered in order.
#[tokio::test]
async fn calls_and_rounds_that_span_clusters_are_each_answered() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, &[]).await;
    let client = app.client().await;
    let per_namespace = 30;
    let calls = NAMESPACES.iter().flat_map(|namespace| {
        (0..per_namespace).map(move |i| (*namespace, format!("{namespace}-{i}")))
    });
    let lifecycles = calls.map(|(namespace, key)| {
        let client = client.clone();
        async move { lifecycle(&client, namespace, &key, key.as_bytes()).await }
    });
    futures::future::join_all(lifecycles).await;
    for (at, node) in clusters.nodes.iter().enumerate() {
        assert_eq!(keys_on(node, NAMESPACES[at]).await, per_namespace);
    }

    // One round of six commands, two per cluster, interleaved: each answered in its place.
    let commands: Vec<domain::TryStartCommand> = (0..6)
        .map(|i| domain::TryStartCommand {
            namespace: domain::Scope::parse(NAMESPACES[i % 3].into()).expect("a namespace"),
            ..store_try_start(&format!("round-{i}"), &format!("attempt-{i}"))
        })
        .collect();
    let round = Round::new(commands).expect("no key twice");
    let answers = app.store.try_start_batch(&round).await;
    assert_eq!(answers.len(), 6);
    for (i, answer) in answers.into_iter().enumerate() {
        let answer = answer.unwrap_or_else(|error| panic!("command {i}: {error}"));
        assert!(
            matches!(answer, domain::TryStartOutcome::Started(_)),
            "command {i} answered {answer:?}"
        );
        let state = key_state_in(&client, NAMESPACES[i % 3], &format!("round-{i}")).await;
        assert!(
            matches!(state, State::InProgress(_)),
            "round-{i}: {state:?}"
        );
    }
    for (at, node) in clusters.nodes.iter().enumerate() {
        assert_eq!(keys_on(node, NAMESPACES[at]).await, per_namespace + 2);
    }
}

async fn key_state_in(client: &Client, namespace: &str, key: &str) -> State {
    state(answered(
        client
            .clone()
            .lookup(lookup(key).in_namespace(namespace.into()))
            .await,
        "Lookup",
    ))
}

/// Two replicas on the three clusters: a TryStart waiting on one replica for a key of b is
/// answered the moment the other completes it; an erasure on one replica of a key of c is
/// honoured by the other (which had it in its replay cache) when it returns.
#[tokio::test]
async fn waiting_and_erasures_work_across_replicas_and_clusters() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, &[]).await;
    let flags = cluster_flags(&clusters, &[]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let other = app.replica(&flags).await;
    let (client, other_client) = (app.client().await, other.client().await);

    let key = unique_key("waited");
    let started = claim(&mut other_client.clone(), try_start_in("orders-eu", &key)).await;
    let waiter = {
        let client = client.clone();
        let request = try_start_in("orders-eu", &key).with_wait(Duration::from_secs(20));
        tokio::spawn(async move { client.clone().try_start(request).await })
    };
    app.wait_for_waiters(1).await;
    answered(
        other_client
            .clone()
            .complete(complete(&key, started.lease_token, b"done").in_namespace("orders-eu".into()))
            .await,
        "Complete",
    );
    let answer = waiter.await.expect("the waiter's task");
    let replay = expect_completed(answered(answer, "TryStart"));
    assert_eq!(replay.response, b"done");

    let key = unique_key("erased");
    lifecycle(&client, "billing", &key, b"secret").await;
    expect_completed(try_start_response(&other_client, try_start_in("billing", &key)).await);
    let admin = AdminServiceClient::connect(app.endpoint())
        .await
        .expect("the admin API");
    answered(
        admin
            .clone()
            .erase_key(pb::EraseKeyRequest {
                namespace: "billing".into(),
                key: key.clone(),
                reason: "a customer's request".into(),
            })
            .await,
        "EraseKey",
    );
    for replica in [&client, &other_client] {
        let state = key_state_in(replica, "billing", &key).await;
        assert!(
            matches!(state, State::Absent(_)),
            "after the erasure: {state:?}"
        );
    }
    assert_eq!(keys_on(&clusters.nodes[2], "billing").await, 0);
}

//! Every cluster's listener, and its key events and erasures merged into the clustered store's
//! own streams. Each cluster's stream keeps its order in the merge. A heartbeat heard back
//! (`Erasure::Caught`) confirms the replay cache only for what that one cluster announced: the
//! merge names the cluster as its part, and the cache serves a namespace's replays only while
//! its own cluster's heartbeat confirms it. A cluster whose announcements stopped arriving (its
//! listener cut, its server stalled) leaves its own namespaces' replays to its store within a
//! second, and no other's (docs/scaling.md).

use futures::future::join_all;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use super::ClusteredStore;
use crate::store::{AdminStore, Erasure, KeyEvent, Store};

/// Runs every cluster's listener and the merge until `shutdown`.
pub(super) async fn follow_clusters(store: &ClusteredStore, shutdown: CancellationToken) {
    join_all(store.clusters.iter().enumerate().map(|(at, cluster)| {
        // Subscribed before the listener starts, so that nothing it hears is missed.
        let events = cluster.store.key_events();
        let erasures = cluster.store.erasures();
        let shutdown = shutdown.clone();
        async move {
            tokio::join!(
                cluster.store.watch_keys(shutdown.clone()),
                forward_events(events, &store.events, &shutdown),
                forward_erasures(erasures, &store.erasures, at, &shutdown),
            );
        }
    }))
    .await;
}

async fn forward_events(
    mut from: broadcast::Receiver<KeyEvent>,
    to: &broadcast::Sender<KeyEvent>,
    shutdown: &CancellationToken,
) {
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = from.recv() => event,
        };
        let _ = match event {
            Ok(event) => to.send(event),
            Err(RecvError::Lagged(_)) => to.send(KeyEvent::Missed),
            Err(RecvError::Closed) => return,
        };
    }
}

async fn forward_erasures(
    mut from: broadcast::Receiver<Erasure>,
    to: &broadcast::Sender<Erasure>,
    cluster: usize,
    shutdown: &CancellationToken,
) {
    loop {
        let erasure = tokio::select! {
            () = shutdown.cancelled() => return,
            erasure = from.recv() => erasure,
        };
        let merged = match erasure {
            Ok(Erasure::Caught { sent, .. }) => Erasure::Caught {
                sent,
                part: cluster,
            },
            Ok(erasure) => erasure,
            Err(RecvError::Lagged(_)) => Erasure::Missed,
            Err(RecvError::Closed) => return,
        };
        let _ = to.send(merged);
    }
}

//! Every cluster's listener, and its key events and erasures merged into the clustered store's
//! own streams. Each cluster's stream keeps its order in the merge. A heartbeat heard back
//! (`Erasure::Caught`) confirms the replay cache only for what that one cluster announced, so
//! the merge confirms up to the earliest of the clusters' latest heartbeats: a cluster whose
//! announcements stopped arriving (its listener cut, its server stalled) leaves the replay
//! cache unconfirmed within a second, and replays then go to their stores until it is heard
//! again (docs/scaling.md).

use std::sync::{Arc, Mutex, PoisonError};

use futures::future::join_all;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use super::ClusteredStore;
use crate::store::{AdminStore, Erasure, KeyEvent, Store};

/// Runs every cluster's listener and the merge until `shutdown`.
pub(super) async fn follow_clusters(store: &ClusteredStore, shutdown: CancellationToken) {
    let caught = Arc::new(Mutex::new(vec![None; store.clusters.len()]));
    join_all(store.clusters.iter().enumerate().map(|(at, cluster)| {
        // Subscribed before the listener starts, so that nothing it hears is missed.
        let events = cluster.store.key_events();
        let erasures = cluster.store.erasures();
        let shutdown = shutdown.clone();
        let caught = caught.clone();
        async move {
            tokio::join!(
                cluster.store.watch_keys(shutdown.clone()),
                forward_events(events, &store.events, &shutdown),
                forward_erasures(erasures, &store.erasures, (at, &caught), &shutdown),
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

/// The latest heartbeat heard back from each cluster (`None`: none yet).
type Caught = Mutex<Vec<Option<std::time::Instant>>>;

async fn forward_erasures(
    mut from: broadcast::Receiver<Erasure>,
    to: &broadcast::Sender<Erasure>,
    (at, caught): (usize, &Caught),
    shutdown: &CancellationToken,
) {
    loop {
        let erasure = tokio::select! {
            () = shutdown.cancelled() => return,
            erasure = from.recv() => erasure,
        };
        let merged = match erasure {
            Ok(Erasure::Caught(sent)) => {
                let mut latest = caught.lock().unwrap_or_else(PoisonError::into_inner);
                latest[at] = Some(sent);
                // Every cluster must have been heard: the earliest of their latest heartbeats.
                match latest.iter().copied().collect::<Option<Vec<_>>>() {
                    Some(all) => all.into_iter().min().map(Erasure::Caught),
                    None => None,
                }
            }
            Ok(erasure) => Some(erasure),
            Err(RecvError::Lagged(_)) => Some(Erasure::Missed),
            Err(RecvError::Closed) => return,
        };
        if let Some(erasure) = merged {
            let _ = to.send(erasure);
        }
    }
}

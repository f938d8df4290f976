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
                forward(
                    events,
                    &store.events,
                    (KeyEvent::Missed, |event| event),
                    &shutdown
                ),
                forward(
                    erasures,
                    &store.erasures,
                    (Erasure::Missed, from_cluster(at)),
                    &shutdown
                ),
            );
        }
    }))
    .await;
}

/// Sends what `from` hears on to `to`, each through `map`, until `shutdown`; what `from`
/// dropped (its receiver lagged) is sent as `missed`.
async fn forward<T: Clone>(
    mut from: broadcast::Receiver<T>,
    to: &broadcast::Sender<T>,
    (missed, map): (T, impl Fn(T) -> T),
    shutdown: &CancellationToken,
) {
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return,
            next = from.recv() => next,
        };
        let _ = match next {
            Ok(item) => to.send(map(item)),
            Err(RecvError::Lagged(_)) => to.send(missed.clone()),
            Err(RecvError::Closed) => return,
        };
    }
}

/// A cluster's erasures as the merge sends them: a heartbeat heard back names the cluster as
/// the part it confirms.
fn from_cluster(cluster: usize) -> impl Fn(Erasure) -> Erasure {
    move |erasure| match erasure {
        Erasure::Caught { sent, .. } => Erasure::Caught {
            sent,
            part: cluster,
        },
        other => other,
    }
}
